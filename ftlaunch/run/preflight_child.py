"""ftlaunch's preflight child: LLaMA-Factory's own argument parsing of adapted configs, the planned card emulated.

Run by ftlaunch.run.preflight as `TRAINER_PYTHON preflight_child.py SPEC_JSON OUT_JSON` in the trainer's
Python, by path: it imports llamafactory and nothing of ftlaunch. It never touches a real GPU
(CUDA_VISIBLE_DEVICES is empty) and never starts a process group: what the trainer's rank 0 would see is
emulated here, and only here.

SPEC = {"items": [ITEM, ...], "assume_packages": bool, "scratch": DIR}; ITEM = {"id": str, "yaml": TEXT,
"env": {NAME: VALUE}, "card": CARD or null}; CARD = {"name", "count", "cc": [major, minor], "total_mib",
"driver"}. Each item's YAML is read as llamafactory-cli reads its file (OmegaConf) and parsed by
``llamafactory.hparams.get_train_args`` (USE_V1: ``llamafactory.v1.config.arg_parser.get_args``) with
os.environ = the item's env, after what `llamafactory-cli train` does first (launcher.py: torchrun when
FORCE_TORCHRUN is set or more than one device is visible, which sets LOCAL_RANK/RANK/WORLD_SIZE).

Emulated for CARD (none: no CUDA at all): torch.cuda.is_available / device_count / get_device_capability /
get_device_properties / get_device_name / is_bf16_supported / set_device / current_device, torch.version.cuda,
torch.distributed.init_process_group / is_initialized / get_world_size / get_rank (and deepspeed.comm's),
accelerate's RTX 40 P2P check, and every lru_cache of transformers' and accelerate's availability tests.
``assume_packages``: a package a config needs but this Python lacks (deepspeed, galore_torch, badam, ...) is
taken as installed (a stub deepspeed distribution; llamafactory's check_version passes) and named in the
result; for what-if planning of another machine. `train` checks the real packages.

OUT = {"llamafactory": VERSION, "results": [{"id", "verdict": "ok" | "refused" | "error", "message",
"exception", "where", "v1", "torchrun", "world_size", "micro_batch", "accumulation", "global_batch",
"parallel_mode", "zero_stage", "compute_dtype", "assumed"}]}. "refused": llamafactory (or transformers,
or torchrun as the launcher would call it) raised while parsing: ``message`` is its text verbatim.
"error": the emulation itself failed (not a verdict on the config).
"""

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

# Run by path, so Python put this file's folder first on sys.path, where ftlaunch/run/ray would be taken
# for the top-level `ray` (transformers' is_ray_tune_available found it) and any sibling module for a
# package of the same name. The trainer's Python may predate -P (3.11): take the folder off here,
# before anything past the standard library is imported.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

# What the launcher and the parsers read from the environment; reset between items.
_RUNTIME_VARS = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)
_REFUSALS = (ValueError, ImportError, TypeError, NotImplementedError, KeyError, RuntimeError, AssertionError)
_STUB_VERSION = "0.16.9"


def _stub_deepspeed(root: Path) -> None:
    """A deepspeed distribution with only what parsing touches: its version, metadata and comm."""
    pkg = root / "deepspeed"
    (pkg / "comm").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'__version__ = "{_STUB_VERSION}"\n')
    (pkg / "comm" / "__init__.py").write_text(
        "_up = False\n"
        "def is_initialized():\n    return _up\n"
        "def init_distributed(*args, **kwargs):\n    global _up\n    _up = True\n"
    )
    info = root / f"deepspeed-{_STUB_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {_STUB_VERSION}\n")
    sys.path.insert(0, str(root))


class _Card:
    """The planned card, as torch and accelerate will be asked about it."""

    def __init__(self, card, env):
        self.card = card
        count = int(card["count"]) if card else 0
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if card and visible is not None:
            entries = [x for x in visible.split(",")]
            n = 0
            for x in entries:
                if not x.strip():
                    break
                n += 1
            count = min(count, n)
        self.count = count
        self.cc = tuple(card["cc"]) if card and card.get("cc") else (0, 0)


