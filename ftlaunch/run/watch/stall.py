"""The stall watch: the watchdog (the pure ftlaunch.run.stall) fed with the attempt's steps, the
console's save and eval marks and its checkpoints; its view kept in the state every 5 s for `status`;
on a stall, every trainer process's stacks dumped (py-spy) and the trainer halted."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftlaunch.run.journal import RunJournal
from ftlaunch.run.notify import Notifier
from ftlaunch.run.recovery import Halt
from ftlaunch.run.stacks import StackDump
from ftlaunch.run.stall import StallPolicy, Watchdog
from ftlaunch.run.state import FailureKind
from ftlaunch.run.store import RunFolder
from ftlaunch.run.watch import Seen


class StallWatch:
    def __init__(
        self,
        journal: RunJournal,
        notifier: Notifier,
        attempt: int,
        policy: StallPolicy,
        earlier: Mapping[str, Any],
        console: deque[tuple[float, str]],
        dumper: Callable[[int, Path], StackDump],
        clocks: tuple[Callable[[], float], Callable[[], float]],
    ):
        """``console``: what the output pump saw, (clock, save or eval mark or "") per chunk;
        ``earlier``: the watchdog's view an earlier attempt left (state.stall); ``clocks``: (monotonic, epoch)."""
        self.journal, self.notifier, self.attempt = journal, notifier, attempt
        self.policy, self.earlier, self.console, self.dumper = policy, dict(earlier), console, dumper
        self.clock, self.wall = clocks
        self.dog = Watchdog.begin(policy, self.clock(), earlier=self.earlier)
        self.pid = 0
        self.next_view = 0.0
        self.stalled = False

    def start(self, pid: int) -> None:
        self.pid = pid
        self.dog = Watchdog.begin(self.policy, self.clock(), earlier=self.earlier)

    def tick(self, seen: Seen) -> Halt | None:
        self._feed(seen)
        if seen.rc is not None:
            return None
        if self.clock() >= self.next_view:
            self.journal.watchdog(self.dog.to_dict(self.clock(), self.wall()))
            self.next_view = self.clock() + 5.0
        if not self.stalled and not seen.halting and self.dog.stalled(self.clock()):
            self.stalled = True
            return Halt(FailureKind.STALLED, self._on_stall())
        return None

    def after(self, seen: Seen) -> None:
        self._feed(seen)
        self.journal.watchdog(self.dog.to_dict(self.clock(), self.wall()))

    def _feed(self, seen: Seen) -> None:
        # Console after the step records: HF logs step N, then evaluates and saves; a mark read in the
        # same poll as step N's record opens its phase instead of being closed by that record.
        dog = self.dog.steps(seen.step, self.clock()) if seen.new and seen.step is not None else self.dog
        while self.console:
            at, mark = self.console.popleft()
            dog = dog.console(mark, at)
        for at, size in seen.landed:  # a save in progress is progress too; its write speed: the next limit
            dog = dog.checkpoint_done(at, size=size)
        self.dog = dog.checkpoint_grew(seen.grew) if seen.grew is not None else dog

    def _on_stall(self) -> str:
        """No progress within the allowance: dump every trainer process's stacks (the halt stops the group)."""
        description = self.dog.describe(self.clock())
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.wall()))
        dump = self.dumper(self.pid, RunFolder(self.journal.run_dir).stacks_of(self.attempt, stamp))
        self.journal.say(f"ftlaunch: stalled: {description}; stacks: {dump.describe()}; stopping the trainer")
        self.journal.stalled(self.attempt, description, str(dump.path), self.dog.to_dict(self.clock(), self.wall()))
        self.notifier.event("stalled", attempt=self.attempt, message=description, stacks=str(dump.path))
        return f"{description}; stacks in {dump.path}"
