"""Watching an output_dir's checkpoints during an attempt, and setting incomplete ones aside before one.

A checkpoint counts once it is complete (``ftlaunch.run.progress.checkpoint_problems`` finds nothing
missing): the trainer writes its files one by one, and a half-written one must never be resumed from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ftlaunch.run import progress as prog


@dataclass(frozen=True)
class SetAside:
    """An incomplete checkpoint moved out of the trainer's way (never deleted)."""

    name: str
    moved_to: str
    problems: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.name} -> {self.moved_to} ({'; '.join(self.problems)})"


def set_aside_incomplete(out: Path, weights_only: bool, now: float | None = None) -> list[SetAside]:
    """Move the incomplete newest checkpoints aside: llamafactory resumes from the newest by name."""
    moved = []
    for _step, path in reversed(prog.checkpoint_dirs(out)):
        problems = prog.checkpoint_problems(path, weights_only)
        if not problems:
            break
        target = out / f"incomplete-{path.name}-{int(time.time() if now is None else now)}"
        path.rename(target)
        moved.append(SetAside(path.name, target.name, tuple(problems)))
    return moved


class CheckpointWatch:
    """The newest complete checkpoint of an output_dir, noticed once each as it lands."""

    def __init__(self, out: Path, weights_only: bool):
        self.out = out
        self.weights_only = weights_only
        self.first = self.last = (prog.last_complete_checkpoint(out, weights_only) or (0, None))[0]

    def landed(self) -> tuple[int, Path] | None:
        """(step, path) of a complete checkpoint newer than any seen, else None."""
        latest = prog.checkpoint_dirs(self.out)
        if latest and latest[-1][0] > self.last and not prog.checkpoint_problems(latest[-1][1], self.weights_only):
            self.last = latest[-1][0]
            return latest[-1]
        return None

    @property
    def progressed(self) -> bool:
        """A new checkpoint landed since the watch began (refills the OOM budget)."""
        return self.last > self.first
