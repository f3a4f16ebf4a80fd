"""A run's training history as `ftlaunch plot` draws it: its own logged steps, one segment per attempt,
and a marker where every attempt began.

A run's history is its own: the supervisor keeps each attempt's trainer records in the run folder as
they are written (ftlaunch.run.records), so a later run in the same output_dir (``--fresh``, two runs
sharing it) or a rollback never mixes into an old run's picture. A run from before that file, or an
output_dir given directly, is read from ``<output_dir>/trainer_log.jsonl`` and split at restarts
(ftlaunch.run.accounting), and the title says whose steps those may be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlaunch.errors import FtlaunchError
from ftlaunch.run import accounting as acc
from ftlaunch.run.progress import parse_trainer_log
from ftlaunch.run.records import read_attempts
from ftlaunch.run.store import RunFolder, read_events, read_state
from ftlaunch.run.view import find_run

TRAINER_LOG = "trainer_log.jsonl"


@dataclass(frozen=True)
class Marker:
    """Where an attempt began: its number (None: a restart seen in a shared trainer log) and step."""

    attempt: int | None
    step: int
    why: str = ""  # what started it: a rollback, an OOM retry, ...


@dataclass(frozen=True)
class TrainingHistory:
    """One segment of logged steps per attempt that logged any, the attempt that wrote each (None:
    a segment of an output_dir's shared log), a marker per attempt, a title, and where its picture goes."""

    segments: Sequence[Sequence[Mapping[str, Any]]]
    attempts: Sequence[int | None]
    title: str
    default_out: Path
    markers: Sequence[Marker] = field(default_factory=tuple)


def _why(events: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """What ended each attempt, so that the next one's marker can say why it began."""
    out: dict[int, str] = {}
    current = None
    for e in events:
        kind = e.get("event")
        if kind == "attempt_started":
            current = e.get("attempt")
        elif current is not None and kind == "rolled_back":
            out[current + 1] = "rollback"
        elif current is not None and kind == "exited" and (current + 1) not in out:
            out[current + 1] = str(e.get("kind") or e.get("failure_kind") or "restart")
    return out


def training_history(ref: str | None, env: Mapping[str, str]) -> TrainingHistory:
    """The history of run `ref` (id, prefix or name; None: the latest), or of an output_dir that
    holds a trainer_log.jsonl. Raises FtlaunchError while nothing is logged yet."""
    if ref and Path(ref).is_dir() and (Path(ref) / TRAINER_LOG).is_file():
        return _from_output_dir(Path(ref), str(ref), Path(ref) / "ftlaunch-progress.png")
    run_dir = find_run(env, ref)
    state = read_state(run_dir)
    title = f"run {run_dir.name} ({state.name})"
    own = read_attempts(run_dir)
    if own is None:  # a run from before each run kept its records: the output_dir's log, said so
        out = Path(state.output_dir or "")
        return _from_output_dir(
            out,
            f"{title}, from {out / TRAINER_LOG} (may hold other runs' steps)",
            RunFolder(run_dir).progress_png,
            read_events(run_dir),
        )
    why = _why(read_events(run_dir))
    segments, attempts, markers = [], [], []
    for a in own:
        steps = [r for r in a.records if r.get("loss") is not None]
        markers.append(Marker(a.attempt, a.resume_step, why.get(a.attempt, "start" if a.attempt == 1 else "")))
        if steps:
            segments.append(steps)
            attempts.append(a.attempt)
    if not segments:
        raise FtlaunchError(
            f"run {run_dir.name} has no logged training steps yet",
            hint="the trainer logs from its first logging step (logging_steps)",
        )
    return TrainingHistory(segments, attempts, title, RunFolder(run_dir).progress_png, tuple(markers))


def _from_output_dir(
    output_dir: Path, title: str, default_out: Path, events: Sequence[Mapping[str, Any]] = ()
) -> TrainingHistory:
    tlog = output_dir / TRAINER_LOG
    if not tlog.is_file():
        raise FtlaunchError(f"no {tlog} yet", hint="the trainer writes it from its first logged step (logging_steps)")
    segments = acc.split_attempts(parse_trainer_log(tlog.read_text(errors="replace")))
    if not segments:
        raise FtlaunchError(f"{tlog} has no logged training steps yet")
    # which attempt of the run wrote a segment, where its events can tell (None: not this run's, or unknown)
    attempts = acc.segment_attempts(segments, acc.attempt_spans(events)) if events else [None] * len(segments)
    markers = tuple(Marker(a, max(0, int(s[0]["current_steps"]) - 1)) for a, s in zip(attempts, segments, strict=True))
    return TrainingHistory(segments, attempts, title, default_out, markers)
