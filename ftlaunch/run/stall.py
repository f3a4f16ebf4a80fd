"""The stall watchdog's decisions: what counts as progress, which allowance is in force, when a
trainer that still runs has stopped making progress. Pure: the supervisor feeds it what it saw
(step records, console bytes, a checkpoint folder growing) with the time, and asks ``verdict(now)``.

Anchors (issue 20): nvidia-resiliency-ext sets its timeouts to 5x the longest interval seen and skips
the first iterations and checkpoint saves; torchtitan uses a 100 s collective timeout after the first
step; fairseq has ``--heartbeat-timeout``. Here:

- **training**: progress is a new step record. Timeout: ``--stall-timeout``, else
  max(``floor`` = 10 min, 5x the longest interval between step records seen so far).
- **loading** (before the first step record: model load, tokenizing): any console output is progress
  (tokenizer progress bars). Allowance: max(timeout, 3x the load time measured by an earlier attempt),
  else max(timeout, ``load_floor`` = 30 min) when nothing was measured yet.
- **saving** (from "Saving model checkpoint to" until the checkpoint is complete or the next step) and
  **evaluating** (from "***** Running Evaluation *****" to the next step record): console output and a
  checkpoint folder growing are progress; the allowance is max(timeout, 3x the longest such phase
  seen, ``phase_floor`` = 30 min unless ``--stall-timeout`` was given, then 3x it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

FLOOR_S = 600.0
LOAD_FLOOR_S = 1800.0
PHASE_FLOOR_S = 1800.0
FACTOR = 5.0  # x the longest step interval (nvidia-resiliency-ext)
SLOW_PHASE_FACTOR = 3.0  # x the longest load / save / evaluation seen

SAVE_MARK = "Saving model checkpoint to"
EVAL_MARK = "***** Running Evaluation *****"


class Phase(StrEnum):
    LOADING = "loading"  # before the first step record of this attempt
    TRAINING = "training"
    SAVING = "saving"
    EVALUATING = "evaluating"


@dataclass(frozen=True)
class StallPolicy:
    """The user's ``--stall-timeout`` (None: derived) and the floors. Tests shrink the floors."""

    timeout: float | None = None
    floor: float = FLOOR_S
    load_floor: float = LOAD_FLOOR_S
    phase_floor: float = PHASE_FLOOR_S


