"""The disk around a run: free space of the filesystem that holds a path, the ENOSPC shapes the
trainer prints, partial checkpoints a failed save leaves, and the message that names them.

The sizes and the verdict are ``ftlaunch.plan.disk``'s (pure); this module measures what they need
(free bytes, the model's tokenizer files, the dataset's rows) and ``preflight`` puts both together
for ``start_run``. The shapes in ``ENOSPC_PATTERNS`` were captured from the real llamafactory-cli on
a full tmpfs (tests/data/disk/).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftlaunch.errors import DiskFullError
from ftlaunch.files import JSON_LIMIT, read_user_bytes, tree_bytes, value_error
from ftlaunch.plan.disk import (
    DiskForecast,
    DiskVerdict,
    DiskVerdictKind,
    SaveSettings,
    disk_verdict,
    forecast,
    human,
    run_length,
)
from ftlaunch.plan.modelspec import ModelSpec
from ftlaunch.plan.planner import Plan
from ftlaunch.run import progress as prog
from ftlaunch.run.state import StartFacts

# What the trainer prints when a write fails for want of space (tests/data/disk/enospc_*.log):
ENOSPC_PATTERNS = (
    # Python open()/write(): tokenizer_config.json, config.json, trainer_log.jsonl, trainer_state.json
    re.compile(r"\[Errno 28\]|No space left on device"),
    # safetensors (Rust): "SafetensorError: Error while serializing: I/O error: No space left on device
    # (os error 28)"; tokenizers: "Exception: No space left on device (os error 28)"; newer Rust
    # std names the kind StorageFull
    re.compile(r"os error 28\b|StorageFull"),
    # torch.save (optimizer.pt, rng_state.pth, training_args.bin, DeepSpeed's *_states.pt): the zip
    # writer never says ENOSPC: "RuntimeError: basic_ios::clear: iostream error", then "[enforce fail
    # at inline_container.cc:672] . unexpected pos 376640 vs 376528" (torch 2.14); older torch:
    # "PytorchStreamWriter failed writing file data/0: file write failed"
    re.compile(r"inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+"),
    re.compile(r"PytorchStreamWriter failed writing file|file write failed"),
    re.compile(r"basic_ios::clear: iostream error"),
    # a quota is a full disk to the run: EDQUOT
    re.compile(r"\[Errno 122\]|Disk quota exceeded|os error 122\b"),
)


def enospc_line(log_text: str) -> str | None:
    """The first line of ``log_text`` that says a write failed for want of space, else None."""
    for line in log_text.splitlines():
        if any(p.search(line) for p in ENOSPC_PATTERNS):
            return line.strip()
    return None


def enospc_in(log_text: str) -> bool:
    """Whether the trainer's output shows an ENOSPC (or quota) write failure (``[rank0]:`` prefixes too)."""
    return enospc_line(log_text) is not None


# ------------------------------------------------------------------------------------- free space


