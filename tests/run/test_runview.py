"""run/runview.py: what `status` shows, decided from a state and what the shell saw, with no run folder,
process or clock (the shell, run/view.run_view, is tested in test_view_typed.py)."""

from __future__ import annotations

from pathlib import Path

from ftlaunch.run.procs import Liveness
from ftlaunch.run.runview import Seen, local_status, view_of, wants_last_word
from ftlaunch.run.state import FailureKind, RunState, RunStatus

RUNNING = RunState(id="R1", status=RunStatus.RUNNING, pid=7, message="retrying...", steps_per_second=0.5,
                   progress={"step": 3, "total_steps": 9}, progress_at=100.0)  # fmt: skip


def test_liveness_decides_a_local_runs_status_failing_closed():
    assert local_status(RUNNING, Liveness.DEAD) is RunStatus.LOST
    assert local_status(RUNNING, Liveness.UNKNOWN) is RunStatus.RUNNING  # never lost on UNKNOWN
    done = RUNNING.changed(status=RunStatus.SUCCEEDED)
    assert local_status(done, Liveness.DEAD) is RunStatus.SUCCEEDED
    assert wants_last_word(RUNNING, RunStatus.LOST) and not wants_last_word(done, RunStatus.SUCCEEDED)
    assert not wants_last_word(RUNNING.changed(slurm_job_id="42"), RunStatus.LOST)


def test_a_running_view_counts_its_eta_from_the_time_asked():
    v = view_of(RUNNING, Path("/runs/R1"), Seen(RunStatus.RUNNING, supervisor_alive=Liveness.ALIVE), 104.0, 999.0)
    assert (v.status, v.eta_seconds, v.message, v.last_message) == (RunStatus.RUNNING, 8.0, "retrying...", None)
    assert v.stall.phase is None and v.supervisor_alive is Liveness.ALIVE


def test_a_lost_run_says_so_and_a_last_word_with_an_end_wins():
    lost = view_of(RUNNING, Path("/runs/R1"), Seen(RunStatus.LOST, supervisor_alive=Liveness.DEAD), None, 104.0)
    assert lost.status is RunStatus.LOST and lost.eta_seconds is None
    assert lost.message.startswith("lost:") and lost.last_message == "retrying..."
    word = {"status": "failed", "message": "crashed", "exit_code": 1, "failure_kind": "crash", "cause": "x"}
    ended = view_of(RUNNING, Path("/runs/R1"), Seen(RunStatus.LOST, last_word=word), None, 104.0)
    assert (ended.status, ended.message, ended.exit_code) == (RunStatus.FAILED, "crashed", 1)
    assert ended.failure_kind is FailureKind.CRASH and ended.last_word == {"cause": "x", "status": "failed",
                                                                           "exit_code": 1}  # fmt: skip