@dataclass(frozen=True)
class Watchdog:
    """What the watchdog knows of one attempt. Every method returns a new value (frozen)."""

    policy: StallPolicy
    started: float  # when the attempt's trainer started
    last_progress: float  # when progress was last seen
    phase: Phase = Phase.LOADING
    phase_since: float = 0.0
    last_step: int | None = None
    last_step_at: float | None = None
    longest_step_gap: float = 0.0  # seconds between two step records, the longest seen
    slow_since_step: float = 0.0  # time spent saving or evaluating since the last step record
    longest_slow_phase: float = 0.0  # the longest save or evaluation seen (this run)
    load_seconds: float | None = None  # measured: trainer start -> first step record
    measured_load: float | None = None  # an earlier attempt's load time (from the run's state)

    @classmethod
    def begin(cls, policy: StallPolicy, now: float, earlier: dict[str, Any] | None = None) -> Watchdog:
        """A new attempt; ``earlier``: the previous attempt's ``to_dict()`` (load time, longest gaps)."""
        e = earlier or {}
        return cls(
            policy=policy,
            started=now,
            last_progress=now,
            phase_since=now,
            longest_step_gap=float(e.get("longest_step_gap_s") or 0.0),
            longest_slow_phase=float(e.get("longest_slow_phase_s") or 0.0),
            measured_load=_num(e.get("load_s")) or _num(e.get("measured_load_s")),
        )

    # ------------------------------------------------------------ what was seen

    def steps(self, step: int, now: float) -> Watchdog:
        """A step record (the newest of a batch): progress, and the phase is training again."""
        if self.last_step is not None and step <= self.last_step:
            return self
        w = self
        slow = w.slow_since_step
        if w.phase in (Phase.SAVING, Phase.EVALUATING):
            w = replace(w, longest_slow_phase=max(w.longest_slow_phase, now - w.phase_since))
            slow += now - w.phase_since
        # the training part only: a save or an evaluation has its own allowance
        gap = 0.0 if w.last_step_at is None else max(0.0, now - w.last_step_at - slow)
        return replace(
            w,
            phase=Phase.TRAINING,
            phase_since=now,
            last_step=step,
            last_step_at=now,
            last_progress=now,
            longest_step_gap=max(w.longest_step_gap, gap),
            slow_since_step=0.0,
            load_seconds=w.load_seconds if w.load_seconds is not None else now - w.started,
        )

    def console(self, text: str, now: float) -> Watchdog:
        """Console output of the trainer: progress while loading, saving or evaluating; it may open a phase."""
        w = self
        if SAVE_MARK in text and w.phase is not Phase.LOADING:
            w = replace(w, phase=Phase.SAVING, phase_since=now)
        elif EVAL_MARK in text and w.phase is not Phase.LOADING:
            w = replace(w, phase=Phase.EVALUATING, phase_since=now)
        if w.phase is not Phase.TRAINING:
            w = replace(w, last_progress=now)
        return w

    def checkpoint_grew(self, now: float) -> Watchdog:
        """A checkpoint folder got bigger (or appeared): the trainer is saving."""
        w = self if self.phase is not Phase.TRAINING else replace(self, phase=Phase.SAVING, phase_since=now)
        return replace(w, last_progress=now)

    def checkpoint_done(self, now: float) -> Watchdog:
        """A complete checkpoint landed: the save is over (training goes on, or the run ends)."""
        if self.phase is not Phase.SAVING:
            return replace(self, last_progress=now)
        took = now - self.phase_since
        return replace(
            self,
            phase=Phase.TRAINING,
            phase_since=now,
            last_progress=now,
            longest_slow_phase=max(self.longest_slow_phase, took),
            slow_since_step=self.slow_since_step + took,
        )

    # ------------------------------------------------------------ the verdict

    def timeout(self) -> float:
        """The training timeout in force: the user's, else max(floor, 5x the longest step gap)."""
        if self.policy.timeout is not None:
            return float(self.policy.timeout)
        return max(self.policy.floor, FACTOR * self.longest_step_gap)

    def allowance(self) -> float:
        """Seconds without progress tolerated in the current phase."""
        base = self.timeout()
        if self.phase is Phase.LOADING:
            if self.measured_load is not None:
                return max(base, SLOW_PHASE_FACTOR * self.measured_load)
            return max(base, self.policy.load_floor)
        if self.phase in (Phase.SAVING, Phase.EVALUATING):
            floor = SLOW_PHASE_FACTOR * base if self.policy.timeout is not None else self.policy.phase_floor
            return max(base, floor, SLOW_PHASE_FACTOR * self.longest_slow_phase)
        return base

    def idle(self, now: float) -> float:
        return max(0.0, now - self.last_progress)

    def stalled(self, now: float) -> bool:
        return self.idle(now) > self.allowance()

    def describe(self, now: float) -> str:
        """One line for the events and train.log: phase, idle seconds, allowance and where it comes from."""
        idle, allow = self.idle(now), self.allowance()
        where = f" after step {self.last_step}" if self.last_step is not None else " before the first step"
        return f"no progress for {idle:.0f} s{where} ({self.phase.value}; allowance {allow:.0f} s: {self.why()})"

    def why(self) -> str:
        if self.policy.timeout is not None:
            base = f"--stall-timeout {self.policy.timeout:g}"
        elif FACTOR * self.longest_step_gap > self.policy.floor:
            base = f"5x the longest step interval ({self.longest_step_gap:.1f} s)"
        else:
            base = f"the {self.policy.floor:.0f} s floor"
        if self.phase is Phase.LOADING:
            if self.measured_load is not None:
                return f"loading: max({base}, 3x the load time measured before, {self.measured_load:.0f} s)"
            return f"loading: max({base}, {self.policy.load_floor:.0f} s before the first step)"
        if self.phase in (Phase.SAVING, Phase.EVALUATING):
            return f"{self.phase.value}: a longer allowance than {base}"
        return base

    def to_dict(self, now: float, wall_now: float) -> dict[str, Any]:
        """What state.json keeps (``status`` shows it; the next attempt starts from it). ``now`` is the
        watchdog's clock, ``wall_now`` the wall clock (``last_progress_at`` is wall time)."""
        return {
            "phase": self.phase.value,
            "last_progress_at": round(wall_now - self.idle(now), 3),
            "idle_s": round(self.idle(now), 1),
            "timeout_s": round(self.timeout(), 1),
            "allowance_s": round(self.allowance(), 1),
            "why": self.why(),
            "last_step": self.last_step,
            "longest_step_gap_s": round(self.longest_step_gap, 3),
            "longest_slow_phase_s": round(self.longest_slow_phase, 3),
            "load_s": None if self.load_seconds is None else round(self.load_seconds, 2),
            "measured_load_s": self.measured_load,
        }


def _num(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
