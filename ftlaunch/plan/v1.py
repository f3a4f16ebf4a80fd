"""LLaMA-Factory's v1 trainer (``USE_V1=1``): recognising its configs, checking them in their own
schema, and planning them. Pure, except ``env_wants_v1`` reading a given mapping.

What v1 is, as read in llamafactory 0.9.5 (``llamafactory/cli.py``: ``USE_V1`` switches the whole CLI
to ``llamafactory/v1/launcher.py``):

- its keys are the fields of ``v1/config/{model,data,training,sample}_args.py``, parsed by
  ``HfArgumentParser.parse_dict`` (an unknown key raises unless ``ALLOW_EXTRA_KEYS``); frozen in
  ``data/llamafactory_keys.json`` under ``v1`` by scripts/gen_llamafactory_keys.py;
- batch: ``micro_batch_size`` per rank and ``global_batch_size`` (default: data-parallel size x
  micro); accumulation is derived, ``global_batch_size % (dp_size x micro_batch_size)`` must be 0
  (``core/utils/batching.py``);
- distribution: ``dist_config: {name: fsdp2 | deepspeed, dp_size, cp_size, mp_replicate_size,
  mp_shard_size, offload_params, config_file, ...}`` (``accelerator/interface.py``: ``dp_size x
  cp_size`` and ``mp_replicate_size x mp_shard_size`` must equal the world size); several devices
  are launched with torchrun exactly as v0 (``FORCE_TORCHRUN``, ``NPROC_PER_NODE``);
- precision: ``bf16`` only, default **true** (there is no fp16); ``flash_attn``: eager, sdpa or
  flash_attention_2;
- resume: only when ``resume_from_checkpoint`` is set (``auto`` = the latest complete checkpoint,
  from scratch when there is none: ``core/utils/checkpoint.py``).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from ftlaunch.errors import ConfigError
from ftlaunch.plan import rules
from ftlaunch.plan.batch import split_batch
from ftlaunch.plan.hardware import Hardware
from ftlaunch.plan.keyschema import kind_ok, known_keys, looks_like_path, shipped_keys, validate_values

ENV_VAR = "USE_V1"
# The distributed plugins llamafactory 0.9.5 registers (v1/plugins/trainer_plugins/distributed/hub.py).
DIST_PLUGINS = ("fsdp2", "deepspeed")
PLUGIN_KEYS = (
    "dist_config",
    "optim_config",
    "lr_scheduler_config",
    "init_config",
    "peft_config",
    "kernel_config",
    "quant_config",
)
# Keys of a v0 config that say it is one: with any of them beside v1 keys the config mixes the schemas.
V0_ANCHORS = ("model_name_or_path", "stage", "dataset", "per_device_train_batch_size", "finetuning_type", "do_train")
# Where a v0 (or not yet released v1) key lives in the 0.9.5 v1 schema, for the unknown-key message.
MOVED = {
    "model_name_or_path": "model",
    "dataset": "train_dataset",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "global_batch_size (= micro_batch_size x accumulation x data-parallel size)",
    "deepspeed": "dist_config: {name: deepspeed, config_file: ...}",
    "fsdp": "dist_config: {name: fsdp2}",
    "finetuning_type": "peft_config: {name: lora | freeze}",
    "lora_rank": "peft_config.r",
    "quantization_bit": "quant_config: {name: bnb, quantization_bit: ...}",
    "cp_size": "dist_config.cp_size",
    "cp_mode": "no key: llamafactory 0.9.5's v1 trainer has context parallelism as dist_config.cp_size only",
    "stage": "the command: v1 trains sft (dpo is not implemented in 0.9.5)",
}


@cache
def schema() -> dict[str, Any]:
    """``{"keys": {name: kind}, "choices": {name: [values]}}`` of the v1 trainer."""
    return dict(shipped_keys()["v1"])


def v1_keys() -> dict[str, str]:
    return dict(schema()["keys"])


def env_wants_v1(env: Mapping[str, str]) -> bool:
    """USE_V1 as llamafactory reads it (v1/utils/env.py::is_env_enabled)."""
    return env.get(ENV_VAR, "0").strip().lower() in ("true", "yes", "on", "t", "y", "1")


def schema_of(values: Mapping[str, Any], use_v1: bool) -> tuple[bool, list[str]]:
    """(is it a v1 config, problems). v1 when USE_V1 is set, or when it has v1-only keys and no v0
    anchor; both kinds of key at once is a problem (llamafactory-cli rejects it either way)."""
    if use_v1:
        return True, []
    only_v1 = sorted(k for k in values if k in v1_keys() and k not in known_keys())
    anchors = [k for k in V0_ANCHORS if k in values]
    if not only_v1:
        return False, []
    if anchors:
        return False, [
            f"the config mixes LLaMA-Factory's two schemas: v1 keys ({', '.join(only_v1)}; USE_V1=1) beside v0 "
            f"keys ({', '.join(anchors)}); llamafactory-cli rejects it with or without USE_V1"
        ]
    return True, []


def _plugin(value: Any) -> dict[str, Any] | None:
    """A plugin config as v1 reads it (a mapping, or JSON text starting with '{'), else None."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
        except json.JSONDecodeError:
            return None
        return data if isinstance(data, dict) else None
    return None


