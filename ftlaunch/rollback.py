"""The file side of a rollback after a divergence: read checkpoints, set them aside, lower the lr.

Decisions are ``ftlaunch.health.decide``; this module only touches the output_dir, and never deletes
a checkpoint: checkpoints written after the divergence are renamed ``diverged-checkpoint-N-<time>``,
a final model saved by a diverged attempt goes into ``diverged-final-<time>/``.

Why the lr needs more than a config edit (measured, llamafactory 0.9.5 / transformers 5): resuming
restores the learning rate from the checkpoint's ``scheduler.pt`` (``base_lrs``) and ``optimizer.pt``
(``param_groups``), so a lower ``learning_rate`` in the YAML is silently ignored. The rollback
checkpoint is therefore rebuilt beside the original: weights hard-linked, the two state files
rewritten with the lr scaled, in a child process with the trainer's own Python (torch lives there).
The original is kept as ``rolledback-checkpoint-N-<time>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from .health import Checkpoint, Thresholds, history_is_clean

# llamafactory refuses to start from scratch in an output_dir holding one of these (CHECKPOINT_NAMES).
FINAL_WEIGHTS = (
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)

_SCALE_LR = r"""
import sys, torch
path, factor = sys.argv[1], float(sys.argv[2])
for name in ("scheduler.pt", "optimizer.pt"):
    f = f"{path}/{name}"
    try:
        state = torch.load(f, weights_only=False, map_location="cpu")
    except FileNotFoundError:
        continue
    if name == "scheduler.pt":
        for key in ("base_lrs", "_last_lr"):
            if key in state:
                state[key] = [lr * factor for lr in state[key]]
    else:
        for g in state.get("param_groups", []):
            for key in ("lr", "initial_lr"):
                if key in g:
                    g[key] = g[key] * factor
    torch.save(state, f + ".tmp")
    import os
    os.replace(f + ".tmp", f)  # replaces the link, never the original checkpoint's file
print("scaled")
"""


def read_history(ckpt: Path) -> list[dict] | None:
    """A checkpoint's trainer_state.json log_history (NaN tokens parse); None when unreadable."""
    try:
        hist = json.loads((ckpt / "trainer_state.json").read_text()).get("log_history")
    except (OSError, ValueError, AttributeError):
        return None
    return hist if isinstance(hist, list) else None


def checkpoints_of(complete: Iterable[tuple[int, Path]], t: Thresholds, *, fp16: bool) -> list[Checkpoint]:
    """Complete checkpoints, each judged on its own trainer_state.json log_history."""
    out = []
    for step, path in complete:
        hist = read_history(path)
        out.append(Checkpoint(step, path.name, hist is not None and history_is_clean(hist, t, fp16=fp16)))
    return out


def set_aside(output_dir: Path, names: Iterable[str], stamp: int, prefix: str = "diverged") -> list[str]:
    """Rename (never delete): llamafactory resumes from the last ``checkpoint-N`` by name."""
    moved = []
    for name in names:
        src = output_dir / name
        if src.is_dir():
            target = output_dir / f"{prefix}-{name}-{stamp}"
            src.rename(target)
            moved.append(f"{name} -> {target.name}")
    return moved


def set_aside_final(output_dir: Path, stamp: int) -> list[str]:
    """A diverged attempt that reached the end saved its (garbage) model in output_dir: move it aside."""
    found = [output_dir / n for n in FINAL_WEIGHTS if (output_dir / n).is_file()]
    found += sorted(output_dir.glob("model-*-of-*.safetensors"))
    if not found:
        return []
    box = output_dir / f"diverged-final-{stamp}"
    box.mkdir(exist_ok=True)
    for f in found:
        f.rename(box / f.name)
    return [f"{f.name} -> {box.name}/" for f in found]


def python_of(trainer: str | None) -> str:
    """The Python that runs the trainer (its shebang), where torch is; else ours."""
    if trainer:
        try:
            with open(trainer, "rb") as f:
                first = f.readline(300).decode(errors="replace")
            if first.startswith("#!") and "python" in first:
                exe = first[2:].strip().split()[0]
                if os.access(exe, os.X_OK):
                    return exe
        except OSError:
            pass
    return sys.executable


def scale_lr(output_dir: Path, name: str, factor: float, python: str, stamp: int) -> str | None:
    """Rebuild ``name`` with its stored lr x factor; keep the original aside. Returns an error or None."""
    src = output_dir / name
    tmp = output_dir / f".{name}.rollback-{stamp}"
    shutil.rmtree(tmp, ignore_errors=True)  # our own scratch copy from an interrupted rollback
    try:
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        r = subprocess.run(
            [python, "-c", _SCALE_LR, str(tmp), repr(factor)], capture_output=True, text=True, timeout=600
        )
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(exc)
    if r.returncode != 0 or "scaled" not in r.stdout:
        shutil.rmtree(tmp, ignore_errors=True)
        return (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:300]
    src.rename(output_dir / f"rolledback-{name}-{stamp}")
    tmp.rename(src)
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def now_stamp() -> int:
    return int(time.time())
