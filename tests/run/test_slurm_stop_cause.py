"""Issue 31: a Slurm requeue or a scancel from outside ftlaunch is never journaled as a user's stop. The
batch step (ftlaunch.run.slurm.job) forwards `ftlaunch stop`'s SIGTERM as SIGTERM and Slurm's own as
SIGUSR2; the supervisor journals the latter as Slurm's (no "stopped by the user", no "stopped"
notification) and the batch step then records what it was. The batch step runs here in-process with
the real supervisor as its child and tests/fake_trainer.py as the trainer; no Slurm command is on PATH,
so Slurm cannot say what ended the job: `lost`, "ended by Slurm (state unknown)"."""

from __future__ import annotations

import os
import signal
import threading
import time

from ftlaunch.run.recovery import SLURM_STOP, Exit, for_slurm
from ftlaunch.run.slurm import job
from ftlaunch.run.state import FailureKind, RunStatus
from ftlaunch.run.store import append_event, read_events, read_state

from .test_recovery import make_run


def test_the_batch_step_forwards_a_users_stop_as_sigterm_and_slurms_as_sigusr2():
    asked = [{"event": "stop_requested", "job_id": "42"}]
    assert job.signal_for_supervisor(asked, "42") == signal.SIGTERM
    assert job.signal_for_supervisor(asked, "43") == signal.SIGUSR2  # another job's stop
    assert job.signal_for_supervisor([], "42") == signal.SIGUSR2


def test_a_stop_slurm_asked_for_is_slurms():
    stopped = Exit(FailureKind.STOPPED, "stopped by the user")
    assert for_slurm(stopped, signal.SIGUSR2) == Exit(FailureKind.STOPPED, SLURM_STOP)
    assert for_slurm(stopped, signal.SIGTERM) is stopped
    crash = Exit(FailureKind.CRASH, "boom")
    assert for_slurm(crash, signal.SIGUSR2) is crash


def _batch_step(tmp_path, monkeypatch, user_stop: bool):
    run_dir, env = make_run(tmp_path, [{"sleep": 60}])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    if user_stop:
        append_event(run_dir, "stop_requested", job_id="42", slurm_state="RUNNING")

    def signal_once_running() -> None:  # what Slurm does to the batch step: SIGTERM
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if read_state(run_dir).trainer_pid:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.1)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    killer = threading.Thread(target=signal_once_running, daemon=True)
    killer.start()
    try:
        code = job.main([str(run_dir)], poll=0.05)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    killer.join(5)
    return run_dir, code


def test_slurms_sigterm_is_never_journaled_as_a_users_stop(tmp_path, monkeypatch):
    run_dir, _code = _batch_step(tmp_path, monkeypatch, user_stop=False)
    events = read_events(run_dir)
    said = " ".join(str(e.get("message", "")) for e in events) + " " + str(read_state(run_dir).message)
    assert "stopped by the user" not in said, [(e["event"], e.get("message")) for e in events]
    ended = [e for e in events if e["event"] == "stopped"]  # the supervisor's end, as it journaled it
    assert ended and ended[-1].get("message") == SLURM_STOP, ended
    assert [e["by"] for e in events if e["event"] == "slurm_signal"] == ["slurm"]
    st = read_state(run_dir)
    assert st.status is RunStatus.LOST and "not by `ftlaunch stop`" in (st.message or "")
    assert "ended_by_slurm" in [e["event"] for e in events]


def test_ftlaunch_stop_is_still_the_users_stop(tmp_path, monkeypatch):
    run_dir, _code = _batch_step(tmp_path, monkeypatch, user_stop=True)
    events = read_events(run_dir)
    assert [e["by"] for e in events if e["event"] == "slurm_signal"] == ["ftlaunch stop"]
    st = read_state(run_dir)
    assert st.status is RunStatus.STOPPED and "by the user" in (st.message or "")
    assert "ended_by_slurm" not in [e["event"] for e in events]