def existing_parent(path: str | Path) -> Path:
    """``path`` itself if it exists, else its nearest existing parent (an output_dir not made yet)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem that holds ``path`` (statvfs
    f_bavail x f_frsize; root may use the reserved blocks too, so this errs low)."""
    st = os.statvfs(existing_parent(path))
    return st.f_bavail * st.f_frsize


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem that holds ``path``: named in messages."""
    p = existing_parent(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def filesystem_name(path: str | Path) -> str:
    """The filesystem for a message: its mount point, and the device (from /proc/mounts) when known."""
    mp = mount_point(path)
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == str(mp):
                return f"{mp} ({parts[2]} {parts[0]})" if parts[0] != parts[2] else f"{mp} ({parts[2]})"
    except OSError:
        pass
    return str(mp)


# ------------------------------------------------------------------------------ partial checkpoints


@dataclass(frozen=True)
class Removed:
    """Partial checkpoint folders deleted after a failed save, and the bytes that freed."""

    names: tuple[str, ...]
    bytes_freed: int


def partial_checkpoints(out: Path, weights_only: bool = False) -> list[Path]:
    """Incomplete checkpoint-N folders newer than the last complete one, oldest first: what a failed
    save leaves. A complete checkpoint is never listed, nor an incomplete one older than it."""
    last = prog.last_complete_checkpoint(out, weights_only)
    floor = last[0] if last else -1
    return [
        path
        for step, path in prog.checkpoint_dirs(out)
        if step > floor and prog.checkpoint_problems(path, weights_only)
    ]


def remove_partial(out: Path, weights_only: bool = False) -> Removed:
    """Delete the partial checkpoints of ``partial_checkpoints``: a half-written save can never be
    resumed, and it holds the space the next attempt needs. Every complete checkpoint stays."""
    names: list[str] = []
    freed = 0
    for path in partial_checkpoints(out, weights_only):
        size = tree_bytes(path)
        shutil.rmtree(path)
        names.append(path.name)
        freed += size
    return Removed(tuple(names), freed)


def free_for_next_save(out: Path, fc: DiskForecast, step: int, nxt: int) -> int:
    """Free bytes the save at ``nxt`` will find, judged at ``step`` (the latest step record read).

    HF logs step N before it saves checkpoint-N, so a poll may land while a save is under way:
    - the folder of the save at ``nxt`` (if this poll read the step late) was free space before it;
    - a save at ``step`` itself that is not complete yet has still to write what it lacks, and that
      is not free for ``nxt`` (counting it free stopped a run that had room for both, issue 37's CI).
    """
    free = free_bytes(out) + tree_bytes(out / f"checkpoint-{nxt}")
    if step != nxt and fc.next_save_after(step - 1) == step:
        current = out / f"checkpoint-{step}"
        if not current.is_dir():
            free -= fc.checkpoint_bytes
        elif prog.checkpoint_problems(current, fc.weights_only):
            free -= max(0, fc.checkpoint_bytes - tree_bytes(current))
    return free


def disk_message(path: str | Path, checkpoint_bytes: int | None, free: int | None = None) -> str:
    """'<filesystem> has <free> free; one checkpoint takes <size>': for a disk_full end or refusal."""
    free = free_bytes(path) if free is None else free
    text = f"{filesystem_name(path)} has {human(free)} free"
    if checkpoint_bytes:
        text += f"; one checkpoint takes {human(checkpoint_bytes)}"
    return text


DISK_HINT = (
    "set save_only_model: true (no optimizer state in checkpoints), a save_total_limit, "
    "a larger save_steps, or an output_dir on a filesystem with more room"
)


# ------------------------------------------------------------------------------------ the forecast

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)


def model_files_bytes(model_dir: Any) -> int | None:
    """Bytes of the config and tokenizer files in a local model folder (every save copies them)."""
    if not isinstance(model_dir, str) or not Path(model_dir).is_dir():
        return None
    return sum((Path(model_dir) / n).stat().st_size for n in MODEL_FILES if (Path(model_dir) / n).is_file())


# Larger files are not read at start (the run's length then stays unknown): a JSON list is parsed
# whole, JSON Lines and CSV are only counted line by line.
_JSON_MAX_BYTES = 64 * 2**20
_LINES_MAX_BYTES = 2 * 2**30


def _file_rows(path: Path) -> int | None:
    """Rows of a local JSON list, JSON Lines or CSV file; None for anything else (or too big)."""
    if not path.is_file():
        return None
    suffix, size = path.suffix.lower(), path.stat().st_size
    if suffix == ".json" and size <= _JSON_MAX_BYTES:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return len(data) if isinstance(data, list) else None
    if suffix in (".jsonl", ".csv") and size <= _LINES_MAX_BYTES:
        with path.open("rb") as f:
            n = sum(1 for line in f if line.strip())
        return n - 1 if suffix == ".csv" else n
    return None


_REMOTE = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


def dataset_rows(values: Mapping[str, Any]) -> int | None:
    """Training rows LLaMA-Factory will see, when every dataset is a local file: each capped by
    ``max_samples``, less ``val_size``. None when any is remote, streamed, packed or unreadable."""
    if any(values.get(k) for k in ("streaming", "packing", "neat_packing", "tokenized_path")):
        return None
    if str(values.get("stage", "sft")) == "pt" and values.get("packing") is None:
        return None  # pre-training packs by default
    names = values.get("dataset")
    items = names if isinstance(names, (list, tuple)) else str(names or "").split(",")
    items = [str(n).strip() for n in items if str(n).strip()]
    dataset_dir = Path(str(values.get("dataset_dir") or "data"))
    try:
        path = dataset_dir / "dataset_info.json"
        info = json.loads(read_user_bytes(path, limit=JSON_LIMIT, what=str(path), error=value_error))
    except (OSError, ValueError):
        return None
    cap = values.get("max_samples")
    total = 0
    for name in items:
        entry = info.get(name) if isinstance(info, dict) else None
        if not isinstance(entry, dict) or not entry.get("file_name") or any(entry.get(k) for k in _REMOTE):
            return None
        rows = _file_rows(dataset_dir / str(entry["file_name"]))
        if rows is None:
            return None
        total += min(rows, int(cap)) if cap else rows
    if not items:
        return None
    val = float(values.get("val_size") or 0)
    if val:
        total -= int(val) if val >= 1 else int(round(total * val))
    return max(0, total)


@dataclass(frozen=True)
class Preflight:
    """The forecast for a plan, the free space of its output_dir's filesystem and the verdict."""

    forecast: DiskForecast
    verdict: DiskVerdict
    filesystem: str

    def state(self) -> dict[str, Any]:
        """What RunState.disk holds: the forecast, plus the verdict and filesystem at start."""
        return {**self.forecast.to_dict(), "verdict": self.verdict.to_dict(), "filesystem": self.filesystem}


def plan_forecast(p: Plan, spec: ModelSpec) -> DiskForecast:
    """The forecast of a plan's adapted config, with what this machine can measure of it."""
    from ftlaunch.plan.config import load_deepspeed
    from ftlaunch.plan.memory.adapt import installed_default_optimizer
    from ftlaunch.plan.memory.setup import setup_from_config

    values = dict(p.config)
    setup = setup_from_config(
        values,
        world_size=p.world_size,
        deepspeed_config=load_deepspeed(values),
        default_optim=installed_default_optimizer()[0],
    )
    length = run_length(values, dataset_rows(values), p.micro_batch, p.accumulation, p.world_size)
    files = model_files_bytes(values.get("model_name_or_path"))
    return forecast(
        spec, setup, SaveSettings.from_config(values), length, model_files_bytes=files, world_size=p.world_size
    )


def preflight(p: Plan, params: str | None = None, model_config: str | None = None) -> Preflight | None:
    """Forecast the plan's disk use and judge it against the free space where its output_dir will
    be. None when the model's size is unknown (then nothing can be said before the run)."""
    from ftlaunch.plan.memory.adapt import model_spec_for

    spec, _note = model_spec_for(p.config, params, model_config)
    if spec is None:
        return None
    out = str(p.config.get("output_dir") or ".")
    fc = plan_forecast(p, spec)
    fs = filesystem_name(out)
    return Preflight(fc, disk_verdict(fc, free_bytes(out), fs), fs)


def disk_check(p: Plan, params: str | None, model_config: str | None, say: Callable[[str], None]) -> StartFacts:
    """``start_run``'s preflight: refuse (DiskFullError, exit 17) when one checkpoint cannot fit on the
    output_dir's filesystem; say a warning when the run as configured will fill it. Returns what the
    run's state records: ``disk`` (the forecast) and ``warnings``."""
    pf = preflight(p, params, model_config)
    if pf is None:
        return StartFacts()
    v = pf.verdict
    if v.kind is DiskVerdictKind.REFUSE:
        raise DiskFullError(f"not starting: {v.message}", hint=DISK_HINT)
    if v.kind in (DiskVerdictKind.WARN, DiskVerdictKind.UNKNOWN_LENGTH):
        say(f"warning: {v.message} ({DISK_HINT})")
    warnings = (v.message,) if v.kind is DiskVerdictKind.WARN else None
    return StartFacts(disk=pf.state(), warnings=warnings)


# ------------------------------------------------------------------------------------ FTLAUNCH_HOME

# A write under FTLAUNCH_HOME that fails with one of these is a state problem (exit 12), not a crash.
HOME_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def _under(path: Path, root: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(root))
    except ValueError:
        return False
    return True


def _full_or_read_only(path: Path) -> bool:
    """Whether the filesystem of ``path`` has no room left (less than a block) or is mounted read-only."""
    try:
        st = os.statvfs(existing_parent(path))
    except OSError:
        return False
    return bool(st.f_flag & os.ST_RDONLY) or st.f_bavail * st.f_frsize < 64 * 1024 or not os.access(path, os.W_OK)


def home_write_problem(exc: OSError, home: Path) -> str | None:
    """What to tell the user when ``exc`` is a failed write under FTLAUNCH_HOME (full, read-only, not
    this user's), else None. An error without a file name (``flush()``) is laid at FTLAUNCH_HOME's
    door only when its filesystem is full or read-only right now."""
    if exc.errno not in HOME_ERRNOS:
        return None
    names = [os.fsdecode(n) for n in (exc.filename, exc.filename2) if n]
    if names and not any(_under(Path(n), home) for n in names):
        return None
    if not names and not _full_or_read_only(home):
        return None
    what = os.strerror(exc.errno) if exc.errno else str(exc)
    text = f"FTLAUNCH_HOME={home}: cannot write {names[0] if names else 'there'} ({what})"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text += f"; {disk_message(home, None)}"
    return text


HOME_HINT = "free space there, or set FTLAUNCH_HOME to a writable directory with room"
