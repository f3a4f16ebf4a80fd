"""Orphans (issue 20): a kill -9 of the supervisor leaves its trainer alive and drops the output_dir
lock; `train` of the same config must then never start a second trainer beside it (exit 7, naming
the run and the pid), `stop` ends the orphan directly, and `resume` ends it, waits until its process
group is gone, then restarts the run.

Real processes: the supervisor is detached, the trainer is tests/fake_trainer.py kept alive with
{"sleep": N}. FTLAUNCH_ORPHAN_ITERATIONS sets the loop count (3 in the suite).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ftlaunch.errors import BusyError
from ftlaunch.run.orphans import (
    LiveTrainer,
    TrainerAlive,
    group_verdict,
    live_trainers,
    recorded_trainer,
    refuse_if_alive,
    stop_trainer,
)
from ftlaunch.run.procs import Liveness, start_time
from ftlaunch.run.state import RunState, RunStatus

from ..fake_trainer import install
from .test_races import setup, state, stop, wait_for

ITERATIONS = int(os.environ.get("FTLAUNCH_ORPHAN_ITERATIONS", "3"))
FAKE = str(Path(__file__).resolve().parent.parent / "fake_trainer.py")


@pytest.fixture(autouse=True)
def leave_nothing_running(tmp_path):
    """A failed test kills what it started: every process whose command line names its tmp_path."""
    yield
    mine = [p for p in psutil.process_iter(["cmdline"]) if any(str(tmp_path) in a for a in p.info["cmdline"] or [])]
    for p in sorted(mine, key=lambda p: "ftlaunch.run.supervisor" not in (p.info["cmdline"] or [])):
        try:
            p.kill()  # supervisors first: they would restart a killed trainer
        except psutil.Error:
            pass


def trainers(tmp_path: Path) -> list[int]:
    """Live trainer processes of this test: the fake trainer's command line with a config of its home."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and FAKE in cmd and "train" in cmd and str(tmp_path) in cmd[-1]:
            found.append(p.pid)
    return found


def workers(tmp_path: Path) -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [])[-1:] == [f"orphan-worker={tmp_path}"]
    ]


def ftl(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftlaunch", *args], env=env, capture_output=True, text=True, timeout=120
    )


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_then_kill_supervisor(tmp_path: Path, cfg: Path, env: dict) -> tuple[Path, int]:
    """A detached run whose trainer is up; then kill -9 of its supervisor. (run_dir, trainer pid)"""
    r = ftl(env, "train", str(cfg), "--gpu", "A10G", "--json")
    assert r.returncode == 0, r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    trainer = wait_for(lambda: state(run_dir).get("trainer_pid"))
    # Once it has printed: a write to the pipe of a dead supervisor would end it (BrokenPipeError).
    wait_for(lambda: "fake trainer attempt 1" in (run_dir / "train.log").read_text())
    wait_for(lambda: trainer in trainers(tmp_path))
    supervisor = state(run_dir)["pid"]
    os.kill(supervisor, signal.SIGKILL)
    wait_for(lambda: gone(supervisor))
    return run_dir, trainer


def refused(r: subprocess.CompletedProcess, run_dir: Path, pid: int) -> None:
    said = " ".join(r.stderr.split())
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert run_dir.name in said and str(pid) in said and f"ftlaunch stop {run_dir.name}" in said, said
    assert "Traceback" not in said


