"""Making a plan for a request: load and resolve the config, find the hardware (probe, catalog or
file), fetch from the hub when asked, size the model, recall what worked on this card before, and
plan once with the memory model (``make_plan``). The shell around the pure ``planner.plan``: the run
id and the config key are made here, once, and the plan it returns is final (``plan.prepared``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftlaunch.errors import ConfigError, HardwareError, StateError
from ftlaunch.plan.config import (
    PATH_KEYS,
    LoadedConfig,
    load_config,
    load_deepspeed,
    resolve_paths,
    training_problems,
    what_if_reason,
)
from ftlaunch.plan.hardware import Hardware, catalog_hardware, on_nodes
from ftlaunch.plan.memory.adapt import make_memory_chooser, model_spec_for
from ftlaunch.plan.memory.store import config_key, recall
from ftlaunch.plan.planner import Plan, PlanOptions, global_batch_for, plan
from ftlaunch.plan.prepared import final_plan
from ftlaunch.probe.hardware import host_memory, load_hardware_file, probe
from ftlaunch.run.store import new_run_id, runs_root

if TYPE_CHECKING:
    from ftlaunch.hub.model import Prefetch


@dataclass(frozen=True)
class PlanSettings:
    """What to plan for: the machine, the batch, the memory policy and the hub. Declared once: a
    `PlanRequest` and the `RunOptions` of `train` / `schedule add` are both these and more."""

    gpu: str | None = None
    hardware_file: str | None = None
    source_gpus: int | None = None
    global_batch: int | None = None
    headroom: float = 0.12
    params: str | None = None
    model_config: str | None = None
    host_ram_gib: float | None = None  # host RAM to plan offload with; default: the probed machine's
    keep_devices: bool = False  # every GPU with the nearest global batch, rather than fewer GPUs keeping it
    mirror: str | None = None  # download from the hub first: None = no, "auto" or a name/URL


@dataclass(frozen=True, kw_only=True)
class PlanRequest(PlanSettings):
    config: str
    overrides: tuple[str, ...] = ()
    strict_files: bool = False  # train: a missing dataset is an error, plan: a warning
    download_weights: bool = False  # train: the whole snapshot; plan: config.json only
    tokenizer_files: bool = False  # estimate: the tokenizer files (and config.json), not the weights
    cwd: str | None = None
    progress: bool = False  # download progress bars: the CLI's answer to "is stderr a terminal?"
    nodes: int = 1  # alike nodes of the machine (a Slurm job's, set by its engine): planned nodes x processes


def get_hardware(req: PlanRequest, env: Mapping[str, str], disk_path: str | Path = ".") -> Hardware:
    """The machine ``req`` plans for: ``req.nodes`` of the one --gpu names, --hardware describes or the probe finds."""
    return on_nodes(_one_node(req, env, disk_path), req.nodes)


def _one_node(req: PlanRequest, env: Mapping[str, str], disk_path: str | Path) -> Hardware:
    if req.gpu and req.hardware_file:
        raise HardwareError("--gpu and --hardware both given", hint="use one of them")
    if req.gpu is not None:  # `--gpu ''` names no card: refused by catalog_hardware, never a probe
        # A what-if for another machine never counts this machine's RAM (memory.adapt.host_ram_for assumes).
        hw = catalog_hardware(req.gpu, host_ram_gib=req.host_ram_gib)
        if not hw.gpus and req.host_ram_gib is None:  # --gpu none trains on this CPU: its RAM is the limit
            total, available = host_memory()
            hw = replace(hw, host_ram_gib=total, host_available_gib=available)
        return hw
    if req.hardware_file:
        try:
            hw = load_hardware_file(req.hardware_file)
        except (AttributeError, TypeError, KeyError, ValueError) as exc:  # valid JSON of the wrong shape
            raise HardwareError(
                f"hardware file {req.hardware_file} does not describe a machine ({type(exc).__name__}: {exc})",
                hint="write it with `ftlaunch env --json > hw.json`",
            ) from None
    else:
        hw = probe(env, disk_path=disk_path)
    if req.host_ram_gib:
        hw = replace(hw, host_ram_gib=req.host_ram_gib, host_available_gib=req.host_ram_gib)
    return hw


def make_v1_plan(
    req: PlanRequest, env: Mapping[str, str], loaded: LoadedConfig, run_id: str
) -> tuple[LoadedConfig, Plan]:
    """A config of LLaMA-Factory's v1 trainer (USE_V1=1), planned in its own schema (ftlaunch.plan.v1)."""
    from ftlaunch.plan import v1

    values, problems, warnings = v1.resolve_paths(loaded.values, loaded.base_dir, strict=req.strict_files)
    ds = None
    dist = values.get("dist_config")
    if not problems and isinstance(dist, dict) and dist.get("name") == "deepspeed" and dist.get("config_file"):
        try:
            ds = load_deepspeed({"deepspeed": dist["config_file"]})
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    if req.mirror:
        warnings.append("--mirror: USE_V1 configs are not pre-downloaded yet; the trainer fetches `model` itself")
    hw = get_hardware(req, env, disk_path=values.get("output_dir") or ".")
    options = PlanOptions(
        source_gpus=req.source_gpus,
        global_batch=req.global_batch,
        headroom=req.headroom,
        keep_devices=req.keep_devices,
    )
    p = v1.plan_v1(values, hw, options, meta=loaded.meta, deepspeed_config=ds)
    key = config_key(loaded.values, p.hardware.gpu_model, p.global_batch_target)  # v1 recalls nothing: made after
    return loaded, final_plan(p, run_id=run_id, memory_key=key, warnings=warnings)


