"""Numeric health of a training run: judge trainer records, and what to change after a divergence.

Pure core: ``observe(verdict, record) -> verdict`` folds one ``trainer_log.jsonl`` record (or one
``trainer_state.json`` ``log_history`` entry) into a frozen verdict, so the supervisor judges each
record once as it arrives. ``remedy`` (the ladder) and ``decide`` (roll back, stop or give up) are
pure too. The shell that reads checkpoints and sets them aside is ``ftlaunch.run.rollback``.

What llamafactory 0.9.5 really writes (measured on the tiny model, fp32 on the CPU, see
``docs/health.md``): ``trainer_log.jsonl`` has no ``grad_norm``; a NaN loss is written as the JSON
token ``NaN`` only when ``logging_nan_inf_filter`` is off. With HF's default (on), a NaN step's loss
is replaced by the average of the earlier losses of the logging window, which is exactly ``0.0``
when every step of the window was NaN: so an exact 0.0 after a positive loss is read as a hidden NaN.
A checkpoint's ``trainer_state.json`` keeps ``grad_norm`` per logged step (``NaN`` tokens included).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from ftlaunch.plan.change import Change
from ftlaunch.plan.flags import truthy
from ftlaunch.plan.memory.prediction import MemoryPrediction

MAX_ROLLBACKS = 2


class Health(StrEnum):
    FINITE = "finite"
    SPIKY = "spiky"  # a loss spike in the last `window` records, not (yet) sustained
    DIVERGED = "diverged"


class Signal(StrEnum):
    NONFINITE_LOSS = "nonfinite_loss"
    HIDDEN_NAN = "hidden_nan_loss"  # loss exactly 0.0 after a positive one: logging_nan_inf_filter
    NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
    LOSS_SPIKE = "loss_spike"
    HUGE_SPIKE = "huge_loss_spike"  # one loss orders of magnitude above the attempt's first ones
    SCALER_SKIPS = "scaler_skips"  # fp16: the loss scaler skipped step after step
    ZERO_GRAD_NORM = "zero_grad_norm"  # grad_norm exactly 0, step after step: a dead model
    FLAT_LOSS = "flat_loss"  # the same loss to float precision, step after step: a dead model
    BAD_WEIGHTS = "bad_weights"  # the weights a finished run saved: not finite, or blown up (the scan)


class OnDiverge(StrEnum):
    ROLLBACK = "rollback"  # to a clean checkpoint; none left: the run ends diverged
    ROLLBACK_OR_RESTART = "rollback-or-restart"  # the same, and from the base model when none is left
    STOP = "stop"
    IGNORE = "ignore"


@dataclass(frozen=True)
class Thresholds:
    """When a run counts as diverged. Defaults are documented in docs/health.md."""

    spike_factor: float = 3.0  # a loss above this x the running median is a spike
    window: int = 20  # records in the running median
    sustain: int = 3  # consecutive spike records that make a divergence
    min_history: int = 5  # finite losses needed before spikes are judged
    # fp16: consecutive records with a non-finite grad_norm. GradScaler starts at 2**16 and halves the
    # scale on each overflow, so a few skips while it settles are normal; ten in a row is a collapse.
    max_scaler_skips: int = 10
    zero_loss_is_nan: bool = True
    # One loss this many times the median of the attempt's first `min_history` losses is a divergence
    # at once, whatever the history (real lr 1e3: 6.2 at step 1, 2.1e7 at step 2).
    huge_spike_factor: float = 100.0
    # Training steps (first to last record of the run, inclusive) with grad_norm exactly 0, or with the
    # same loss to `flat_rtol`, that make a dead run (real lr 1e4: grad_norm 0 and loss 6.2106008 +- 5e-7
    # from step 2 on). Steps, not records: with `logging_steps: 10` two records already span 11 steps.
    # A zero grad_norm run needs 2 records at least, a flat loss run `flat_records` (a live loss's
    # logged average matches its neighbour to 1e-5 about once in a thousand records: one match is luck).
    dead_steps: int = 5
    flat_rtol: float = 1e-5
    flat_records: int = 4
    # A checkpoint's weights are blown up above this x the reference's max |w| (the base model's, or
    # the previous clean checkpoint's for adapters); the real lr 1e4 run: 3.6e4 x the base.
    weight_factor: float = 100.0


def thresholds_from(text: str | None) -> Thresholds:
    """Parse ``spike_factor=4,window=50`` (FTLAUNCH_HEALTH). Unknown keys or bad values raise ValueError."""
    t = Thresholds()
    if not text or not text.strip():
        return t
    changes: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in Thresholds.__dataclass_fields__:
            raise ValueError(f"FTLAUNCH_HEALTH: unknown setting {part.strip()!r}")
        kind = type(getattr(t, key))
        if kind is bool:
            changes[key] = truthy(raw)
        else:
            changes[key] = kind(raw.strip())
            if changes[key] <= 0:
                raise ValueError(f"FTLAUNCH_HEALTH: {key} must be positive")
    return replace(t, **changes)


@dataclass(frozen=True)
class BadRecord:
    step: int | None
    signal: Signal
    values: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "signal": self.signal.value, "values": self.values}


@dataclass(frozen=True)
class Verdict:
    """The health of one attempt so far; also the fold's state."""

    health: Health = Health.FINITE
    first_bad: BadRecord | None = None  # set once diverged
    last_good_step: int | None = None  # the last record judged good before the first bad one
    records: int = 0
    recent: tuple[float, ...] = ()  # finite, non-spike losses, the last `window`
    spikes: tuple[BadRecord, ...] = ()  # the current run of consecutive spikes
    since_spike: int | None = None  # records since the last spike (None: none yet)
    skips: tuple[BadRecord, ...] = ()  # fp16: the current run of non-finite grad_norms
    seen_positive_loss: bool = False
    first_step: int | None = None  # the attempt's first logged training step
    first_losses: tuple[float, ...] = ()  # the attempt's first `min_history` finite losses
    first_median: float = 0.0  # their median: the huge-spike reference
    zero_grads: tuple[int | None, int] = (None, 0)  # the current run of grad_norm == 0: (first step, length)
    flat: tuple[int | None, float, int] = (None, 0.0, 0)  # the current run of equal losses: (first step, loss, length)
    good_steps: tuple[int, ...] = ()  # the last good record steps, newest last (a late grad_norm moves back)

    @property
    def diverged(self) -> bool:
        return self.health is Health.DIVERGED

    def message(self) -> str:
        if self.first_bad is None:
            return self.health.value
        b = self.first_bad
        vals = ", ".join(f"{k}={v}" for k, v in b.values.items())
        return f"diverged at step {b.step}: {b.signal.value} ({vals})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "health": self.health.value,
            "first_bad": self.first_bad.to_dict() if self.first_bad else None,
            "last_good_step": self.last_good_step,
        }


