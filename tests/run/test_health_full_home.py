"""Numeric health writes through the supervisor's journal (issue 31 item 1, the part left in
run/rollback.py): when the run folder refuses every write (ENOSPC), the verdict, the halt and the
trainer are kept; only the records are lost, counted once like the journal's own."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from ftlaunch.run import rollback, transitions
from ftlaunch.run.journal import RunJournal
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import write_state


def _refuse(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "events.jsonl")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "20260101-000000-abcd"
    run_dir.mkdir(parents=True)
    write_state(run_dir, RunState(id=run_dir.name, status=RunStatus.RUNNING))
    return run_dir


def test_a_divergence_halts_the_trainer_though_no_record_of_it_can_be_written(run_dir, tmp_path, monkeypatch):
    journal = RunJournal(run_dir)
    values = {"learning_rate": 1e-3, "output_dir": str(tmp_path / "out")}
    watch = rollback.HealthWatch(run_dir, values, {}, lambda _text: None, journal.write)
    monkeypatch.setattr(transitions, "update_state", _refuse)  # the journal's writers
    monkeypatch.setattr(transitions, "append_event", _refuse)
    watch.start()  # its state write fails: counted, not raised
    assert not watch.feed([{"current_steps": 1, "loss": 2.0}])
    assert watch.feed([{"current_steps": 2, "loss": float("nan")}]) and watch.halt
    assert watch.verdict.diverged and watch.verdict.first_bad.step == 2
    assert journal.unwritten.reason is not None and "No space left on device" in journal.unwritten.reason


def test_without_the_journal_a_refused_write_still_raises(run_dir, tmp_path, monkeypatch):
    """The default writer is the plain one (tests and tools that want the error see it)."""
    watch = rollback.HealthWatch(run_dir, {"output_dir": str(tmp_path / "out")}, {}, lambda _text: None)
    monkeypatch.setattr(transitions, "update_state", _refuse)  # the journal's writers
    with pytest.raises(OSError):
        watch.start()