def _whole(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def validate(values: Mapping[str, Any]) -> list[str]:
    """Every problem of a v1 config, as llamafactory 0.9.5's v1 parser and trainer would meet it."""
    keys, choices = v1_keys(), schema()["choices"]
    problems: list[str] = []
    for k in sorted(values, key=str):
        if k in keys:
            continue
        if k in MOVED:
            where = f" (in v1: {MOVED[k]})"
        else:
            close = difflib.get_close_matches(str(k), keys, n=1)
            where = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"unknown key {k!r}{where}: llamafactory-cli with USE_V1=1 (the v1 trainer) would reject it")
    for k, v in values.items():
        kind = keys.get(k)
        if kind and kind != "dict" and not kind_ok(kind, v):
            problems.append(f"key {k!r} must be {kind}, got {type(v).__name__} {v!r} (USE_V1)")
        if k in choices and v is not None and str(v) not in choices[k]:
            problems.append(f"key {k!r} must be one of {', '.join(choices[k])} (USE_V1), got {v!r}")
    for k in PLUGIN_KEYS:
        if values.get(k) is None:
            continue
        plugin = _plugin(values[k])
        if plugin is None:
            problems.append(f"key {k!r} must be a mapping with a 'name' (a v1 plugin config), got {values[k]!r}")
        elif "name" not in plugin:
            problems.append(f"key {k!r} needs a 'name': the v1 trainer raises 'Plugin configuration must have a name'")
    dist = _plugin(values.get("dist_config")) or {}
    name = dist.get("name")
    if name is not None and name not in DIST_PLUGINS:
        problems.append(
            f"dist_config.name {name!r} is not a distributed plugin of llamafactory 0.9.5's v1 trainer (USE_V1): "
            f"it has {', '.join(DIST_PLUGINS)}"
        )
    if name == "deepspeed" and not dist.get("config_file"):
        problems.append("dist_config: name deepspeed needs config_file (a DeepSpeed JSON) in the v1 trainer")
    for k in ("dp_size", "cp_size", "mp_replicate_size", "mp_shard_size"):
        if dist.get(k) is not None and not _whole(dist[k], 1):
            problems.append(f"dist_config.{k} must be a whole number >= 1, got {dist[k]!r}")
    if values.get("micro_batch_size") is not None and not _whole(values["micro_batch_size"], 1):
        problems.append(f"key 'micro_batch_size' must be a whole number >= 1, got {values['micro_batch_size']!r}")
    if values.get("global_batch_size") is not None and not _whole(values["global_batch_size"], 1):
        problems.append(f"key 'global_batch_size' must be a whole number >= 1, got {values['global_batch_size']!r}")
    if str(values.get("batching_strategy")) == "dynamic_batching":
        if not (_whole(values.get("max_steps"), 1)):
            problems.append(
                "batching_strategy dynamic_batching needs max_steps >= 1 (the v1 trainer is step-driven then)"
            )
        if values.get("save_epochs") is not None:
            problems.append("save_epochs does not work with batching_strategy dynamic_batching: use save_steps")
    return problems + validate_values(values)


def _local_or_hub(key: str, value: str, base_dir: Path, strict: bool, problems: list[str], warnings: list[str]) -> str:
    """A path-or-hub-id value made absolute when it exists; a missing path that is clearly one
    (./x, /x, a data file's suffix) is a problem for train and a warning for plan."""
    p = Path(value).expanduser()
    absolute = p if p.is_absolute() else base_dir / p
    if absolute.exists():
        return str(absolute.resolve())
    if looks_like_path(value) or p.suffix in (".yaml", ".yml", ".json", ".jsonl", ".parquet", ".csv", ".arrow"):
        (problems if strict else warnings).append(f"{key}: {value} does not exist (resolved to {absolute})")
    return value