def _install(card: "_Card", state: dict) -> None:
    import torch
    import torch.distributed as dist

    has = card.count > 0
    major, minor = card.cc
    name = card.card["name"] if card.card else "cpu"
    total = int(card.card.get("total_mib") or 0) * 2**20 if card.card else 0
    props = SimpleNamespace(
        name=name, major=major, minor=minor, total_memory=total, multi_processor_count=108, is_integrated=False
    )
    torch.cuda.is_available = lambda: has
    torch.cuda.device_count = lambda: card.count
    torch.cuda.get_device_capability = lambda device=None: (major, minor)
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.get_device_name = lambda device=None: name
    # bf16 needs compute capability 8.0; torch's own answer counts emulation (says yes on a V100).
    torch.cuda.is_bf16_supported = lambda including_emulation=True: has and (major, minor) >= (8, 0)
    torch.cuda.set_device = lambda device=None: None
    torch.cuda.current_device = lambda: 0
    if has and torch.version.cuda is None:
        torch.version.cuda = "12.4"
    elif not has:
        torch.version.cuda = state["cuda_version"]

    dist.is_available = lambda: True
    dist.is_initialized = lambda: state["dist_up"]

    def init_process_group(*args, **kwargs):
        state["dist_up"] = True

    dist.init_process_group = init_process_group
    dist.get_world_size = lambda group=None: int(os.environ.get("WORLD_SIZE", "1"))
    dist.get_rank = lambda group=None: int(os.environ.get("RANK", "0"))
    dist.barrier = lambda *a, **k: None
    try:
        import deepspeed.comm as ds_comm

        ds_comm.is_initialized = lambda: state["dist_up"]
        ds_comm.init_distributed = lambda *a, **k: init_process_group()
    except Exception:
        pass

    import accelerate.state
    import accelerate.utils.environment as acc_env

    driver = (card.card or {}).get("driver")

    def p2p_ok():  # accelerate's check, on the planned card's names instead of nvidia-smi
        if card.count > 1 and "RTX 40" in name and driver:
            from packaging.version import parse

            return parse(driver) >= parse("550.40.07")
        return True

    accelerate.state.check_cuda_p2p_ib_support = p2p_ok
    acc_env.check_cuda_p2p_ib_support = p2p_ok
    _clear_caches()


def _clear_caches() -> None:
    mods = [
        "transformers.utils.import_utils",
        "accelerate.utils.imports",
        "accelerate.utils.environment",
        "llamafactory.extras.packages",
        "llamafactory.extras.misc",
    ]
    for m in mods:
        mod = sys.modules.get(m)
        for obj in list(vars(mod).values()) if mod else ():
            if callable(getattr(obj, "cache_clear", None)):
                obj.cache_clear()


def _launcher_env(env: dict, card: "_Card") -> tuple[dict, bool, str | None]:
    """What `llamafactory-cli train` hands its trainer: under torchrun (launcher.py: FORCE_TORCHRUN, or
    more than one device without USE_RAY/USE_KT), rank 0's torchrun variables. (env, torchrun, problem)."""

    def on(name):
        return env.get(name, "0").lower() in ("true", "y", "1")

    out = dict(env)
    if on("USE_MCA"):
        out["FORCE_TORCHRUN"] = "1"
    torchrun = on("FORCE_TORCHRUN") or (card.count > 1 and not on("USE_RAY") and not on("USE_KT"))
    if on("USE_MCA"):
        torchrun = True
    if not torchrun:
        return out, False, None
    nnodes = int(out.get("NNODES", "1"))
    node_rank = int(out.get("NODE_RANK", "0"))
    try:
        nproc = int(out.get("NPROC_PER_NODE", str(card.count)))
    except ValueError:
        return out, True, f"torchrun: --nproc_per_node {out.get('NPROC_PER_NODE')!r} is not a number"
    if nproc < 1:
        return (
            out,
            True,
            f"torchrun --nproc_per_node {nproc}: no process to start (no GPU visible, NPROC_PER_NODE unset)",
        )
    out.update(
        {
            "LOCAL_RANK": "0",
            "RANK": str(node_rank * nproc),
            "GROUP_RANK": str(node_rank),
            "WORLD_SIZE": str(nnodes * nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": out.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": out.get("MASTER_PORT", "29500"),
        }
    )
    return out, True, None


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "site-packages" in fr.filename or "dist-packages" in fr.filename:
            parts = Path(fr.filename).parts
            for anchor in ("site-packages", "dist-packages"):
                if anchor in parts:
                    return "/".join(parts[parts.index(anchor) + 1 :]) + f":{fr.lineno}"
    fr = frames[-1] if frames else None
    return f"{Path(fr.filename).name}:{fr.lineno}" if fr else ""


def _assume_installed(assumed: list) -> None:
    """llamafactory's check_version passes for a mandatory package this Python lacks; it is recorded."""
    import llamafactory.extras.misc as misc
    import llamafactory.hparams.parser as parser

    real = misc.check_version

    def check_version(requirement, mandatory=False):
        try:
            return real(requirement, mandatory)
        except ImportError:
            if not mandatory:
                raise
            assumed.append(requirement)

    parser.check_version = check_version


def _parse_one(item: dict, spec: dict, state: dict) -> dict:
    from omegaconf import OmegaConf

    env = {k: str(v) for k, v in (item.get("env") or {}).items()}
    card = _Card(item.get("card"), env)
    child_env, torchrun, problem = _launcher_env(env, card)
    result = {"id": item.get("id"), "torchrun": torchrun, "assumed": []}
    if problem:
        return {**result, "verdict": "refused", "message": problem, "exception": "torchrun", "where": "launcher.py"}
    _enter(child_env, card, state)
    v1 = os.environ.get("USE_V1", "0").lower() in ("true", "y", "1")
    result["v1"] = v1
    cfg = OmegaConf.to_container(OmegaConf.create(item["yaml"] or "{}"))
    overrides = item.get("overrides") or []
    if overrides:
        cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(cfg), OmegaConf.from_cli(list(overrides))))
    # The output_dir's state is ftlaunch's business (run/outdir.py); parse against an empty one.
    cfg["output_dir"] = str(Path(spec["scratch"]) / "output" / str(item.get("id")))
    try:
        if v1:
            return {**result, **_parse_v1(cfg)}
        return {**result, **_parse_train_args(cfg, spec, state, result["assumed"])}
    except _REFUSALS as exc:
        where = getattr(exc, "ftlaunch_where", None) or _where(exc)
        return {**result, "verdict": "refused", "message": str(exc), "exception": type(exc).__name__, "where": where}
    except Exception as exc:  # the emulation, not the config: no verdict
        return {
            **result,
            "verdict": "error",
            "message": str(exc),
            "exception": type(exc).__name__,
            "where": _where(exc),
        }