def as_number(value: Any) -> float | None:
    """A logged value as a float: JSON numbers, NaN/Infinity tokens, and strings ('nan', '1e+04')."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _shown(value: Any) -> Any:
    """A logged value for events and state: non-finite floats as text, so the JSON stays strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _step_of(rec: Mapping[str, Any]) -> int | None:
    step = rec.get("current_steps", rec.get("step"))
    return int(step) if isinstance(step, int | float) and not isinstance(step, bool) else None


def _bad(v: Verdict, b: BadRecord, records: int) -> Verdict:
    good = v.last_good_step
    if good is not None and b.step is not None and good >= b.step:  # a console grad_norm arrived late
        good = max((s for s in v.good_steps if s < b.step), default=None)
    return replace(
        v,
        health=Health.DIVERGED,
        first_bad=b,
        last_good_step=good,
        records=records,
        spikes=(),
        skips=(),
        zero_grads=(None, 0),
        flat=(None, 0.0, 0),
    )


def _dead(first: int | None, step: int | None, records: int, need_records: int, t: Thresholds) -> bool:
    """A run of dead records (zero grad_norm, or the same loss) long enough: it spans ``dead_steps``
    training steps in ``need_records`` records at least (``dead_steps`` records when steps are unknown)."""
    if first is None or step is None:
        return records >= t.dead_steps
    return records >= min(need_records, t.dead_steps) and step - first + 1 >= t.dead_steps


