"""A run's own trainer records: ``<run_dir>/trainer_records.jsonl``, written as the trainer logs.

The trainer's ``<output_dir>/trainer_log.jsonl`` is appended to by every run and attempt that uses the
output_dir (``--fresh``, runs sharing it, rollbacks, resumes), so it cannot say whose steps are whose.
The supervisor therefore copies each attempt's new lines here as it reads them, after one marker line
per attempt: ``{"ftlaunch_attempt": N, "resume_from": "checkpoint-K" | null, "t": ISO time}``. ``plot``
reads this file; the parse (``attempts_of``) is pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftlaunch.run.progress import parse_trainer_log
from ftlaunch.run.store import RunFolder

if TYPE_CHECKING:
    from ftlaunch.run.journal import Unwritten

MARK = "ftlaunch_attempt"


@dataclass(frozen=True)
class AttemptRecords:
    attempt: int
    resume_step: int  # the step of the checkpoint it resumed from; 0: from the start
    records: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    t: str | None = None


def mark_attempt(run_dir: Path, attempt: int, resume_from: str | None, unwritten: Unwritten | None = None) -> None:
    """The marker line before an attempt's records (best effort: a full run folder loses only this)."""
    line = {MARK: attempt, "resume_from": resume_from, "t": datetime.now(UTC).isoformat(timespec="seconds")}
    keep(run_dir, (json.dumps(line) + "\n").encode(), unwritten)


def keep(run_dir: Path, raw: bytes, unwritten: Unwritten | None = None) -> None:
    """Append the trainer's lines as read (complete lines only: ftlaunch.run.tail). Best effort: lines
    a full or failing run folder refuses are lost, counted in ``unwritten`` (the supervisor's journal
    says them once there is room), never raised."""
    if not raw:
        return
    path = RunFolder(run_dir).records
    try:
        with open(path, "ab") as f:
            f.write(raw)
    except OSError as exc:
        if unwritten is not None:
            unwritten.failed(exc, path, records=max(1, raw.count(b"\n")))


def _step_of(name: Any) -> int:
    tail = str(name or "").rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def attempts_of(text: str | bytes) -> list[AttemptRecords]:
    """The attempts of a run's records file, each with its own records (markers included for
    attempts that logged nothing). Lines before the first marker are not this run's."""
    raw = text.decode(errors="replace") if isinstance(text, bytes) else text
    out: list[AttemptRecords] = []
    pending: list[str] = []

    def flush() -> None:
        if out and pending:
            last = out[-1]
            out[-1] = AttemptRecords(last.attempt, last.resume_step, tuple(parse_trainer_log("".join(pending))), last.t)
        pending.clear()

    for line in raw.splitlines(keepends=True):
        if f'"{MARK}"' in line:
            try:
                mark = json.loads(line)
            except ValueError:
                mark = None
            if isinstance(mark, dict) and isinstance(mark.get(MARK), int):
                flush()
                out.append(AttemptRecords(mark[MARK], _step_of(mark.get("resume_from")), (), mark.get("t")))
                continue
        pending.append(line)
    flush()
    return out


def read_attempts(run_dir: Path) -> list[AttemptRecords] | None:
    """This run's attempts and records; None when it kept none (a run from before this file)."""
    try:
        return attempts_of(RunFolder(run_dir).records.read_bytes())
    except OSError:
        return None