def _enter(child_env: dict, card: _Card, state: dict) -> None:
    """This process becomes the item's trainer: its environment (no real GPU) and its card installed."""
    os.environ.clear()
    os.environ.update(state["base_env"])
    for name in _RUNTIME_VARS:
        os.environ.pop(name, None)
    os.environ.update(child_env)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # never a real GPU, whatever the plan says
    state["dist_up"] = False
    _install(card, state)


def _parse_train_args(cfg: dict, spec: dict, state: dict, assumed: list) -> dict:
    """llamafactory's own parse of a (v0) config: the verdict "ok" with the sizes it settled on; it raises
    what the trainer would raise. ``assumed`` gets the packages taken as installed."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)
    from llamafactory.hparams import get_train_args

    if spec.get("assume_packages"):
        _assume_installed(assumed)
        if state.get("stub_deepspeed") and cfg.get("deepspeed"):
            assumed.append("deepspeed")
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(cfg)
    ds = getattr(training_args, "hf_deepspeed_config", None)
    if ds is not None and ds.mismatches:
        # What transformers raises at trainer_config_finalize (Trainer start); these mismatches
        # are known already from TrainingArguments (fp16/bf16, batch sizes, lr, ...).
        mismatches = "\n".join(ds.mismatches)
        exc = ValueError(
            "Please correct the following DeepSpeed config values that mismatch TrainingArguments"
            f" values:\n{mismatches}\nThe easiest method is to set these DeepSpeed config values to 'auto'."
        )
        exc.ftlaunch_where = "transformers/integrations/deepspeed.py (trainer_config_finalize, at Trainer start)"
        raise exc
    world = int(training_args.world_size)
    micro = int(training_args.per_device_train_batch_size)
    accum = int(training_args.gradient_accumulation_steps)
    return {
        "verdict": "ok",
        "message": None,
        "world_size": world,
        "micro_batch": micro,
        "accumulation": accum,
        "global_batch": world * micro * accum,
        "parallel_mode": str(training_args.parallel_mode.value),
        "zero_stage": ds.get_value("zero_optimization.stage") if ds is not None else None,
        "compute_dtype": str(model_args.compute_dtype).removeprefix("torch.") if model_args.compute_dtype else None,
    }


def _parse_v1(cfg: dict) -> dict:
    from llamafactory.v1.config.arg_parser import get_args

    _, _, training_args, _ = get_args(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = int(training_args.micro_batch_size)
    gb = training_args.global_batch_size
    gb = int(gb) if gb else micro * world
    accum = max(1, gb // max(1, micro * world))
    return {
        "verdict": "ok",
        "message": None,
        "world_size": world,
        "micro_batch": micro,
        "accumulation": accum,
        "global_batch": gb,
        "parallel_mode": "distributed" if world > 1 else "not_parallel",
        "zero_stage": None,
        "compute_dtype": "bfloat16" if training_args.bf16 else None,
    }


def main():
    spec = json.load(open(sys.argv[1]))
    scratch = Path(spec.get("scratch") or tempfile.mkdtemp(prefix="ftlaunch-preflight-"))
    spec["scratch"] = str(scratch)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
    if spec.get("assume_packages"):
        import importlib.util

        stub = importlib.util.find_spec("deepspeed") is None
        if stub:
            _stub_deepspeed(scratch / "stubs")
    else:
        stub = False
    import torch

    state = {"dist_up": False, "cuda_version": torch.version.cuda, "base_env": dict(os.environ), "stub_deepspeed": stub}
    from importlib.metadata import version

    results = []
    for item in spec["items"]:
        try:
            results.append(_parse_one(item, spec, state))
        except Exception as exc:
            results.append(
                {"id": item.get("id"), "verdict": "error", "message": str(exc), "exception": type(exc).__name__}
            )
    with open(sys.argv[2], "w") as f:
        json.dump({"llamafactory": version("llamafactory"), "results": results}, f)


if __name__ == "__main__":
    main()