def observe(v: Verdict, rec: Mapping[str, Any], t: Thresholds = Thresholds(), *, fp16: bool = False) -> Verdict:
    """Fold one record into the verdict. Records without a training loss (eval, the summary) count only.

    Once diverged the verdict stays diverged: the first bad record is what a rollback needs.
    """
    n = v.records + 1
    if v.diverged:
        return replace(v, records=n)
    step = _step_of(rec)
    has_loss = "loss" in rec
    loss = as_number(rec.get("loss"))
    if v.first_step is None and has_loss:  # once per attempt
        v = replace(v, first_step=step)
    if has_loss and (loss is None or not math.isfinite(loss)):
        return _bad(v, BadRecord(step, Signal.NONFINITE_LOSS, {"loss": _shown(rec.get("loss"))}), n)
    if loss is not None and loss == 0.0 and v.seen_positive_loss and t.zero_loss_is_nan:
        return _bad(v, BadRecord(step, Signal.HIDDEN_NAN, {"loss": 0.0}), n)
    bad, skips, zero = _grad_norm_runs(v, rec, step, t, fp16=fp16)
    if bad is not None:
        return _bad(v, bad, n)
    if loss is None:
        return replace(v, records=n, skips=skips, zero_grads=zero)
    return _fold_loss(v, step, loss, n, skips, zero, t)


def _grad_norm_runs(
    v: Verdict, rec: Mapping[str, Any], step: int | None, t: Thresholds, *, fp16: bool
) -> tuple[BadRecord | None, tuple[BadRecord, ...], tuple[int | None, int]]:
    """The record's grad_norm against the runs so far: (the divergence or None, fp16 skips, zero grad_norms)."""
    grad = as_number(rec.get("grad_norm")) if "grad_norm" in rec else None
    skips = v.skips
    if "grad_norm" in rec and (grad is None or not math.isfinite(grad)):
        b = BadRecord(step, Signal.NONFINITE_GRAD_NORM, {"grad_norm": _shown(rec.get("grad_norm"))})
        if not fp16:
            return b, skips, v.zero_grads
        # fp16: the dynamic loss scaler skips an overflowing step and lowers the scale; a few are normal.
        skips = (*v.skips, replace(b, signal=Signal.SCALER_SKIPS))
        if len(skips) >= t.max_scaler_skips:
            first = skips[0]
            return replace(first, values={**first.values, "consecutive": len(skips)}), skips, v.zero_grads
    else:
        skips = ()
    zero = v.zero_grads
    if grad is not None:
        # A dead model: the optimizer has nothing to follow. Exactly 0, as HF logs it ('0').
        zero = ((step if zero[1] == 0 else zero[0]), zero[1] + 1) if grad == 0 else (None, 0)
        if _dead(zero[0], step, zero[1], 2, t):
            return BadRecord(zero[0], Signal.ZERO_GRAD_NORM, {"grad_norm": 0.0, "consecutive": zero[1]}), skips, zero
    return None, skips, zero


