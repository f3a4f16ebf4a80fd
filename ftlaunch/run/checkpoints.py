"""Watching an output_dir's checkpoints during an attempt, and setting incomplete ones aside before one.

A checkpoint counts once it is complete (``ftlaunch.run.progress.checkpoint_problems`` finds nothing
missing or torn): the trainer writes its files one by one, and a half-written one must never be resumed
from. One that looked complete but that the trainer could not load is set aside after that attempt
(``set_aside_unloadable``), so the next resumes from the one before. Set aside = renamed
``incomplete-checkpoint-N-<time>``, never deleted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ftlaunch.files import tree_bytes
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
        moved.append(_move_aside(path, problems, now))
    return moved


def set_aside_unloadable(out: Path, name: str | None, why: str, now: float | None = None) -> SetAside | None:
    """Move aside the checkpoint an attempt resumed from (``name``, as the run's state recorded it) and
    could not load; None when there is none to move (the attempt started from the base model, or the
    folder is gone). The trainer resumes from the newest checkpoint-N, so the next attempt takes the one
    before; each attempt can set aside at most the one it resumed from, and the crash budget and the
    restart brake bound the attempts."""
    path = out / name if name and prog.CHECKPOINT_RE.match(name) else None
    if path is None or not path.is_dir():
        return None
    return _move_aside(path, [f"the trainer could not load it: {why}"], now)


def _move_aside(path: Path, problems: list[str], now: float | None) -> SetAside:
    target = free_name(path.parent, f"incomplete-{path.name}-{int(time.time() if now is None else now)}")
    path.rename(target)
    return SetAside(path.name, target.name, tuple(problems))


def free_name(folder: Path, base: str) -> Path:
    """``folder/base``, or ``base-2``, ``base-3``... when taken: a set-aside never overwrites another."""
    path, n = folder / base, 1
    while path.exists():
        n += 1
        path = folder / f"{base}-{n}"
    return path


class CheckpointWatch:
    """Every complete checkpoint of an output_dir, noticed once each as it lands.

    Compares listings, not only the newest name: two saves between polls, a newer folder still being
    written while an older one completes, or a checkpoint rotated away by ``save_total_limit`` soon
    after it landed are all seen. ``growth()`` tells a save in progress (bytes of the unfinished
    folders) to the stall watchdog."""

    def __init__(self, out: Path, weights_only: bool, best: int = 0):
        self.out = out
        self.weights_only = weights_only
        complete = [
            step for step, path in prog.checkpoint_dirs(out) if not prog.checkpoint_problems(path, weights_only)
        ]
        self.seen: set[int] = set(complete)
        self.first = max(complete, default=0)
        self.last = self.first
        self.best = max(best, self.first)  # the furthest checkpoint any attempt saved (state.best_checkpoint)
        self._pending_bytes = 0

    def landed_all(self) -> list[tuple[int, Path]]:
        """Complete checkpoints not reported before, oldest first."""
        new = []
        for step, path in prog.checkpoint_dirs(self.out):
            if step in self.seen or prog.checkpoint_problems(path, self.weights_only):
                continue
            self.seen.add(step)
            new.append((step, path))
        if new:
            self.last = max(self.last, new[-1][0])
        return new

    def landed(self) -> tuple[int, Path] | None:
        """The newest of ``landed_all()`` (None when nothing new)."""
        new = self.landed_all()
        return new[-1] if new else None

    def growth(self) -> bool:
        """True when the folders of saves not yet complete hold more bytes than at the last call."""
        total = 0
        for step, path in prog.checkpoint_dirs(self.out):
            if step not in self.seen:
                total += tree_bytes(path)
        grew = total > self._pending_bytes
        self._pending_bytes = total
        return grew

    @property
    def progressed(self) -> bool:
        """A checkpoint beyond any earlier one landed since the watch began (refills the budgets)."""
        return self.last > self.best
