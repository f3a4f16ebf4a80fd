"""A run's training history as `ftlaunch plot` draws it: the trainer's logged steps split into
attempts, which attempt wrote each part, and the run's name and folder.

Reads a run (its state, events and the output_dir's trainer_log.jsonl) or an output_dir alone;
the splitting and matching are ftlaunch.run.accounting's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftlaunch.errors import FtlaunchError
from ftlaunch.run import accounting as acc
from ftlaunch.run.progress import parse_trainer_log
from ftlaunch.run.store import find_run, read_events, read_state

TRAINER_LOG = "trainer_log.jsonl"


@dataclass(frozen=True)
class TrainingHistory:
    """One segment of logged steps per attempt (restarts split them), the attempt that wrote each
    (None when the events cannot tell), a title, and where its picture goes by default."""

    segments: Sequence[Sequence[Mapping[str, Any]]]
    attempts: Sequence[int | None]
    title: str
    default_out: Path


def training_history(ref: str | None, env: Mapping[str, str]) -> TrainingHistory:
    """The history of run `ref` (id, prefix or name; None: the latest), or of an output_dir that
    holds a trainer_log.jsonl. Raises FtlaunchError while nothing is logged yet."""
    events: list[dict[str, Any]] = []
    if ref and Path(ref).is_dir() and (Path(ref) / TRAINER_LOG).is_file():
        output_dir = Path(ref)
        title = str(output_dir)
        default_out = output_dir / "ftlaunch-progress.png"
    else:
        run_dir = find_run(env, ref)
        state = read_state(run_dir)
        output_dir = Path(state.output_dir or "")
        events = read_events(run_dir)
        title = f"run {run_dir.name} ({state.name})"
        default_out = run_dir / "progress.png"
    tlog = output_dir / TRAINER_LOG
    if not tlog.is_file():
        raise FtlaunchError(f"no {tlog} yet", hint="the trainer writes it from its first logged step (logging_steps)")
    segments = acc.split_attempts(parse_trainer_log(tlog.read_text(errors="replace")))
    if not segments:
        raise FtlaunchError(f"{tlog} has no logged training steps yet")
    attempts = acc.segment_attempts(segments, acc.attempt_spans(events))
    return TrainingHistory(segments, attempts, title, default_out)