def _fold_loss(
    v: Verdict,
    step: int | None,
    loss: float,
    n: int,
    skips: tuple[BadRecord, ...],
    zero: tuple[int | None, int],
    t: Thresholds,
) -> Verdict:
    """Fold a finite training loss: huge spikes, flat losses, sustained spikes, else a good record."""
    positive = v.seen_positive_loss or loss > 0
    ref = v.first_median
    if ref > 0 and loss > t.huge_spike_factor * ref:
        return _bad(v, BadRecord(step, Signal.HUGE_SPIKE, {"loss": loss, "first_losses": round(ref, 6)}), n)
    firsts = v.first_losses
    if len(firsts) < t.min_history:
        firsts = (*firsts, loss)
        ref = statistics.median(firsts)
    f_step, f_loss, f_n = v.flat
    flat = (f_step, f_loss, f_n + 1) if f_n and abs(loss - f_loss) <= t.flat_rtol * abs(f_loss) else (step, loss, 1)
    if _dead(flat[0], step, flat[2], t.flat_records, t):
        return _bad(v, BadRecord(flat[0], Signal.FLAT_LOSS, {"loss": flat[1], "consecutive": flat[2]}), n)
    tracked = {"first_losses": firsts, "first_median": ref, "flat": flat, "zero_grads": zero}
    if len(v.recent) >= t.min_history:
        median = statistics.median(v.recent)
        if median > 0 and loss > t.spike_factor * median:
            spike = BadRecord(step, Signal.LOSS_SPIKE, {"loss": loss, "median": round(median, 6)})
            spikes = (*v.spikes, spike)
            if len(spikes) >= t.sustain:
                first = spikes[0]
                return _bad(v, replace(first, values={**first.values, "sustained": len(spikes)}), n)
            return replace(
                v,
                health=Health.SPIKY,
                records=n,
                spikes=spikes,
                since_spike=0,
                skips=skips,
                seen_positive_loss=positive,
                **tracked,
            )
    return _good(v, step, loss, n, skips, positive, tracked, t)


def _good(
    v: Verdict,
    step: int | None,
    loss: float,
    n: int,
    skips: tuple[BadRecord, ...],
    positive: bool,
    tracked: dict[str, Any],
    t: Thresholds,
) -> Verdict:
    """A good record: it extends the median's window and is a candidate rollback point."""
    known_good = step is not None and not skips
    since = None if v.since_spike is None else v.since_spike + 1
    spiky = since is not None and since < t.window
    return replace(
        v,
        health=Health.SPIKY if spiky else Health.FINITE,
        records=n,
        recent=(*v.recent, loss)[-t.window :],
        spikes=(),
        since_spike=since if spiky else None,
        skips=skips,
        # Inside a run of fp16 skips the step is not yet known good: the run may become the divergence.
        # (A run of zero grad_norms or equal losses that becomes one moves the last good step back, _bad.)
        last_good_step=step if known_good else v.last_good_step,
        good_steps=(*v.good_steps, step)[-16:] if known_good else v.good_steps,
        seen_positive_loss=positive,
        **tracked,
    )


# HF's console log line of a training step (transformers 5: values as strings), after tqdm's bar:
#   {'loss': '6.211', 'grad_norm': 'nan', 'learning_rate': '1e+08', 'epoch': '0.125'}
_CONSOLE = re.compile(r"\{'loss': [^{}]*'grad_norm': [^{}]*\}")
_PAIR = re.compile(r"'(\w+)': '?([^',}]*)'?")


def parse_console(line: str) -> list[dict[str, Any]]:
    """The training-step dicts HF printed in one console line (tqdm joins many with \\r): loss,
    grad_norm, learning_rate, epoch. ``trainer_log.jsonl`` lacks grad_norm; this is where it is live."""
    if "'grad_norm'" not in line:
        return []
    return [{k: v.strip() for k, v in _PAIR.findall(m.group(0))} for m in _CONSOLE.finditer(line)]


def judge(
    records: Iterable[Mapping[str, Any]],
    t: Thresholds = Thresholds(),
    *,
    fp16: bool = False,
    start: Verdict | None = None,
) -> Verdict:
    v = start or Verdict()
    for rec in records:
        v = observe(v, rec, t, fp16=fp16)
    return v


# A run that ended while a dead or spiking tail was still too short for the rules above: the records
# there are decide. Two zero grad_norms, three equal losses or two spikes in a row at the very end
# (the last records come from the weights the run saves) are a divergence.
END_ZERO_GRADS = 2
END_FLAT = 3
END_SPIKES = 2


