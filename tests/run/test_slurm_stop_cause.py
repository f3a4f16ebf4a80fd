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


# ---------------------------------------------------------------- the stall dump in a Slurm job


def _proc(root, pid: int, env: dict[str, str], argv: list[str]) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_the_stall_dump_finds_the_ranks_srun_started_not_the_batch_steps_own(tmp_path):
    """Issue 31: srun's ranks are slurmstepd's children, not the trainer's: found by the job's
    environment (SLURM_JOB_ID and a SLURM_STEP_ID), Python only, the supervisor's own line skipped."""
    from ftlaunch.run.stacks import slurm_task_pids

    proc = tmp_path / "proc"
    job = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}
    _proc(proc, 100, job, ["srun", "--nodes=2"])  # the trainer: srun-trainer.sh exec'd srun
    _proc(proc, 50, {**job}, ["/venv/bin/python", "-m", "ftlaunch.run.supervisor"])  # batch step: no step id
    _proc(proc, 51, {**job, "SLURM_STEP_ID": "batch"}, ["/venv/bin/python", "-m", "ftlaunch.run.slurm.job"])
    _proc(proc, 200, {**job, "SLURM_STEP_ID": "1"}, ["/venv/bin/python", "/venv/bin/torchrun"])
    _proc(proc, 201, {**job, "SLURM_STEP_ID": "1", "RANK": "0"}, ["/venv/bin/python3.11", "launcher.py"])
    _proc(proc, 202, {**job, "SLURM_STEP_ID": "1"}, ["bash", "-c", "exec trainer"])  # not Python
    _proc(proc, 300, {"SLURM_JOB_ID": "8", "SLURM_STEP_ID": "0"}, ["/venv/bin/python", "x.py"])  # another job
    pids, note = slurm_task_pids(100, skip={51}, proc=proc)
    assert pids == [200, 201]
    assert "Slurm job 7" in note and "another of its 2 nodes" in note
    assert slurm_task_pids(300, skip=set(), proc=proc)[1] == ""  # a job of one node: nothing unseen
    _proc(proc, 400, {"PATH": "/bin"}, ["python"])  # not in a Slurm job
    assert slurm_task_pids(400, skip=set(), proc=proc) == ([], "")
