"""The GPU memory watch: the largest GPU memory the trainer's process tree was seen to use (NVML,
ftlaunch.probe.usage), beside the plan's prediction, and the trainer's pids that the next attempt
waits to see gone (ftlaunch.run.gpuwait). One for the supervisor's life: the peak spans attempts."""

from __future__ import annotations

from collections.abc import Callable

from ftlaunch.run.journal import RunJournal
from ftlaunch.run.recovery import Halt
from ftlaunch.run.watch import Seen


class GpuWatch:
    def __init__(
        self,
        journal: RunJournal,
        sampler: Callable[[set[int]], float | None],
        every: float,
        clock: Callable[[], float],
    ):
        self.journal, self.sampler, self.every, self.clock = journal, sampler, every, clock
        self.observed_peak: float | None = None
        self.pids: set[int] = set()  # the last trainer's processes
        self.pid = 0
        self.next_sample = 0.0

    def start(self, pid: int) -> None:
        self.pid, self.pids = pid, {pid}
        self.next_sample = self.clock() + min(1.0, self.every)

    def tick(self, seen: Seen) -> Halt | None:
        if self.clock() >= self.next_sample and seen.rc is None:
            self.sample()
            self.next_sample = self.clock() + self.every
        return None

    def after(self, seen: Seen) -> None:
        pass

    def sample(self) -> None:
        """Keep the largest GPU memory the trainer's process tree was seen to use (per GPU)."""
        try:
            import psutil

            pids = {self.pid, *(c.pid for c in psutil.Process(self.pid).children(recursive=True))}
        except Exception:
            pids = {self.pid}
        self.pids |= pids
        used = self.sampler(pids)
        if used is not None and (self.observed_peak is None or used > self.observed_peak):
            self.observed_peak = used
            self.journal.observed_peak(used)