def judge_end(v: Verdict, t: Thresholds = Thresholds()) -> Verdict:
    """The verdict of an attempt whose trainer finished (exit 0): a tail the streaming rules had not yet
    called (issue 31: lr 1e4 in the last 4 of 40 steps, or with ``logging_steps: 10``) is judged with the
    records there are. Pure; the weight scan of what the run saved is ``rollback.HealthWatch``'s."""
    if v.diverged:
        return v
    first, n = v.zero_grads
    if n >= min(END_ZERO_GRADS, t.dead_steps):
        return _bad(
            v, BadRecord(first, Signal.ZERO_GRAD_NORM, {"grad_norm": 0.0, "consecutive": n, "at_end": True}), v.records
        )
    f_step, f_loss, f_n = v.flat
    if f_n >= min(END_FLAT, t.dead_steps):
        return _bad(
            v, BadRecord(f_step, Signal.FLAT_LOSS, {"loss": f_loss, "consecutive": f_n, "at_end": True}), v.records
        )
    if len(v.spikes) >= min(END_SPIKES, t.sustain):
        first_spike = v.spikes[0]
        values = {**first_spike.values, "sustained": len(v.spikes), "at_end": True}
        return _bad(v, replace(first_spike, values=values), v.records)
    return v


def weights_verdict(v: Verdict, step: int | None, where: str, why: str) -> Verdict:
    """The verdict when the records were fine but what the run saved is not (the weight scan). The last
    good step stays: every record was judged good, so a checkpoint before ``step`` that a good record
    followed is still a rollback target (its own weights are scanned before it is one)."""
    b = BadRecord(step, Signal.BAD_WEIGHTS, {"where": where, "why": why})
    return replace(
        v, health=Health.DIVERGED, first_bad=b, spikes=(), skips=(), zero_grads=(None, 0), flat=(None, 0.0, 0)
    )


def history_is_clean(
    log_history: Iterable[Mapping[str, Any]], t: Thresholds = Thresholds(), *, fp16: bool = False
) -> bool:
    """A checkpoint's own trainer_state.json log_history: no divergence up to the checkpoint."""
    return not judge([r for r in log_history if "loss" in r or "grad_norm" in r], t, fp16=fp16).diverged


# ---------------------------------------------------------------- the remedy ladder


@dataclass(frozen=True)
class Remedy:
    changes: tuple[Change, ...]
    what: str

    @property
    def edits(self) -> dict[str, Any]:
        return {c.key: c.new for c in self.changes}


def remedy(n: int, config: Mapping[str, Any], *, fp32_fits: bool = False) -> Remedy:
    """The change for rollback ``n`` (1-based). Batch keys are never touched: the global batch stays.

    Rungs, in order, skipping those that do not apply: learning rate x0.5; ``max_grad_norm`` 1.0 when
    clipping was off (0/null) or looser; fp32 instead of fp16 when the memory model says it fits.
    Past the rungs, the learning rate is halved again.
    """
    lr = as_number(config.get("learning_rate"))
    lr = 5e-5 if lr is None else lr  # HF TrainingArguments' default

    def rung(key: str, new: Any, what: str) -> Remedy:
        return Remedy((Change(key, config.get(key), new, f"after a divergence: {what}"),), what)

    halve = rung("learning_rate", lr / 2, f"learning_rate {lr:g} -> {lr / 2:g}")
    rungs = [halve]
    clip = config.get("max_grad_norm", 1.0)  # HF's default is 1.0
    clip_n = as_number(clip)
    if clip is None or clip_n is None or clip_n <= 0 or clip_n > 1.0:
        rungs.append(rung("max_grad_norm", 1.0, f"max_grad_norm {clip} -> 1.0"))
    if config.get("fp16") and fp32_fits:
        rungs.append(rung("fp16", False, "fp16 -> fp32 (the memory model says it fits)"))
    return rungs[n - 1] if 1 <= n <= len(rungs) else halve


# ---------------------------------------------------------------- what to do after a divergence


@dataclass(frozen=True)
class Checkpoint:
    step: int
    name: str
    clean: bool  # a rollback target: its history, the record after it and its weights are all good
    why: str = ""  # why not, in words (the message says it)
    aside_as: str = "diverged"  # the prefix it is set aside under: diverged, badweights, unverified


def _history_steps(hist: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in hist if "loss" in r or "grad_norm" in r]