@pytest.mark.parametrize("i", range(ITERATIONS))
def test_kill_9_of_the_supervisor_then_train_never_starts_a_second_trainer(tmp_path, i):
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    run_dir, orphan = start_then_kill_supervisor(tmp_path, cfg, env)
    for _ in range(2):  # a second try is refused the same way: nothing was left half-claimed
        refused(ftl(env, "train", str(cfg), "--gpu", "A10G"), run_dir, orphan)
        assert trainers(tmp_path) == [orphan]
    assert len(list((tmp_path / "home" / "runs").iterdir())) == 1  # the refused trains created no run

    r = stop(run_dir, env)  # the supervisor is gone: stop ends the orphan's process group itself
    assert r.returncode == 0 and "stopped" in r.stdout, (r.stdout, r.stderr)
    assert trainers(tmp_path) == [] and state(run_dir)["status"] == "stopped"
    events = [json.loads(x)["event"] for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "orphan_stopped" in events

    r = ftl(env, "train", str(cfg), "--gpu", "A10G", "--json")  # nothing left: a new run starts
    assert r.returncode == 0, r.stderr
    again = Path(json.loads(r.stdout)["run_dir"])
    wait_for(lambda: len(trainers(tmp_path)) == 1)
    assert stop(again, env).returncode == 0 and trainers(tmp_path) == []


def with_worker(tmp_path: Path, env: dict) -> dict:
    """A trainer that starts a worker in its process group first (as torchrun does), then runs the
    fake trainer in the same process (exec): the worker can outlive it."""
    install(tmp_path)
    wrapper = tmp_path / "cli-with-worker"
    worker = f"{sys.executable} -c 'import time; time.sleep(120)' orphan-worker={tmp_path}"
    wrapper.write_text(f'#!/bin/sh\n{worker} &\nexec {sys.executable} {FAKE} "$@"\n')
    wrapper.chmod(0o755)
    return {**env, "FTLAUNCH_LLAMAFACTORY_CLI": str(wrapper)}


def test_a_worker_that_outlives_the_trainer_keeps_the_output_dir_busy_until_stop(tmp_path):
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    env = with_worker(tmp_path, env)
    run_dir, leader = start_then_kill_supervisor(tmp_path, cfg, env)
    worker = wait_for(lambda: workers(tmp_path))[0]
    assert os.getpgid(worker) == leader
    os.kill(leader, signal.SIGKILL)  # the trainer dies, its worker lives on in the trainer's group
    wait_for(lambda: gone(leader))
    r = ftl(env, "train", str(cfg), "--gpu", "A10G")
    refused(r, run_dir, worker)
    assert "its group lives on" in " ".join(r.stderr.split())
    assert stop(run_dir, env).returncode == 0
    assert workers(tmp_path) == [] and trainers(tmp_path) == []


def test_resume_ends_the_orphan_and_its_group_first_then_restarts_once(tmp_path):
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    env = with_worker(tmp_path, env)
    run_dir, orphan = start_then_kill_supervisor(tmp_path, cfg, env)
    old_worker = wait_for(lambda: workers(tmp_path))[0]
    r = ftl(env, "resume", run_dir.name, "--no-follow")
    assert r.returncode == 0 and "restarted" in r.stdout, (r.stdout, r.stderr)
    assert gone(orphan) and gone(old_worker)
    new = wait_for(lambda: [p for p in trainers(tmp_path) if p != orphan])
    assert trainers(tmp_path) == new and len(new) == 1
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stopped = [e for e in events if e["event"] == "orphan_stopped"]
    assert len(stopped) == 1 and stopped[0]["pgid"] == orphan and old_worker in stopped[0]["pids"]
    assert stop(run_dir, env).returncode == 0 and trainers(tmp_path) == [] and workers(tmp_path) == []


# ---------------------------------------------------------------- the finder, in-process


def test_group_verdict_fails_closed_and_a_reused_pid_is_not_the_trainer():
    assert group_verdict(Liveness.ALIVE, False, ()) is Liveness.ALIVE
    assert group_verdict(Liveness.UNKNOWN, False, ()) is Liveness.UNKNOWN
    assert group_verdict(Liveness.DEAD, False, (12,)) is Liveness.ALIVE  # workers outlive the leader
    assert group_verdict(Liveness.DEAD, False, ()) is Liveness.DEAD
    assert group_verdict(Liveness.DEAD, True, (12,)) is Liveness.DEAD  # that group id is another's now


def run_state(tmp_path: Path, **fields) -> tuple[Path, RunState]:
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    return run_dir, RunState(id="r1", name="r1", status=RunStatus.RUNNING, output_dir=str(tmp_path / "out"), **fields)


def test_a_recorded_pid_is_checked_by_its_start_time(tmp_path):
    me, started = os.getpid(), start_time(os.getpid())
    _, st = run_state(tmp_path, trainer_pid=me, trainer_start=started)
    found = recorded_trainer("r1", st)
    assert found is not None and found.verdict is Liveness.ALIVE and found.pids[0] == me
    later = RunState.from_json({**st.to_json(), "trainer_start": started - 100})  # the pid was reused
    assert recorded_trainer("r1", later) is None
    unknown = RunState.from_json({**st.to_json(), "trainer_start": None})
    found = recorded_trainer("r1", unknown)
    assert found is not None and found.verdict is Liveness.UNKNOWN
    with pytest.raises(TrainerAlive) as exc:
        refuse_if_alive(str(tmp_path / "out"), [(tmp_path / "runs" / "r1", unknown)])
    assert exc.value.exit_code == BusyError.exit_code and "may still be alive" in exc.value.message
    assert "kill -TERM -- -" in (exc.value.hint or "")
    assert not stop_trainer(found)  # never signalled on UNKNOWN


def test_a_trainer_whose_pid_was_never_recorded_is_found_by_its_command_line(tmp_path):
    run_dir, st = run_state(tmp_path)  # no trainer_pid: the supervisor died before writing it
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", "train", str(run_dir / "config.yaml")]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_for(lambda: (psutil.Process(proc.pid).cmdline() or [""])[-1] == cmd[-1])
        [found] = live_trainers([(run_dir, st)])
        assert found == LiveTrainer("r1", proc.pid, (proc.pid,), Liveness.ALIVE, "found by its command line")
        assert stop_trainer(found, grace=5)
        assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert live_trainers([(run_dir, st)]) == []


def test_finding_costs_little(tmp_path):
    run_dir, st = run_state(tmp_path)
    t0 = time.perf_counter()
    for _ in range(5):
        live_trainers([(run_dir, st)])
    assert (time.perf_counter() - t0) / 5 < 0.5


def test_schedule_run_never_starts_a_trainer_beside_the_orphan_of_its_last_run(tmp_path):
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    r = ftl(env, "schedule", "add", "nightly", str(cfg), "--cron", "0 2 * * *", "--gpu", "A10G", "--print")
    assert r.returncode == 0, r.stderr
    first = subprocess.Popen(  # foreground: this process is the run's supervisor
        [sys.executable, "-m", "ftlaunch", "schedule", "run", "nightly"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        runs = tmp_path / "home" / "runs"
        # a run folder is written as .ID.tmp and renamed: wait for the real one
        run_dir = wait_for(
            lambda: next((p for p in runs.iterdir() if not p.name.startswith(".")), None) if runs.is_dir() else None
        )
        orphan = wait_for(lambda: (run_dir / "state.json").exists() and state(run_dir).get("trainer_pid"))
        wait_for(lambda: "fake trainer attempt 1" in (run_dir / "train.log").read_text())
        first.kill()  # kill -9 of `schedule run`, its trainer training on
        first.wait()
        r = ftl(env, "schedule", "run", "nightly")  # a new version dir: the output_dir lock is free
        refused(r, run_dir, orphan)
        assert trainers(tmp_path) == [orphan] and len(list(runs.iterdir())) == 1
        history = json.loads((tmp_path / "home" / "schedules" / "nightly.json").read_text())["history"]
        assert history[-1]["status"] == "skipped" and history[-1]["reason"] == "overlap"
        assert stop(run_dir, env).returncode == 0 and trainers(tmp_path) == []
    finally:
        first.kill()
        first.wait()
