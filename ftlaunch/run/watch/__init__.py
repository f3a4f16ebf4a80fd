"""The supervisor's watches over one attempt, each rule's watch behind one protocol.

Owns ``Watcher`` (``start(pid)``, ``tick(seen) -> Halt | None``, ``after(seen)``) and ``Seen``, what one
poll of the trainer saw, which the watches read and add to in their order: progress (the trainer's
records), health (numeric health), GPU memory, checkpoints, stall, disk. A ``Halt`` (from the pure
``ftlaunch.run.recovery``, with ``AttemptEnd``) stops the trainer; the rules themselves stay in their
pure modules (``run/stall``, ``run/health``, ``run/progress``, ``plan/disk``). May import ftlaunch.run's
shells and pure modules, ``ftlaunch.plan``, ``ftlaunch.probe`` and ``ftlaunch.files``; only
``run/supervisor`` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ftlaunch.run.recovery import Halt


@dataclass
class Seen:
    """One poll: the trainer's exit code (None while it runs), whether it is being stopped (a halt or
    a stop signal before this poll, or a halt earlier in it), and what the watches before saw."""

    rc: int | None
    halting: bool
    new: list[dict[str, Any]] = field(default_factory=list)  # step records read this poll
    step: int | None = None  # the last step this attempt logged
    rate: float | None = None  # its steps per second
    landed: list[tuple[float, int]] = field(default_factory=list)  # (clock, bytes) per checkpoint landed
    grew: float | None = None  # clock when a save under way grew


class Watcher(Protocol):
    """One rule's watch over an attempt: ``start`` once the trainer runs, ``tick`` each poll (a Halt
    stops the trainer), ``after`` once it has exited (a last look)."""

    def start(self, pid: int) -> None: ...

    def tick(self, seen: Seen) -> Halt | None: ...

    def after(self, seen: Seen) -> None: ...