def judge_checkpoints(
    verdict: Verdict,
    checkpoints: Iterable[tuple[int, str, list[dict] | None]],
    t: Thresholds = Thresholds(),
    *,
    fp16: bool = False,
) -> list[Checkpoint]:
    """Which complete checkpoints (step, name, trainer_state.json log_history) the records call clean.

    A checkpoint is clean only if its own history is clean *and* the first record logged after it is:
    that record's loss and grad_norm come from the weights it holds (real lr 1e8: checkpoint-2's
    history is finite, its weights are NaN, and step 3 says so). For a checkpoint this attempt trained
    from or past, that record is in this attempt's verdict (clean when a good record follows it); for an
    older one, in the log_history of the checkpoint this attempt resumed from. Weights are judged
    after this, by ``weights_problem``."""
    cks = sorted(checkpoints, key=lambda c: c[0])
    first = verdict.first_step
    resumed = max((s for s, _, _ in cks if first is not None and s < first), default=0)
    later = {s: h for s, _, h in cks}
    good = verdict.last_good_step
    bad = verdict.first_bad.step if verdict.first_bad else None
    out = []
    for step, name, hist in cks:
        if hist is None:
            out.append(Checkpoint(step, name, False, "its trainer_state.json is unreadable", "unverified"))
            continue
        if judge(_history_steps(hist), t, fp16=fp16).diverged:
            out.append(Checkpoint(step, name, False, "its own log_history shows the divergence"))
            continue
        if bad is not None and step >= bad:
            out.append(Checkpoint(step, name, False, f"written at or after the first bad record (step {bad})"))
            continue
        if step >= resumed:
            if good is None or step >= good:
                nxt = f"the record after it (step {bad})" if bad is not None else "no good record after it"
                out.append(Checkpoint(step, name, False, f"its weights gave {nxt}" if bad else nxt))
            else:
                out.append(Checkpoint(step, name, True))
            continue
        ref = _history_steps(later.get(resumed) or [])
        upto = next((i for i, r in enumerate(ref) if _step_of(r) is not None and _step_of(r) > step), None)
        if upto is None:
            out.append(Checkpoint(step, name, False, "no record after it is known", "unverified"))
        elif judge(ref[: upto + 1], t, fp16=fp16).diverged:
            out.append(Checkpoint(step, name, False, f"its weights gave a bad record (step {_step_of(ref[upto])})"))
        else:
            out.append(Checkpoint(step, name, True))
    return out


def weights_problem(scan: Mapping[str, Any], ref: Mapping[str, Any] | None, factor: float) -> str | None:
    """Why a checkpoint's weight scan (ftlaunch/run/weights_child.py) rules it out, or None.

    Non-finite values, or a max |w| over the tensors sampled in both above ``factor`` x the reference's
    (the base model, or the previous clean checkpoint). No scan (no safetensors): nothing to say."""
    if not scan or scan.get("error") or not scan.get("elements"):
        return None
    if scan.get("nonfinite"):
        return f"weights: {scan['nonfinite']} non-finite of {scan['elements']} sampled values"
    if not ref:
        return None
    mine, theirs = scan.get("tensors") or {}, ref.get("tensors") or {}
    common = [k for k in mine if k in theirs]
    if not common:
        return None
    top = max(abs(float(mine[k])) for k in common)
    base = max(abs(float(theirs[k])) for k in common)
    if base > 0 and top > factor * base:
        label = ref.get("label", "reference")
        return f"weights blown up: max |w| {top:.3g}, {top / base:.3g} x the {label}'s {base:.3g}"
    return None


def judge_weights(
    checkpoints: Iterable[Checkpoint],
    scans: Mapping[str, Mapping[str, Any]],
    base: Mapping[str, Any] | None,
    factor: float,
) -> list[Checkpoint]:
    """Rule out the clean-by-records checkpoints whose weight scan is bad. Each is compared with the
    base model where they share tensors (full fine-tuning), else with the previous clean checkpoint
    (adapters: LoRA's B starts at zero, so the base says nothing)."""
    out: list[Checkpoint] = []
    prev: Mapping[str, Any] | None = None
    for c in sorted(checkpoints, key=lambda c: c.step):
        scan = scans.get(c.name)
        if c.clean and scan:
            shares = base is not None and set(scan.get("tensors") or {}) & set(base.get("tensors") or {})
            why = weights_problem(scan, {**base, "label": "base model"} if shares and base else prev, factor)
            if why:
                c = replace(c, clean=False, why=why, aside_as="badweights")
            elif not scan.get("error"):
                prev = {**scan, "label": f"previous clean checkpoint ({c.name})"}
        out.append(c)
    return out


