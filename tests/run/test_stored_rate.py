"""`status` reads the recent tokens/s the supervisor stored (issue 32): the progress watch measures it
over the attempt's last logged steps and keeps it in ``state.progress``; `status` never parses
trainer_log.jsonl, however long it is."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ftlaunch.run import progress as prog
from ftlaunch.run.journal import RunJournal
from ftlaunch.run.procs import start_time
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import read_state, write_state
from ftlaunch.run.view import run_view
from ftlaunch.run.watch import Seen
from ftlaunch.run.watch.progress import ProgressWatch


def _step(step: int, seconds: float, tokens_per_step: int = 400) -> dict:
    tokens = step * tokens_per_step
    return {
        "current_steps": step,
        "total_steps": 100,
        "loss": 2.0,
        "total_tokens": tokens,
        "throughput": tokens / seconds,
    }


def test_the_progress_watch_stores_the_recent_tokens_per_second(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    write_state(run_dir, RunState(id="run", status=RunStatus.RUNNING))
    watch = ProgressWatch(RunJournal(run_dir), out, 1, None, prog.Progress(), None, lambda: 0.0, lambda: 1.0)
    lines = [json.dumps(_step(s, s * 2.0)) for s in range(1, 6)]  # 200 tokens/s by the trainer's clock
    (out / "trainer_log.jsonl").write_text("\n".join(lines) + "\n")
    watch.tick(Seen(rc=None, halting=False))
    progress = read_state(run_dir).progress
    assert progress and progress.step == 5 and progress.tokens_per_second == 200.0
    assert progress["tokens_per_second"] == 200.0  # in state.json, beside what Progress.to_dict() writes


def test_status_shows_the_stored_rate_without_reading_the_trainer_log(tmp_path):
    run_dir, out = tmp_path / "runs" / "R", tmp_path / "out"
    run_dir.mkdir(parents=True)
    out.mkdir()
    (run_dir / "events.jsonl").write_text("")
    (out / "trainer_log.jsonl").write_text("this is not read\n")
    pid = os.getpid()  # a live supervisor: the run is live
    progress = {"step": 5, "total_steps": 100, "tokens_per_second": 321.5}
    write_state(run_dir, RunState(id="R", status=RunStatus.RUNNING, pid=pid, pid_start=start_time(pid),
                                  output_dir=str(out), progress=progress))  # fmt: skip
    assert run_view(run_dir).cost.tokens_per_second == 321.5
    write_state(run_dir, read_state(run_dir).changed(progress={"step": 5}))  # a supervisor of before stored none
    assert run_view(run_dir).cost.tokens_per_second is None


def test_a_finished_run_shows_no_rate(tmp_path: Path):
    run_dir = tmp_path / "runs" / "R"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("")
    write_state(run_dir, RunState(id="R", status=RunStatus.SUCCEEDED, progress={"tokens_per_second": 9.0}))
    assert run_view(run_dir).cost.tokens_per_second is None
