"""The memory simulator: one training run's peak GPU memory measured on fake tensors.

Owns the simulation, the child process it runs in, and what a plan makes of its result
(``simulate_plan``, ``with_simulation``, ``simulation_line``). Planning stays torch-free: the parent
(``plan --simulate``, ``scripts/calibrate_memory.py``) calls :func:`run_child`, which starts
``python -m ftlaunch.plan.memory.simulate`` and reads one JSON line back; only that child imports torch.

The child builds the model from ``config.json`` with ``AutoModelForCausalLM.from_config`` under
``FakeTensorMode`` (no weights, no FLOPs) and prepares it the way llamafactory 0.9.5 does for the
config (``model/adapter.py``, ``model/model_utils/checkpointing.py``): loaded in the compute dtype,
trainable parameters upcast to fp32 unless ``pure_bf16``, LoRA through peft on every ``nn.Linear``
but ``lm_head`` for ``lora_target: all``, freeze tuning on the last N layers, reentrant gradient
checkpointing applied only to layers with trainable parameters (inputs made to require grad).
It then runs two optimizer steps as the HF Trainer does: ``accumulation`` micro-batches of
forward (under ``torch.autocast``) and backward, gradient clipping, ``optimizer.step()``,
``zero_grad(set_to_none=True)``. ``torch.distributed._tools.mem_tracker.MemTracker`` records the
peak of live storages by kind.

Two facts shape it (measured here, see docs/memory-model.md): on a machine without CUDA a fake
``cuda`` device fails in backward, so the device is a fake ``cpu`` with ``torch.autocast("cpu")``;
MemTracker refuses a second forward of the same module unless ``reset_mod_stats()`` is called after
each micro-batch (the global peak survives the reset). Everything in the CUDA-only stack
(bitsandbytes, flash-attention, liger, DeepSpeed) cannot run here: :func:`unsupported` names it and
the caller keeps the formula for those setups.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError
from ftlaunch.plan.memory.peak import GIB, peak_from_tensors
from ftlaunch.plan.memory.prediction import Verdict
from ftlaunch.plan.memory.setup import TrainSetup, setup_from_config

__all__ = ["SimResult", "unsupported", "run_child", "simulate", "main"]


@dataclass(frozen=True)
class SimResult:
    """What one simulation found; ``peak_gib`` is None when the setup cannot be simulated."""

    peak_gib: float | None
    by_kind_bytes: dict[str, int] = field(default_factory=dict)  # MemTracker kinds at the peak
    unsupported: tuple[str, ...] = ()
    seconds: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["unsupported"] = list(self.unsupported)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SimResult:
        return cls(
            peak_gib=d.get("peak_gib"),
            by_kind_bytes={k: int(v) for k, v in (d.get("by_kind_bytes") or {}).items()},
            unsupported=tuple(d.get("unsupported") or ()),
            seconds=float(d.get("seconds") or 0.0),
            error=d.get("error"),
        )


def unsupported(setup: TrainSetup, model_config: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The parts of ``setup`` (on the model of ``model_config``) a CPU-only fake-tensor run cannot
    reproduce (pure)."""
    out: list[str] = []
    cfg = dict((model_config or {}).get("text_config") or model_config or {})
    moe = any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if moe and setup.finetuning_type in ("full", "freeze") and not setup.pure_bf16:
        # transformers' grouped_mm experts need 16-bit weights on the CPU, and its eager experts loop
        # is data-dependent (nonzero), which fake tensors cannot run
        out.append("MoE experts trained in fp32 (the CPU grouped_mm kernel needs 16-bit weights)")
    if setup.quantization_bit is not None:
        out.append(f"bitsandbytes {setup.quantization_bit}-bit quantization (QLoRA needs CUDA)")
    o = setup.optimizer.lower()
    if "8bit" in o or "bnb" in o or "paged" in o or "4bit" in o:
        out.append(f"optimizer {setup.optimizer} (bitsandbytes, CUDA only)")
    elif not (o.startswith("adamw_torch") or o == "sgd"):
        out.append(f"optimizer {setup.optimizer} (the simulator builds torch's AdamW and SGD only)")
    if setup.custom is not None:
        out.append(f"{setup.custom.kind} (LLaMA-Factory's custom optimizer; its package is not simulated)")
    if setup.attn_impl == "fa2":
        out.append("flash-attention 2 (CUDA kernels)")
    if setup.zero_stage:
        out.append(f"DeepSpeed ZeRO-{setup.zero_stage} (partitioning and offload need its engine)")
    if setup.finetuning_type not in ("full", "freeze", "lora"):
        out.append(f"finetuning_type {setup.finetuning_type}")
    return tuple(out)


