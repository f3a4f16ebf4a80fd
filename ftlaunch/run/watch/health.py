"""The numeric-health watch: each new trainer record judged once (ftlaunch.run.rollback.HealthWatch,
over the pure ftlaunch.run.health); a divergence halts the trainer from the next poll on. What then
happens (roll back, stop) is decided once the trainer has exited (``HealthWatch.after``)."""

from __future__ import annotations

from ftlaunch.run.recovery import Halt
from ftlaunch.run.rollback import HealthWatch
from ftlaunch.run.state import FailureKind
from ftlaunch.run.watch import Seen


class HealthHalt:
    def __init__(self, watch: HealthWatch):
        self.watch = watch
        self.called = False

    def start(self, pid: int) -> None:
        pass

    def tick(self, seen: Seen) -> Halt | None:
        # A halt the last poll's records (or the console's grad_norm) set: called once, at the poll's start.
        halt = None
        if self.watch.halt and not self.called:
            self.called = True
            halt = Halt(FailureKind.DIVERGED, "numeric health halted the trainer")
        if seen.new:
            self.watch.feed(seen.new)  # a divergence sets watch.halt: the trainer is stopped from the next poll
        return halt

    def after(self, seen: Seen) -> None:
        pass