class Response(StrEnum):
    """What the supervisor does about a divergence."""

    ROLLBACK = "rollback"
    STOP = "stop"  # by policy (--on-diverge stop)
    GIVE_UP = "give_up"  # rollbacks spent, or no clean checkpoint left and no restart allowed
    IGNORE = "ignore"  # --on-diverge ignore


@dataclass(frozen=True)
class Decision:
    action: Response
    message: str
    resume_from: str | None = None  # None: from the base model
    set_aside: tuple[tuple[str, str], ...] = ()  # (checkpoint, prefix): every one after the target
    changes: tuple[Change, ...] = ()
    remedy: str = ""  # the rung applied, in words

    @property
    def edits(self) -> dict[str, Any]:
        return {c.key: c.new for c in self.changes}


def _rejected(cks: Iterable[Checkpoint]) -> str:
    return "; ".join(f"{c.name}: {c.why}" for c in cks if not c.clean and c.why)


def decide(
    verdict: Verdict,
    policy: OnDiverge,
    config: Mapping[str, Any],
    checkpoints: Iterable[Checkpoint],
    *,
    rollbacks_used: int,
    max_rollbacks: int = MAX_ROLLBACKS,
    fp32_fits: bool = False,
    tried: Iterable[str] = (),
) -> Decision:
    """Roll back to the newest clean checkpoint (``judge_checkpoints`` and the weight scan), from the
    base model when none is left and the policy allows it, or stop.

    Every checkpoint after the target (all of them when there is none) is set aside, never deleted.
    """
    where = verdict.message()
    if policy is OnDiverge.IGNORE:
        return Decision(Response.IGNORE, f"{where}; --on-diverge ignore: training on")
    cks = sorted(checkpoints, key=lambda c: c.step)
    good = next((c for c in reversed(cks) if c.clean), None)
    aside = tuple((c.name, c.aside_as) for c in cks if good is None or c.step > good.step)
    rejected = _rejected(c for c in cks if good is None or c.step > good.step)
    none_left = "no clean checkpoint remains" + (f" ({rejected})" if rejected else " (none was written before it)")
    target = good.name if good else None
    if policy is OnDiverge.STOP:
        return Decision(Response.STOP, f"{where}; --on-diverge stop: stopped", target, aside)
    n = rollbacks_used + 1
    if n > max_rollbacks:
        done = "; ".join(tried) or "nothing"
        return Decision(
            Response.GIVE_UP,
            f"{where}; diverged again after {max_rollbacks} rollbacks (tried: {done}): giving up",
            target,
            aside,
        )
    if good is None and policy is not OnDiverge.ROLLBACK_OR_RESTART:
        return Decision(
            Response.GIVE_UP,
            f"{where}; {none_left}: not restarting from the base model (--on-diverge rollback-or-restart would)",
            None,
            aside,
        )
    r = remedy(n, config, fp32_fits=fp32_fits)
    if good is None:
        origin = f"from the base model ({none_left})"
    else:
        origin = f"from {good.name}" + (f" ({rejected})" if rejected else "")
    msg = f"[{n}/{max_rollbacks}] {where}: rolling back {origin} with {r.what}, global batch unchanged"
    return Decision(Response.ROLLBACK, msg, target, aside, r.changes, r.what)


def fp32_fits(memory: MemoryPrediction | None) -> bool:
    """Whether an fp16 run's plan leaves room for fp32 (the plan's memory prediction); unknown: no.

    HF mixed precision keeps fp32 master weights, gradients and optimizer state already; fp32 doubles
    what autocast held in half precision: activations and logits.
    """
    if memory is None or not memory.fits:
        return False
    e = memory.estimate
    return e.peak_gib + e.activations_gib + e.logits_gib <= memory.usable_gib