# ============================================================================================
# Parent side: the child process
# ============================================================================================


def run_child(
    model_config: Mapping[str, Any],
    setup: TrainSetup,
    *,
    steps: int = 2,
    python: str | None = None,
    timeout: float = 1800.0,
) -> SimResult:
    """Simulate in a child ``python -m ftlaunch.plan.memory.simulate`` so this process never imports torch."""
    skip = unsupported(setup, model_config)
    if skip:
        return SimResult(None, unsupported=skip)
    request = json.dumps({"model_config": dict(model_config), "setup": asdict(setup), "steps": steps})
    start = time.monotonic()
    try:
        proc = subprocess.run(
            # -P: a folder named ftlaunch where this runs must not shadow the package (run/procs.python_module)
            [python or sys.executable, "-P", "-m", "ftlaunch.plan.memory.simulate"],
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return SimResult(None, error=f"simulation took longer than {timeout:.0f} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return SimResult(None, error=f"simulator exited {proc.returncode}: {tail[0]}")
    result = SimResult.from_dict(json.loads(lines[-1]))
    return SimResult(result.peak_gib, result.by_kind_bytes, result.unsupported, time.monotonic() - start, result.error)


# ============================================================================================
# Parent side: a plan checked by the simulator
# ============================================================================================


def raw_model_config(values: Mapping[str, Any], model_config: str | None = None) -> dict[str, Any] | None:
    """The config.json dict the simulator builds the model from: --model-config FILE, else a local
    model directory's config.json; None when there is none (``--params`` only guesses shapes)."""
    path = Path(model_config) if model_config else None
    if path is None:
        local = values.get("model_name_or_path")
        if isinstance(local, str) and (Path(local) / "config.json").is_file():
            path = Path(local) / "config.json"
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if isinstance(data.get("text_config"), dict):  # composite (vision) models: the language model only
        data = {"model_type": data["text_config"].get("model_type", data.get("model_type")), **data["text_config"]}
    return data


def simulate_plan(plan: Any, model_config: str | None = None, *, python: str | None = None) -> dict[str, Any]:
    """Run the simulator (a child process, ftlaunch.plan.memory.simulate) on the setup ``plan`` chose.

    Returns the simulated tensor peak and, comparable with the card, that peak plus the same
    overhead the formulas add; beside them the formula's figures. What cannot be simulated (QLoRA,
    flash-attention, DeepSpeed, 8-bit optimizers) is listed and the formula stands alone.
    """
    mem = plan.memory
    out: dict[str, Any] = {
        "formula_tensors_gib": mem.estimate.tensors_gib if mem else None,
        "formula_peak_gib": mem.peak_gib if mem else None,
    }
    # kernels that replace transformers' modules (and their memory) are not in the simulator
    kernels = [k for k in ("enable_liger_kernel", "use_unsloth", "use_unsloth_gc") if plan.config.get(k)]
    if kernels:
        out["unsupported"] = [f"{k} (kernels the simulator does not run)" for k in kernels]
        return out
    cfg = raw_model_config(plan.config, model_config)
    if cfg is None or not plan.hardware.gpus:
        out["error"] = "no config.json to build the model from" if cfg is None else "no GPU: nothing to simulate"
        return out
    setup = setup_from_config(
        dict(plan.config),
        world_size=plan.world_size,
        default_optim=(mem.optimizer if mem else "") or "adamw_torch",
    )
    res = run_child(cfg, setup, python=python)
    out.update(res.to_dict())
    out["simulated_tensors_gib"] = out.pop("peak_gib")
    if res.peak_gib is not None:
        out["simulated_peak_gib"] = round(peak_from_tensors(res.peak_gib, plan.world_size), 2)
    return out


def simulation_wanted(plan: Any, simulate: bool | None) -> bool:
    """`train` simulates when asked, or by itself when the verdict is tight (None). Pure."""
    return simulate is True or (simulate is None and plan.memory is not None and plan.memory.verdict is Verdict.TIGHT)


def with_simulation(plan: Any, sim: Mapping[str, Any]) -> Any:
    """The plan with the simulator's result in its memory (plan.json) and, when the simulated peak
    exceeds the card, a warning (the OOM ladder stands by). Pure."""
    warnings = list(plan.warnings)
    capacity = plan.memory.capacity_gib if plan.memory else None
    if sim.get("simulated_peak_gib") and capacity and sim["simulated_peak_gib"] > capacity:
        warnings.append(
            f"the simulator puts the peak at {sim['simulated_peak_gib']:.2f} GiB, above the card's {capacity:.2f} GiB: "
            "expect an OOM; recovery will step the micro-batch down (global batch kept)"
        )
    return replace(plan, simulated=dict(sim), warnings=tuple(warnings))


def simulation_line(sim: dict[str, Any]) -> str:
    if sim.get("simulated_peak_gib") is None:
        why = sim.get("error") or "; ".join(sim.get("unsupported") or [])
        return f"not simulated ({why}): the formula's figure stands"
    return (
        f"simulated peak {sim['simulated_peak_gib']:.2f} GiB (tensors {sim['simulated_tensors_gib']:.2f}) "
        f"beside the formula's {sim['formula_peak_gib']:.2f} GiB (tensors {sim['formula_tensors_gib']:.2f}); "
        f"{sim['seconds']:.0f} s"
    )


# ============================================================================================
# Child side (imports torch)
# ============================================================================================


def _prepare(model: Any, setup: TrainSetup) -> Any:
    """Trainable parameters and checkpointing as llamafactory 0.9.5 sets them (adapter.py)."""
    import torch

    ft = setup.finetuning_type
    if ft == "lora":
        from peft import LoraConfig, get_peft_model
        from peft.tuners import tuners_utils

        # peft moves each new adapter to its base layer's device (and dtype) with Module.to(), which
        # swaps every fake parameter in place, even onto the device it is on, and fails. Everything
        # is on the one fake device, and the adapters are created in fp32, the dtype llamafactory
        # upcasts them to right after: both moves are no-ops here.
        tuners_utils.BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
        module_to = torch.nn.Module.to

        def same_device_to(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs and len(args) == 1 and all(p.device == torch.device(args[0]) for p in self.parameters()):
                return self
            return module_to(self, *args, **kwargs)

        torch.nn.Module.to = same_device_to  # type: ignore[method-assign]

        if setup.lora_target.strip() == "all":
            # llamafactory find_all_linear_modules: every nn.Linear's last name, lm_head excluded
            targets = sorted(
                {
                    name.split(".")[-1]
                    for name, mod in model.named_modules()
                    if isinstance(mod, torch.nn.Linear) and "lm_head" not in name
                }
            )
        else:
            targets = [t.strip() for t in setup.lora_target.split(",") if t.strip()]
        cfg = LoraConfig(
            task_type="CAUSAL_LM",
            r=setup.lora_rank,
            lora_alpha=setup.lora_rank * 2,
            lora_dropout=0.0,
            target_modules=targets,
        )
        try:
            model = get_peft_model(model, cfg)
        finally:
            torch.nn.Module.to = module_to  # type: ignore[method-assign]
    elif ft == "freeze":
        n = setup.freeze_trainable_layers
        layers = model.config.num_hidden_layers
        ids = range(max(0, layers - n), layers) if n > 0 else range(min(-n, layers))
        keys = tuple(f".{i}." for i in ids)
        for name, p in model.named_parameters():
            p.requires_grad_(any(k in name for k in keys))
    if not setup.pure_bf16:  # cast_trainable_params_to_fp32 (adapter.py)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32)
    if setup.gradient_checkpointing:
        _enable_checkpointing(model)
    return model


def _enable_checkpointing(model: Any) -> None:
    """llamafactory's custom_gradient_checkpointing_func: reentrant checkpoint on layers that train,
    their hidden-state input made to require grad; frozen layers run without checkpointing."""
    from functools import partial

    import torch
    from torch.utils.checkpoint import checkpoint

    def func(fn: Any, *args: Any, **kwargs: Any) -> Any:
        module = fn.func.__self__ if isinstance(fn, partial) else fn.__self__
        if any(p.requires_grad for p in module.parameters()):
            for arg in args:
                if torch.is_tensor(arg) and torch.is_floating_point(arg):
                    arg.requires_grad_(True)
                    break
            return checkpoint(fn, *args, use_reentrant=True, **kwargs)
        return fn(*args, **kwargs)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    base.config.use_cache = False


def _optimizer(params: list[Any], name: str) -> Any:
    """torch.optim as HF TrainingArguments builds it; CUDA's defaults made explicit (the fake
    device is ``cpu``, where torch would pick the for-loop implementation)."""
    import torch

    o = name.lower()
    if o == "sgd":
        return torch.optim.SGD(params, lr=1e-5, foreach=True)
    kwargs: dict[str, Any] = {"lr": 1e-5, "weight_decay": 0.0}
    if "fused" in o:
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(params, **kwargs)


class _NoHook:
    def remove(self) -> None:
        pass


def _tracker() -> Any:
    """MemTracker that leaves frozen parameters alone: it hooks every parameter's gradient, and
    torch refuses a hook on a tensor that does not require grad (all of the base model under LoRA)."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Only the global peak is read. The base class also walks every tracked module on every
            # operation to keep per-module peaks, which made a full-depth step several times slower.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(snap)

    return Tracker()


def simulate(model_config: Mapping[str, Any], setup: TrainSetup, steps: int = 2) -> SimResult:
    """Run ``steps`` optimizer steps of ``setup`` on fake tensors and return the tracked peak."""
    skip = unsupported(setup, model_config)
    if skip:
        return SimResult(None, unsupported=skip)
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.monotonic()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[setup.compute_dtype]
    raw = dict(model_config)
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    attn = {"eager": "eager", "sdpa": "sdpa"}[setup.attn_impl]
    b, s = setup.micro_batch, setup.seq_len
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
        model = _prepare(model, setup)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(params, setup.optimizer)
        tracker = _tracker()
        tracker.track_external(model, opt)
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
        # Every micro-batch after the first meets the gradients alive, so two stand for any
        # accumulation > 1 (64 would take 30 times as long; the simulator showed ~4 MB more per
        # further micro-batch, a growth not explained yet, 0.9 % after 64).
        micro_batches = min(setup.accumulation, 2)
        with tracker:
            for _ in range(steps):
                for _ in range(micro_batches):
                    ids = torch.randint(0, cfg.vocab_size, (b, s))
                    # a padding mask as llamafactory's collator passes one; at b == 1 nothing is padded
                    mask = torch.ones(b, s, dtype=torch.long) if b > 1 else None
                    with autocast:
                        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
                    (loss / setup.accumulation).backward()
                    del loss, ids, mask
                    tracker.reset_mod_stats()
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
    dev = next(iter(snap.values()))
    by_kind = {str(getattr(k, "value", k)): int(v) for k, v in dev.items() if v}
    total = by_kind.get("Total", sum(v for k, v in by_kind.items() if k != "Total"))
    return SimResult(round(total / GIB, 6), by_kind, (), time.monotonic() - start)


def main() -> None:
    """Child entry point: one JSON request on stdin, one JSON result line on stdout."""
    req = json.loads(sys.stdin.read())
    setup = TrainSetup(**req["setup"])
    try:
        result = simulate(req["model_config"], setup, int(req.get("steps", 2)))
    except Exception as exc:  # reported to the parent, which falls back to the formulas
        result = SimResult(None, error=f"{type(exc).__name__}: {exc}"[:500])
    sys.stdout.write(json.dumps(result.to_dict()) + "\n")


if __name__ == "__main__":
    main()