def resolve_paths(
    values: Mapping[str, Any], base_dir: Path, *, strict: bool = True
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The v1 config's paths made absolute: (values, problems, warnings), as config.resolve_paths."""
    out = dict(values)
    problems: list[str] = []
    warnings: list[str] = []
    for key in ("model", "train_dataset", "eval_dataset"):
        if isinstance(out.get(key), str) and out[key]:
            out[key] = _local_or_hub(key, out[key], base_dir, strict, problems, warnings)
    if isinstance(out.get("output_dir"), str) and out["output_dir"]:
        p = Path(out["output_dir"]).expanduser()
        out["output_dir"] = str(p if p.is_absolute() else (base_dir / p).absolute())
    resume = out.get("resume_from_checkpoint")
    if isinstance(resume, str) and resume and resume != "auto":
        p = Path(resume).expanduser()
        absolute = p if p.is_absolute() else base_dir / p
        if not absolute.exists():
            problems.append(f"resume_from_checkpoint: {resume} does not exist")
        out["resume_from_checkpoint"] = str(absolute)
    dist = _plugin(out.get("dist_config"))
    if dist and isinstance(dist.get("config_file"), str) and not dist["config_file"].lstrip().startswith("{"):
        p = Path(dist["config_file"]).expanduser()
        absolute = p if p.is_absolute() else base_dir / p
        if absolute.is_file():
            out["dist_config"] = {**dist, "config_file": str(absolute.resolve())}
        else:
            problems.append(f"dist_config.config_file: {dist['config_file']} does not exist (resolved to {absolute})")
    peft = _plugin(out.get("peft_config"))
    if peft and isinstance(peft.get("adapter_name_or_path"), str):
        adapter = _local_or_hub(
            "peft_config.adapter_name_or_path", peft["adapter_name_or_path"], base_dir, strict, problems, warnings
        )
        out["peft_config"] = {**peft, "adapter_name_or_path": adapter}
    return out, problems, warnings


def _offloads(dist: Mapping[str, Any], deepspeed_config: Mapping[str, Any] | None) -> bool:
    """Whether the distributed plugin moves parameters or optimizer state to the host (a reason to
    keep it on one device)."""
    if dist.get("name") == "fsdp2":
        return bool(dist.get("offload_params"))
    zero = (deepspeed_config or {}).get("zero_optimization") or {}
    return any((zero.get(k) or {}).get("device") in ("cpu", "nvme") for k in ("offload_optimizer", "offload_param"))


def plan_v1(
    values: Mapping[str, Any],
    hardware: Hardware,
    options: Any = None,
    *,
    meta: Mapping[str, Any] | None = None,
    deepspeed_config: Mapping[str, Any] | None = None,
) -> Any:
    """Adapt a v1 config to ``hardware``: world size, batch, precision, attention, resume. Pure.

    Invariant: ``global_batch_size`` = ``micro_batch_size`` x accumulation x data-parallel size, with
    the source global batch from --global-batch, else ``global_batch_size`` as written, else
    ``micro_batch_size`` x the data-parallel size it was written for (--source-gpus or the header's).
    Memory is not modelled for v1 configs (said in the warnings). Raises ConfigError (naming USE_V1)
    where the machine cannot run what the config asks."""
    from ftlaunch.plan.planner import Plan, PlanOptions, _Editor

    options = options or PlanOptions()
    meta = meta or {}
    ed = _Editor(values)
    warnings: list[str] = []
    world = hardware.world_size
    dist = _plugin(values.get("dist_config")) or {}
    cp = int(dist.get("cp_size") or 1)
    mp_replicate = int(dist.get("mp_replicate_size") or 1)
    problems = []
    if world % cp:
        problems.append(
            f"USE_V1: dist_config.cp_size {cp} needs a multiple of {cp} devices; {hardware.describe()} runs {world} "
            "process(es). Set dist_config.cp_size to a divisor of the device count, or plan for more GPUs"
        )
    if dist.get("mp_shard_size") is not None and world % mp_replicate:
        problems.append(
            f"USE_V1: dist_config.mp_replicate_size {mp_replicate} does not divide the {world} process(es) of "
            f"{hardware.describe()}"
        )
    if problems:
        raise ConfigError(problems)
    dp = max(1, world // cp)

    # --- strategy: torchrun for several devices, or for one when the plugin offloads
    env = {ENV_VAR: "1"}
    name = dist.get("name")
    if world > 1:
        env.update(rules.torchrun_env(world, hardware.nodes))
        new = dict(dist)
        if dist.get("dp_size") is not None and dist["dp_size"] * cp != world:
            new["dp_size"] = dp
        if dist.get("mp_shard_size") is not None and mp_replicate * dist["mp_shard_size"] != world:
            new["mp_shard_size"] = world // mp_replicate
        if new != dist:
            ed.set("dist_config", new, f"{world} processes: the v1 trainer needs dp_size x cp_size = world size")
    elif name and _offloads(dist, deepspeed_config):
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="1")
    elif name:
        ed.remove(
            "dist_config",
            f"one device: {name} without offload buys nothing there; plain single-process training",
        )

    # --- global batch
    micro_src = int(values.get("micro_batch_size") or 1)
    if options.global_batch is not None:
        g_source, why = int(options.global_batch), "--global-batch"
    elif values.get("global_batch_size"):
        g_source, why = int(values["global_batch_size"]), "global_batch_size as written"
    else:
        source_world = options.source_gpus if options.source_gpus is not None else int(meta.get("world_size", 1))
        source_dp = max(1, source_world // cp)
        g_source, why = micro_src * source_dp, f"micro_batch_size {micro_src} x {source_dp} data-parallel rank(s)"
    per_rank, rem = divmod(g_source, dp)
    if rem or per_rank == 0:
        per_rank = max(1, round(g_source / dp))
        warnings.append(
            f"global batch {g_source} does not divide over {dp} data-parallel rank(s); using {per_rank * dp}, "
            "the nearest achievable"
        )
    g_target = per_rank * dp
    remembered = options.remembered_micro_batch
    micro, accum = split_batch(per_rank, remembered or micro_src)
    reason = f"keeps global batch {g_source} ({why}) on {dp} data-parallel rank(s)"
    if remembered:
        reason = options.remembered_reason or "micro-batch that worked last time on this card"
    if g_target != g_source:
        reason += f"; global batch {g_source} -> {g_target} (nearest divisible)"
    ed.set("micro_batch_size", micro, reason)
    ed.set("global_batch_size", g_target, reason)

    # --- precision: v1 has bf16 (default on) or fp32, no fp16
    wants_bf16 = values.get("bf16", True) is not False and str(values.get("bf16")).lower() != "false"
    precision = "bf16" if wants_bf16 else "fp32"
    if wants_bf16 and not hardware.bf16:
        why_not = (
            "no GPU"
            if not hardware.gpus
            else f"{hardware.gpus[0].name} has no bf16 (it needs compute capability >= 8.0)"
        )
        ed.set("bf16", False, f"{why_not}: the v1 trainer has no fp16, so fp32 (its bf16 default is true)")
        precision = "fp32"

    # --- attention: FlashAttention-2 needs an Ampere or newer GPU
    if values.get("flash_attn") == "flash_attention_2" and not (
        hardware.gpus and all(g.flash_attn for g in hardware.gpus)
    ):
        where = (
            "no GPU"
            if not hardware.gpus
            else f"{hardware.gpus[0].name} (FlashAttention-2 needs compute capability >= 8.0)"
        )
        ed.set("flash_attn", "sdpa", f"{where}: PyTorch's sdpa attention instead")

    # --- resume safety: v1 resumes only when asked; auto = the latest complete checkpoint, if any
    if not values.get("resume_from_checkpoint"):
        ed.set(
            "resume_from_checkpoint",
            "auto",
            "a restart resumes from the last complete checkpoint (the v1 trainer starts from scratch otherwise)",
        )

    quant = _plugin(values.get("quant_config")) or {}
    if quant and not hardware.gpus:
        warnings.append("quant_config (quantized LoRA) needs a CUDA GPU; this run will fail on the CPU")
    warnings.append(
        "USE_V1 config: memory is not modelled for the v1 trainer yet; micro_batch_size is kept as written "
        "(a CUDA OOM at run time halves it, global_batch_size kept)"
    )
    return Plan(
        config=ed.values,
        env=env,
        changes=tuple(ed.changes),
        hardware=hardware,
        world_size=world,
        precision=precision,
        global_batch_source=g_source,
        global_batch_target=g_target,
        micro_batch=micro,
        accumulation=accum,
        warnings=tuple(warnings),
        memory=None,
        schema="v1",
        nodes=hardware.nodes if world > 1 else 1,
    )
