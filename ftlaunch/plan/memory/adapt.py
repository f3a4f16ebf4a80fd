"""Glue between the planner and the memory model: finds the model's shape and builds the chooser.

``model_spec_for`` reads config.json and ``installed_default_optimizer`` reads package versions
(small shells); ``make_memory_chooser`` returns a pure callable the planner calls with the config it
is building, and ``host_ram_for`` decides which host RAM a plan may count on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError, DoesNotFitError, HardwareError
from ftlaunch.files import JSON_LIMIT, read_user_bytes
from ftlaunch.plan import rules
from ftlaunch.plan.change import Change
from ftlaunch.plan.hardware import Hardware
from ftlaunch.plan.memory.choose import MIN_HEADROOM, TIGHT, Choice, choose_micro_batch, gib_pair
from ftlaunch.plan.memory.host import choose_on_host
from ftlaunch.plan.memory.optimizers import describe, unbuildable
from ftlaunch.plan.memory.prediction import MemoryPrediction
from ftlaunch.plan.memory.setup import default_optimizer, setup_from_config
from ftlaunch.plan.memory.store import correction_from
from ftlaunch.plan.offload import ZERO3_OFFLOAD, carry_over, materialize, offload_config_path


@dataclass(frozen=True)
class MemoryDecision:
    micro_batch: int | None
    memory: MemoryPrediction
    edits: tuple[Change, ...] = ()  # config changes, values as the trainer needs them
    env: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    batch_reason: str | None = None


def model_spec_for(
    values: Mapping[str, Any], params: str | None, model_config: str | None = None
) -> tuple[Any, str | None]:
    """(ModelSpec or None, a note when the size is unknown or guessed).

    Order: --model-config FILE, --params, a local model directory's config.json.
    """
    import json

    from ftlaunch.plan import modelspec

    if model_config:
        try:
            what = f"--model-config {model_config}"
            data = read_user_bytes(model_config, limit=JSON_LIMIT, what=what, error=ConfigError)
            return modelspec.spec_from_config(json.loads(data)), None
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"--model-config {model_config}: {exc}") from None

    if params:
        try:
            return modelspec.spec_from_param_count(params), f"model size from --params {params} (shapes guessed)"
        except ValueError as exc:
            raise ConfigError(f"--params {params!r}: {exc}") from None
    path = values.get("model_name_or_path")
    if isinstance(path, str) and Path(path).is_dir():
        try:
            spec = modelspec.load_model_spec(path)
        except (ValueError, KeyError) as exc:
            return None, f"{path}/config.json: cannot size the model ({exc}); memory model skipped"
        if spec is not None:
            return spec, None
    return None, (
        f"model size unknown for {path!r} (not a local directory with config.json): memory model "
        "skipped; download it first (`ftlaunch download`) or pass --params 7B"
    )


# A what-if plan for a catalog card (--gpu) knows nothing of that machine's host RAM. Single-GPU
# cloud machines commonly pair a card with at least twice its memory in RAM; this is an assumption,
# said in every reason that relies on it, and --host-ram replaces it.
ASSUMED_HOST_RAM_PER_GPU_GIB = 2.0


def host_ram_for(hw: Hardware) -> tuple[float | None, str | None]:
    """(host RAM GiB the plan may count on, a note when it is assumed). Pure.

    A probed machine or a ``--hardware`` file carries its own RAM. A catalog card (``--gpu``) without
    an explicit ``--host-ram`` gets ASSUMED_HOST_RAM_PER_GPU_GIB x its GPU memory, never the RAM of
    the machine planning it.
    """
    if hw.host_ram_gib is not None:
        if hw.source == "catalog:none" and hw.host_available_gib is not None:
            return hw.host_ram_gib, "this machine's (--gpu none trains on its CPU); --host-ram plans for another"
        return hw.host_ram_gib, None
    if hw.source.startswith("catalog:") and hw.gpus:
        assumed = round(ASSUMED_HOST_RAM_PER_GPU_GIB * sum(g.total_gib for g in hw.gpus))
        return float(assumed), f"unknown for a --gpu what-if, assumed {assumed} GiB; pass --host-ram"
    return None, None


def offload_config() -> dict[str, Any]:
    """The bundled ZeRO-3 CPU-offload JSON (offload.ZERO3_OFFLOAD), parsed: what a user's own JSON is
    merged into when offload replaces it (offload.carry_over)."""
    import json

    return json.loads(Path(offload_config_path()).read_text())


def installed_default_optimizer() -> tuple[str, str]:
    """(optimizer HF Trainer uses when ``optim`` is unset, why), from the installed transformers and
    torch versions (importlib.metadata: nothing is imported)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for pkg in ("transformers", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    optim = default_optimizer(versions["transformers"], versions["torch"])
    seen = ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items())
    return optim, f"optim unset: {optim} is the default with {seen}"


