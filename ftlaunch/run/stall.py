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
  **evaluating** (from "***** Running Evaluation *****" to the next step record): the allowance is
  max(timeout, 3x the longest such phase seen, ``phase_floor`` = 30 min unless ``--stall-timeout`` was
  given, then 3x it). While saving only the checkpoint folder growing is progress (a save stuck on a
  network filesystem while a logging thread prints is a stall); while evaluating console output is.

Every phase but training also ends (issue 31: a save that printed a line every 0.5 s stayed `saving` for
6.5 min against a 30 s allowance): its **limit** counts from the phase's start, whatever it printed.
Saving: max(allowance, 3x the longest save seen, 3x the checkpoint's bytes (the largest seen, or the
disk forecast's) over the slowest write speed measured on this run's saves, 20 MB/s before one was).
Evaluating: 3x the longest evaluation seen, at least the allowance; loading: 3x the load time an
earlier attempt measured, at least the allowance. Before anything was measured, console output is
counted up to ``CAP_FACTOR`` (4) x the allowance.
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
CAP_FACTOR = 4.0  # nothing measured yet: a chatty phase lasts at most this x its allowance
MIN_WRITE_RATE = 20e6  # bytes/s assumed for a save before one was measured (a slow network filesystem)

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
    checkpoint_bytes: int | None = None  # the disk forecast's size of one checkpoint, when known


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
    longest_save: float = 0.0  # the longest save seen (this run)
    longest_eval: float = 0.0  # the longest evaluation seen (this run)
    save_bytes: int = 0  # the largest checkpoint seen land (bytes)
    write_rate: float | None = None  # bytes/s: the slowest save measured (size / time from its start)
    save_started: float | None = None  # when the save in progress began (a step record may end the phase first)
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
            longest_save=float(e.get("longest_save_s") or 0.0),
            longest_eval=float(e.get("longest_eval_s") or 0.0),
            save_bytes=int(e.get("save_bytes") or 0),
            write_rate=_num(e.get("write_rate_bps")),
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
            w = w._ended(now)
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

    def _ended(self, now: float) -> Watchdog:
        """The save or evaluation in progress ends now: its length is kept (the next one's allowance)."""
        took = now - self.phase_since
        w = replace(self, longest_slow_phase=max(self.longest_slow_phase, took))
        if self.phase is Phase.SAVING:
            return replace(w, longest_save=max(w.longest_save, took))
        return replace(w, longest_eval=max(w.longest_eval, took))

    def console(self, text: str, now: float) -> Watchdog:
        """Console output of the trainer: progress while loading or evaluating (up to the phase's limit),
        never while saving (a stuck save whose logging thread prints is a stall); it may open a phase."""
        w = self
        opens = Phase.SAVING if SAVE_MARK in text else Phase.EVALUATING if EVAL_MARK in text else None
        if opens is not None and w.phase not in (Phase.LOADING, opens):  # a growing folder may have opened it
            w = w._ended(now) if w.phase is not Phase.TRAINING else w
            if opens is Phase.SAVING:
                w = replace(w, save_started=now)
            return replace(w, phase=opens, phase_since=now, last_progress=now)
        if w.phase in (Phase.LOADING, Phase.EVALUATING):
            w = replace(w, last_progress=now)
        return w

    def checkpoint_grew(self, now: float) -> Watchdog:
        """A checkpoint folder got bigger (or appeared): the trainer is saving."""
        w = self if self.phase is not Phase.TRAINING else replace(self, phase=Phase.SAVING, phase_since=now)
        started = w.save_started if w.save_started is not None else now
        return replace(w, last_progress=now, save_started=started)

    def checkpoint_done(self, now: float, size: int | None = None) -> Watchdog:
        """A complete checkpoint landed (``size`` bytes): the save is over (training goes on, or the run
        ends); its length and write speed set the next save's limit. The save is timed from its start
        even when a step record came first and ended the phase (both seen in one poll)."""
        w = self
        if w.save_started is not None:
            took = now - w.save_started
            w = replace(w, save_started=None, longest_save=max(w.longest_save, took))
            if size:
                rate = size / max(took, 1e-3)
                w = replace(
                    w,
                    save_bytes=max(w.save_bytes, size),
                    write_rate=rate if w.write_rate is None else min(w.write_rate, rate),
                )
        if w.phase is not Phase.SAVING:
            return replace(w, last_progress=now)
        took = now - w.phase_since
        w = w._ended(now)
        return replace(
            w,
            phase=Phase.TRAINING,
            phase_since=now,
            last_progress=now,
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

    def limit(self) -> tuple[float | None, str]:
        """How long the current phase may last in all, from its start, and why; (None, "") in training."""
        allow = self.allowance()
        if self.phase is Phase.SAVING:
            size = max(self.save_bytes, self.policy.checkpoint_bytes or 0)
            rate = self.write_rate or MIN_WRITE_RATE
            by_size = SLOW_PHASE_FACTOR * size / rate
            rated = "measured" if self.write_rate else "assumed before a save was measured"
            return max(allow, SLOW_PHASE_FACTOR * self.longest_save, by_size), (
                f"max(the allowance, 3x the longest save {self.longest_save:.1f} s, 3x {size} B at "
                f"{rate / 1e6:.3g} MB/s {rated})"
            )
        if self.phase is Phase.EVALUATING:
            if self.longest_eval:
                return max(allow, SLOW_PHASE_FACTOR * self.longest_eval), (
                    f"max(the allowance, 3x the longest evaluation {self.longest_eval:.1f} s)"
                )
            return CAP_FACTOR * allow, "4x the allowance: no evaluation measured yet"
        if self.phase is Phase.LOADING:
            if self.measured_load is not None:
                return allow, "the allowance: 3x the load time measured before, output or not"
            return CAP_FACTOR * allow, "4x the allowance: no load measured yet"
        return None, ""

    def _since(self, now: float) -> float:
        return max(0.0, now - (self.started if self.phase is Phase.LOADING else self.phase_since))

    def idle(self, now: float) -> float:
        return max(0.0, now - self.last_progress)

    def over_limit(self, now: float) -> bool:
        limit = self.limit()[0]
        return limit is not None and self._since(now) > limit

    def stalled(self, now: float) -> bool:
        return self.idle(now) > self.allowance() or self.over_limit(now)

    def describe(self, now: float) -> str:
        """One line for the events and train.log: phase, idle seconds, allowance and where it comes from."""
        idle, allow = self.idle(now), self.allowance()
        where = f" after step {self.last_step}" if self.last_step is not None else " before the first step"
        if self.over_limit(now) and idle <= allow:
            limit, why = self.limit()
            return (
                f"{self.phase.value} for {self._since(now):.0f} s{where}, past the phase's limit of {limit:.0f} s "
                f"({why}); output is not progress past it"
            )
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
            "longest_save_s": round(self.longest_save, 3),
            "longest_eval_s": round(self.longest_eval, 3),
            "save_bytes": self.save_bytes,
            "write_rate_bps": None if self.write_rate is None else round(self.write_rate),
            "phase_s": round(self._since(now), 1),
            "phase_limit_s": None if self.limit()[0] is None else round(self.limit()[0], 1),
            "load_s": None if self.load_seconds is None else round(self.load_seconds, 2),
            "measured_load_s": self.measured_load,
        }


def _num(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