def make_plan(req: PlanRequest, env: Mapping[str, str]) -> tuple[LoadedConfig, Plan]:
    """The final plan for ``req``, made for one run: its id (``Plan.run_id``, the folder `create_run` makes)
    and its config key (``Plan.memory_key``: what worked on this card is recalled and learned under it)."""
    from ftlaunch.plan.v1 import env_wants_v1

    run_id = new_run_id()  # the run this plan is for: pre-downloaded datasets' dataset_info.json lives in its folder
    loaded = load_config(req.config, req.overrides, cwd=req.cwd, use_v1=env_wants_v1(env))
    if loaded.v1:
        return make_v1_plan(req, env, loaded, run_id)
    values, warnings, ds = _checked_values(req, loaded)
    fetched, datasets, run_dir, offline = _prefetch(req, env, values, loaded, run_id)
    hw = get_hardware(req, env, disk_path=values.get("output_dir") or ".")
    model_config = req.model_config
    if fetched is not None and model_config is None and (Path(fetched.path) / "config.json").exists():
        model_config = str(Path(fetched.path) / "config.json")
    spec, spec_note = model_spec_for(values, req.params, model_config)
    if spec_note:
        warnings.append(spec_note)
    options = PlanOptions(
        source_gpus=req.source_gpus,
        global_batch=req.global_batch,
        headroom=req.headroom,
        keep_devices=req.keep_devices,
    )
    # What worked on this card before: the micro-batch a recovered run settled on (the most the
    # chooser may take) and the GPU memory a run was seen to use (the chooser's correction).
    # The one config key of this plan: recalled under here, and the run's state keeps it (Plan.memory_key).
    key = config_key(
        loaded.values, hw.gpu_model, global_batch_for(values, hw.world_size, options, loaded.meta, ds, hw.nodes).target
    )
    learned = _recall_learned(env, key, warnings)
    options = _with_learned(options, learned, hw.gpu_model)
    chooser = None
    if spec is not None:
        chooser = make_memory_chooser(spec, ds, headroom=req.headroom, observed=learned.get("observed"))
    p = plan(values, hw, options, meta=loaded.meta, memory_chooser=chooser, deepspeed_config=ds)
    return loaded, final_plan(
        p,
        run_id=run_id,
        memory_key=key,
        warnings=warnings,
        resolved_paths=[k for k in PATH_KEYS if k in values and loaded.values.get(k) != values.get(k)],
        model=fetched,
        weights=req.download_weights,
        datasets=datasets,
        run_dir=run_dir,
        offline_env=offline,
    )


def _checked_values(req: PlanRequest, loaded: LoadedConfig) -> tuple[dict[str, Any], list[str], dict[str, Any] | None]:
    """The config with its paths resolved, its warnings and its DeepSpeed config; every problem raised at once."""
    values, problems, warnings = resolve_paths(
        loaded.values, loaded.base_dir, strict=req.strict_files, what_if=what_if_reason(req)
    )
    # train, schedule add and estimate (strict) size a training run; plan only shows what it would be.
    (problems if req.strict_files else warnings).extend(training_problems(values))
    ds = None
    if not problems:
        try:
            ds = load_deepspeed(values)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    return values, warnings, ds


def _hub_files(req: PlanRequest) -> str:
    """Which files of the model's snapshot --mirror fetches (a row of hub.model.FILE_PATTERNS)."""
    if req.download_weights:
        return "all"
    return "tokenizer" if req.tokenizer_files else "config"


def _prefetch(
    req: PlanRequest, env: Mapping[str, str], values: dict[str, Any], loaded: LoadedConfig, run_id: str
) -> tuple[Prefetch | None, Any, Path | None, Mapping[str, str] | None]:
    """With --mirror: the model (and, to train, the hub datasets) downloaded; (model, datasets, run_dir, the
    trainer's offline env). Without it nothing is fetched."""
    fetched: Prefetch | None = None
    hub_id = values.get("model_name_or_path")
    offline = None  # the trainer's env once its files are downloaded: only --mirror downloads
    if req.mirror:  # the hub is imported to download only: a plan without --mirror stays quick
        from ftlaunch.hub.download import offline_env
        from ftlaunch.hub.model import prefetch_model
        from ftlaunch.hub.repo import is_repo_id

        offline = offline_env()
    if req.mirror and is_repo_id(hub_id, cwd=Path.cwd()):
        fetched = prefetch_model(
            str(hub_id), req.mirror, env, files=_hub_files(req), progress=req.progress
        )
    datasets = run_dir = None
    if req.mirror and req.download_weights:  # train: hub datasets too, so the offline trainer finds them
        from ftlaunch.hub.datasets import prefetch_datasets

        datasets = prefetch_datasets(values, req.mirror, env, cwd=loaded.base_dir, progress=req.progress)
        run_dir = runs_root(env) / run_id
    return fetched, datasets, run_dir, offline


def _recall_learned(env: Mapping[str, str], key: str, warnings: list[str]) -> dict[str, Any]:
    """What worked on this card before under ``key``; a torn or foreign learned.json is said, not used."""
    try:
        return recall(env, key) or {}
    except StateError as exc:  # another version's or a torn learned.json: plan without it, say so
        warnings.append(f"what worked on this card before was not used: {exc.message}")
        return {}


def _with_learned(options: PlanOptions, learned: Mapping[str, Any], gpu_model: str) -> PlanOptions:
    """The plan options with the micro-batch a recovered run settled on, as the most the chooser may take."""
    if not learned.get("micro_batch"):
        return options
    return replace(
        options,
        remembered_micro_batch=int(learned["micro_batch"]),
        remembered_reason=f"micro-batch {learned['micro_batch']} worked on {gpu_model} "
        f"after an OOM ({learned.get('learned_from')})",
    )
