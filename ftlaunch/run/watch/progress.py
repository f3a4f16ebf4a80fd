"""The progress watch: the trainer's own trainer_log.jsonl (this attempt's lines), kept in the run's
records, shown to `status` (at most once a second, with the recent tokens/s: `status` never reads
trainer_log.jsonl), and "recovering" until the trainer passes the furthest step seen before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ftlaunch.run import accounting as acc
from ftlaunch.run import progress as prog
from ftlaunch.run import records as run_records
from ftlaunch.run.journal import RunJournal
from ftlaunch.run.recovery import Halt
from ftlaunch.run.tail import Tail
from ftlaunch.run.watch import Seen

# The records the recent tokens/s is measured over: its window (accounting.recent_rates, 20 logged
# steps) with room for the evaluation and summary records between them.
RATE_RECORDS = 200


class ProgressWatch:
    def __init__(
        self,
        journal: RunJournal,
        out: Path,
        attempt: int,
        recover_until: int | None,
        before: prog.Progress,
        before_rate: float | None,
        clock: Callable[[], float],
        wall: Callable[[], float],
    ):
        """``recover_until``: the furthest step seen before (None: not recovering); ``before``, at
        ``before_rate``: what is shown until the trainer logs a step (the resume point, never a
        countdown to 0m00s while the trainer loads)."""
        self.journal, self.attempt, self.clock, self.wall = journal, attempt, clock, wall
        self.tlog = Tail.from_end(out / "trainer_log.jsonl")
        self.recover_until = recover_until
        self.before, self.before_rate = before, before_rate
        self.records: list[dict] = []
        self.rate = prog.StepRate()
        self.last_step: int | None = None
        self.next_update = 0.0

    def start(self, pid: int) -> None:
        pass

    def tick(self, seen: Seen) -> Halt | None:
        raw = self.tlog.lines()
        run_records.keep(self.journal.run_dir, raw, self.journal.unwritten)  # the run's own copy
        seen.new = new = prog.parse_trainer_log(raw)
        if new:
            self.records.extend(new)
            now = self.wall()
            self.last_step = int(new[-1]["current_steps"])
            steps_per_second = self.rate.update(int(new[0]["current_steps"]), self.last_step, now)
            caught_up = self.recover_until is not None and self.last_step > self.recover_until
            if self.clock() >= self.next_update or seen.rc is not None or caught_up:
                p = prog.latest_progress(self.records, furthest=None if caught_up else self.recover_until)
                recovered = self.attempt if caught_up else None
                self.journal.progress(p, steps_per_second, now, recovered=recovered, tokens=self._tokens())
                self.recover_until = None if caught_up else self.recover_until
                self.next_update = self.clock() + 1.0
        elif seen.rc is None and self.recover_until is not None and not self.records:
            if self.clock() >= self.next_update:
                self.journal.progress(self.before, self.before_rate, self.wall())
                self.next_update = self.clock() + 1.0
        seen.step, seen.rate = self.last_step, self.rate.rate
        return None

    def after(self, seen: Seen) -> None:
        if self.records:  # the last lines may have arrived while updates were throttled
            self.journal.last_progress(prog.latest_progress(self.records, furthest=self.recover_until), self._tokens())

    def _tokens(self) -> float | None:
        """tokens/s over this attempt's last logged steps, from the trainer's own clock (llamafactory's
        ``throughput`` counts the tokens restored from a checkpoint too)."""
        return acc.recent_rates(self.records[-RATE_RECORDS:])["tokens_per_second"]