def _prediction(
    choice: Choice,
    spec: Any,
    values: Mapping[str, Any],
    capacity: float,
    headroom: float,
    optim_why: str,
    host_ram: float | None,
    host_note: str | None,
) -> MemoryPrediction:
    """The plan's ``memory`` for a choice made against ``capacity`` GiB (a card, or host RAM)."""
    return MemoryPrediction(
        estimate=choice.estimate,
        capacity_gib=round(capacity, 2),
        usable_gib=round(capacity * (1 - headroom), 2),
        headroom=headroom,
        verdict=choice.verdict,
        headroom_gib=round(choice.headroom_gib, 2),
        headroom_share=round(choice.headroom_share, 4),
        tried=choice.tried,
        model_params=spec.params,
        optimizer=describe(choice.setup.custom, choice.setup.optimizer),
        optimizer_source="config" if values.get("optim") else optim_why,
        host_ram_gib=host_ram,
        host_ram_note=host_note,
    )


def _host_decision(
    spec: Any,
    values: Mapping[str, Any],
    hw: Hardware,
    per_device: int,
    most: int | None,
    headroom: float,
    optim_default: str,
    optim_why: str,
) -> MemoryDecision | None:
    """A CPU plan's verdict against host RAM (memory/host.py); None when the RAM is not known."""
    host_ram, host_note = host_ram_for(hw)
    if host_ram is None:
        return None
    setup = setup_from_config(dict(values), world_size=1, default_optim=optim_default)
    choice = choose_on_host(
        spec,
        setup,
        host_ram_gib=host_ram,
        per_device_batch=per_device,
        headroom=headroom,
        max_micro_batch=most,
        processes=hw.world_size,
    )
    usable = host_ram * (1 - headroom)
    mem = replace(_prediction(choice, spec, values, host_ram, headroom, optim_why, host_ram, host_note), device="host")
    peak = choice.estimate.peak_gib
    where = f"{host_ram:g} GiB of host RAM" + (f" ({host_note})" if host_note else "")
    if hw.world_size > 1:
        where += f", {hw.world_size} trainer processes"
    if choice.micro_batch is None:
        alternatives = [a.to_dict() for a in choice.alternatives]
        p, limit = gib_pair(peak, host_ram * (1 - min(headroom, MIN_HEADROOM)))
        raise DoesNotFitError(
            f"{spec.params / 1e9:.2f}B-parameter model, {setup.finetuning_type} fine-tuning on the CPU (fp32), "
            f"cutoff_len {setup.seq_len}: peak {p} GiB of host memory at micro-batch 1 > {limit} GiB: "
            f"{where} less {MIN_HEADROOM:.0%}; the kernel's OOM killer would end the run",
            hint="ftlaunch never changes the method or data on its own; pick one of the options above, "
            "or plan for a GPU (--gpu)",
            alternatives=alternatives,
            payload={
                "hardware": hw.to_dict(),
                "config": dict(values),
                "memory": {**mem.to_dict(), "alternatives": alternatives},
            },
        )
    cannot = unbuildable(setup.custom, setup.optimizer)
    warnings: tuple[str, ...] = (cannot,) if cannot else ()
    if choice.verdict == TIGHT:
        reason = (
            f"TIGHT: largest micro-batch dividing {per_device} within host RAM: predicted peak {peak:.2f} GiB "
            f"of {where} leaves {choice.headroom_share:.1%}, less than the {headroom:.0%} target"
        )
        warnings += (
            f"tight: predicted host peak {peak:.2f} GiB of {where} ({choice.headroom_share:.1%} free, target "
            f"{headroom:.0%}); other processes' memory or a longer batch may bring the OOM killer",
        )
    else:
        reason = (
            f"largest micro-batch dividing {per_device} that fits host RAM: predicted peak {peak:.2f} GiB "
            f"<= {usable:.1f} GiB usable ({where}, {headroom:.0%} headroom)"
        )
    available = hw.host_available_gib
    if available is not None and hw.host_ram_gib == host_ram and peak > available:
        warnings += (
            f"the host has {available:.1f} GiB available now (other processes hold the rest); the run needs "
            f"{peak:.2f} GiB",
        )
    return MemoryDecision(choice.micro_batch, mem, (), {}, warnings, reason)


