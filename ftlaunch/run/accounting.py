"""Run accounting (pure): a run's attempts from its events and trainer log, its rates over time, and
what it cost in GPU-hours (so far, and projected to the end). `status`, `runs`, `plot` and the
estimate's run history read these; nothing here touches a file or the clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any


def trainer_clock(records: Sequence[Mapping[str, Any]]) -> list[tuple[int, float, int | None]]:
    """(step, seconds since training began, tokens seen) per logged step, from the trainer's own
    clock: llamafactory writes throughput = tokens / (now - start), so now - start = tokens / it,
    to ~1e-5 relative (elapsed_time itself is whole seconds). Steps without those fields are left
    out; the final summary record (no loss) too."""
    out = []
    for r in records:
        if r.get("loss") is None or not r.get("throughput") or not r.get("total_tokens"):
            continue
        out.append((int(r["current_steps"]), float(r["total_tokens"]) / float(r["throughput"]), int(r["total_tokens"])))
    return out


def gpu_hours(elapsed_seconds: float, gpus: int) -> float:
    """GPU-hours for ``elapsed_seconds`` of wall time on ``gpus`` GPUs."""
    return max(0.0, elapsed_seconds) * max(0, gpus) / 3600.0


def projected_hours(step: int | None, total: int | None, steps_per_second: float | None) -> float | None:
    """Wall hours still to go: from ``step`` to ``total`` at ``steps_per_second`` (this attempt's
    own rate). None when any is unknown. Projected GPU-hours of a run = gpu_hours(elapsed so far,
    gpus) + projected_hours(...) x gpus."""
    if step is None or not total or not steps_per_second or steps_per_second <= 0:
        return None
    return max(0, total - step) / steps_per_second / 3600.0


def _clock_seconds(text: Any) -> float | None:
    """llamafactory's elapsed_time "H:MM:SS" (or "N days, H:MM:SS") -> seconds."""
    if not isinstance(text, str):
        return None
    days = 0
    if "day" in text:
        d, _, text = text.partition(",")
        days = int(d.split()[0])
    try:
        h, m, s = (float(x) for x in text.strip().split(":"))
    except ValueError:
        return None
    return days * 86400 + h * 3600 + m * 60 + s


def split_attempts(records: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Split trainer_log.jsonl records into attempts: a restart shows as a step that does not
    advance or a clock that goes back (the file is appended to, never trimmed)."""
    segments: list[list[Mapping[str, Any]]] = []
    prev_step: int | None = None
    prev_clock: float | None = None
    for r in records:
        if r.get("loss") is None:
            continue  # the final summary record repeats the last step
        step = int(r["current_steps"])
        clock = _clock_seconds(r.get("elapsed_time"))
        restarted = prev_step is not None and (
            step <= prev_step or (clock is not None and prev_clock is not None and clock < prev_clock)
        )
        if not segments or restarted:
            segments.append([])
        segments[-1].append(r)
        prev_step, prev_clock = step, clock
    return segments


def segment_attempts(
    segments: Sequence[Sequence[Mapping[str, Any]]], spans: Sequence[Mapping[str, Any]]
) -> list[int | None]:
    """The attempt number that wrote each trainer-log segment, or None when the events cannot tell.

    A resumed attempt logs from its checkpoint's step + 1, so segment k matches the attempt whose
    `resume_from` is its first step - 1 (the first segment: an attempt that resumed from nothing).
    Attempts that failed before logging (an OOM at start) share that `resume_from`: the last of the
    consecutive ones is the one that logged. Never a number that is not in the events."""
    out: list[int | None] = []
    i = 0
    for k, seg in enumerate(segments):
        want = None if k == 0 else int(seg[0]["current_steps"]) - 1 if seg else -1
        j = next((n for n in range(i, len(spans)) if spans[n].get("resume_from") == want), None)
        if j is None:
            out.append(None)
            continue
        while j + 1 < len(spans) and spans[j + 1].get("resume_from") == want:
            j += 1
        out.append(spans[j].get("attempt"))
        i = j + 1
    return out


def rate_series(segment: Sequence[Mapping[str, Any]], window: int | None = None) -> tuple[str, list[tuple[int, float]]]:
    """("tokens/s" or "steps/s", [(step, rate)]) over a sliding window of logged steps."""
    pts = trainer_clock(segment)
    if len(pts) >= 2:
        w = window or max(1, len(pts) // 30)
        return "tokens/s", [
            (pts[i][0], (pts[i][2] - pts[i - w][2]) / (pts[i][1] - pts[i - w][1]))
            for i in range(w, len(pts))
            if pts[i][1] > pts[i - w][1]
        ]
    first = int(segment[0]["current_steps"]) - 1 if segment else 0
    out = []
    for r in segment:
        c = _clock_seconds(r.get("elapsed_time"))
        if c:
            out.append((int(r["current_steps"]), (int(r["current_steps"]) - first) / c))
    return "steps/s", out


def recent_rates(records: Sequence[Mapping[str, Any]], window: int = 20) -> dict[str, float | None]:
    """{steps_per_second, tokens_per_second} over the last ``window`` logged steps of the current
    attempt, from the trainer clock. For `status`: llamafactory's own ``throughput`` field divides
    the token count restored from a checkpoint by this attempt's time, so it is too high after a
    resume; differences within one attempt are not."""
    segments = split_attempts(records)
    pts = trainer_clock(segments[-1]) if segments else []
    if len(pts) < 2:
        return {"steps_per_second": None, "tokens_per_second": None}
    a, b = pts[max(0, len(pts) - 1 - window)], pts[-1]
    dt = b[1] - a[1]
    if dt <= 0:
        return {"steps_per_second": None, "tokens_per_second": None}
    tokens = (b[2] - a[2]) / dt if a[2] is not None and b[2] is not None else None
    return {"steps_per_second": (b[0] - a[0]) / dt, "tokens_per_second": tokens}


def _parse_t(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def attempt_spans(events: Sequence[Mapping[str, Any]], now: float | None = None) -> list[dict[str, Any]]:
    """Each attempt of a run from its events.jsonl: attempt, start, end, resume_from (step of the
    checkpoint it resumed from).

    An attempt with no `exited` event (its supervisor died: a lost run, a reboot) ends where the next
    attempt starts; the last one ends at `now` (the present for a live run, the last sign of life for
    a lost one), or stays open (None) when `now` is None."""
    spans: list[dict[str, Any]] = []
    for e in events:
        t = _parse_t(e.get("t"))
        if e.get("event") == "attempt_started":
            if spans and spans[-1]["end"] is None and t is not None:
                spans[-1]["end"] = t
            rf = e.get("resume_from")
            step = int(str(rf).rsplit("-", 1)[-1]) if rf and str(rf).rsplit("-", 1)[-1].isdigit() else None
            spans.append({"attempt": e.get("attempt"), "start": t, "end": None, "resume_from": step})
        elif e.get("event") == "exited" and spans and spans[-1]["end"] is None:
            spans[-1]["end"] = t
    if now is not None and spans and spans[-1]["end"] is None:
        spans[-1]["end"] = max(now, spans[-1]["start"] or now)
    return spans


def busy_seconds(spans: Sequence[Mapping[str, Any]]) -> float:
    """Wall seconds the run held its GPUs: the sum of its attempts (gaps between them excluded)."""
    return sum(max(0.0, s["end"] - s["start"]) for s in spans if s.get("start") is not None and s.get("end"))
