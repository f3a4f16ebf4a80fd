"""The checkpoint watch: every checkpoint that lands in output_dir recorded once (event and state),
its size and time handed on (the stall watch learns the write speed from it), and a save under way
seen growing (progress too). The folder rules are ftlaunch.run.checkpoints.CheckpointWatch's."""

from __future__ import annotations

from collections.abc import Callable

from ftlaunch.files import tree_bytes
from ftlaunch.run.checkpoints import CheckpointWatch
from ftlaunch.run.journal import RunJournal
from ftlaunch.run.recovery import Halt
from ftlaunch.run.watch import Seen


class CheckpointsWatch:
    def __init__(self, journal: RunJournal, checkpoints: CheckpointWatch, clock: Callable[[], float]):
        self.journal, self.checkpoints, self.clock = journal, checkpoints, clock

    @property
    def progressed(self) -> bool:
        """A checkpoint beyond any earlier one landed during the attempt."""
        return self.checkpoints.progressed

    def start(self, pid: int) -> None:
        pass

    def tick(self, seen: Seen) -> Halt | None:
        cps = self.checkpoints
        for step, path in cps.landed_all():
            self.journal.checkpoint(step, path, max(cps.best, cps.last))
            seen.landed.append((self.clock(), tree_bytes(path)))
        if cps.growth():
            seen.grew = self.clock()
        return None

    def after(self, seen: Seen) -> None:
        self.tick(seen)  # a save that completed just before the exit