def make_memory_chooser(
    spec: Any,
    deepspeed_config: Mapping[str, Any] | None,
    *,
    headroom: float,
    default_optim: tuple[str, str] | None = None,
    observed: Mapping[str, Any] | None = None,
):
    """The planner's memory callback. ``default_optim`` = (name, why) from
    :func:`installed_default_optimizer`, read once by the caller (default: read here, now).
    ``observed`` = what an earlier run of this config on this card used
    (``store.recall(env, key)["observed"]``): predictions are scaled up to it."""
    optim_default, optim_why = default_optim or installed_default_optimizer()
    correction, correction_why = correction_from(observed)

    def choose(values: Mapping[str, Any], hw: Hardware, per_device: int, most: int | None) -> MemoryDecision | None:
        if not hw.gpus:
            why = rules.cuda_only(values, spec.quant_method, spec.quant_bits)
            if why:
                raise HardwareError(f"cannot train on {hw.describe()}: {why}", hint="plan it for a CUDA GPU (--gpu)")
            # CPU training: host RAM, not a card, is the limit
            return _host_decision(spec, values, hw, per_device, most, headroom, optim_default, optim_why)
        ds = deepspeed_config if values.get("deepspeed") else None
        setup = setup_from_config(
            dict(values), world_size=hw.world_size, deepspeed_config=ds, default_optim=optim_default
        )
        if spec.quant_bits and setup.finetuning_type in ("lora", "oft"):
            # a PTQ checkpoint's linear weights are stored at its bits, whatever quantization_bit says
            setup = replace(setup, quantization_bit=spec.quant_bits)
        zero3_refused = "; ".join(str(r) for r in rules.zero3_refusals(values, spec.quant_method)) or None
        ds_refused = None
        if rules.deepspeed_missing(hw.versions):
            ds_refused = f"DeepSpeed is not installed in the trainer's environment; install it: {rules.DEEPSPEED_PIP}"
        elif rules.deepspeed_refusals(values):
            ds_refused = "; ".join(str(r) for r in rules.deepspeed_refusals(values))
        capacity = min(g.total_gib for g in hw.gpus)
        host_ram, host_note = host_ram_for(hw)
        choice = choose_micro_batch(
            spec,
            setup,
            capacity_gib=capacity,
            per_device_batch=per_device,
            headroom=headroom,
            host_ram_gib=host_ram,
            host_ram_note=host_note,
            bf16_capable=hw.bf16,
            can_flash=all(g.flash_attn for g in hw.gpus),
            correction=correction,
            max_micro_batch=most,
            zero3_refused=zero3_refused,
            deepspeed_refused=ds_refused,
        )
        peak_gib = choice.estimate.peak_gib
        usable = capacity * (1 - headroom)
        mem = replace(
            _prediction(choice, spec, values, capacity, headroom, optim_why, host_ram, host_note),
            correction=round(correction, 4),
            correction_note=correction_why,
        )
        if choice.micro_batch is None:
            alternatives = [a.to_dict() for a in choice.alternatives]
            peak, limit = gib_pair(peak_gib, capacity * (1 - min(headroom, MIN_HEADROOM)))
            raise DoesNotFitError(
                f"{spec.params / 1e9:.2f}B-parameter model, {setup.finetuning_type} fine-tuning, "
                f"cutoff_len {setup.seq_len}: peak {peak} GiB at micro-batch 1 > {limit} GiB on "
                f"{hw.describe()}: capacity less {MIN_HEADROOM:.0%}, the least headroom even a tight "
                f"plan keeps (target {headroom:.0%})"
                + (
                    f"; ZeRO-3 CPU offload is not an option here: {ds_refused or zero3_refused}"
                    if (ds_refused or zero3_refused) and setup.zero_stage != 3
                    else ""
                ),
                hint="ftlaunch never changes the method or data on its own; pick one of the options above "
                "(ordered: same numbers first, then numerics, then method or data)",
                alternatives=alternatives,
                payload={
                    "hardware": hw.to_dict(),
                    "config": dict(values),
                    "memory": {**mem.to_dict(), "alternatives": alternatives},
                },
            )
        edits: list[Change] = []
        env: dict[str, str] = {}
        for change in choice.changes:
            # the launch env follows from the whole plan (rules.launch_env, in the planner), not from here
            new, _ = materialize(change.new)
            if change.new == ZERO3_OFFLOAD and deepspeed_config:
                # the user's own JSON is replaced (or was dropped for one device): its other settings
                # carried over (inline), what is dropped said; nothing to carry (the bundled JSON itself,
                # re-planned): the bundled file
                bundled = offload_config()
                merged, dropped = carry_over(deepspeed_config, bundled)
                if merged != bundled:
                    new = merged
                    said = f"; dropped from the config's DeepSpeed JSON: {', '.join(dropped)}" if dropped else ""
                    why = f"{change.reason}; the user's other DeepSpeed settings carried over (inline){said}"
                    change = replace(change, reason=why)
            edits.append(replace(change, new=new))
        warnings: tuple[str, ...] = (correction_why,) if correction_why else ()
        cannot = unbuildable(setup.custom, setup.optimizer)
        if cannot:
            warnings += (cannot,)
        upto = f", at most {most} (what worked on this card before)," if most else ""
        if choice.verdict == TIGHT:
            reason = (
                f"TIGHT: largest micro-batch dividing {per_device}{upto} within the card: predicted peak "
                f"{peak_gib:.2f} GiB of {capacity:.2f} GiB leaves {choice.headroom_share:.1%} "
                f"({choice.headroom_gib:.2f} GiB) headroom, less than the {headroom:.0%} target"
            )
            warnings += (
                f"tight: predicted peak {peak_gib:.2f} GiB of {capacity:.2f} GiB "
                f"({choice.headroom_share:.1%} headroom, target {headroom:.0%}); an OOM is recovered by the "
                "next rung (smaller micro-batch, then offload)",
            )
        else:
            reason = (
                f"largest micro-batch dividing {per_device}{upto} that fits: predicted peak "
                f"{peak_gib:.1f} GiB <= {usable:.1f} GiB usable ({capacity:.0f} GiB, {headroom:.0%} headroom); "
                f"fits, {choice.headroom_share:.0%} of the card free"
            )
        return MemoryDecision(choice.micro_batch, mem, tuple(edits), env, warnings, reason)

    return choose
