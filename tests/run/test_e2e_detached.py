"""Detached, supervised runs with real processes and signals and the real llamafactory-cli."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ..conftest import ROOT, child_env, tiny_config, venv_bin, write_yaml
from ..helpers import said

pytestmark = pytest.mark.e2e
INJECT = str(ROOT / "tests" / "inject")


def ftl(*args, env=None, timeout=120):
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env or child_env(), capture_output=True, text=True, timeout=timeout
    )


def status(run_id: str, env=None) -> dict:
    r = ftl("status", run_id, "--json", env=env)
    return json.loads(r.stdout)


def wait_for(pred, timeout=180.0, poll=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError("timed out waiting")


def slow_env(sleep="0.25", **extra) -> dict:
    return child_env(PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP=sleep, **extra)


def trainer_steps(out: Path) -> list[int]:
    lines = (out / "trainer_log.jsonl").read_text().splitlines()
    return [json.loads(x)["current_steps"] for x in lines if '"loss"' in x]


def test_run_survives_the_starting_sessions_sighup(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=12, save_steps=4))
    idfile = tmp_path / "id.json"
    # A whole "SSH session": its own session and process group, then hung up like a dropped connection.
    # SIGHUP as a login shell has it (default): a suite started under nohup ignores it, and an ignored
    # signal is inherited, so the hang-up would end nothing (the shell outlived it, a CI run saw).
    shell = subprocess.Popen(
        ["bash", "-c", f"{venv_bin() / 'ftlaunch'} train {cfg} --json > {idfile}; sleep 300"],
        env=slow_env(),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    run = wait_for(lambda: idfile.exists() and idfile.read_text().strip() and json.loads(idfile.read_text()))
    assert Path(run["run_dir"]).is_dir()
    wait_for(lambda: status(run["id"])["status"] == "running")
    os.killpg(shell.pid, signal.SIGHUP)
    shell.wait(timeout=10)
    final = wait_for(lambda: (s := status(run["id"]))["status"] in ("succeeded", "failed", "lost") and s)
    assert final["status"] == "succeeded", final
    assert final["step"] == final["total_steps"] == 12


def test_sigkill_everything_then_resume_continues_from_checkpoint(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=16, save_steps=4))
    r = ftl("train", str(cfg), "--json", env=slow_env())
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)
    wait_for(lambda: (out / "checkpoint-8").is_dir() and (out / "checkpoint-8" / "trainer_state.json").exists())
    st = json.loads((Path(run["run_dir"]) / "state.json").read_text())
    # A reboot, in effect: both die at once, nothing is recorded.
    for pid in (st["pid"], st["trainer_pid"]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: status(run["id"])["status"] == "lost", timeout=20)
    r2 = ftl("resume", run["id"], env=slow_env())
    assert r2.returncode == 0 and "restarted" in r2.stdout, r2.stdout + r2.stderr
    final = wait_for(lambda: (s := status(run["id"]))["status"] in ("succeeded", "failed") and s)
    assert final["status"] == "succeeded", final
    assert final["attempt"] == 1 or final["attempt"] >= 1
    log = (Path(run["run_dir"]) / "train.log").read_text()
    assert "Resuming training from" in log and "checkpoint-" in log
    steps = trainer_steps(out)
    assert steps[-1] == 16
    # continuous: every step 1..16 logged, those after the last checkpoint possibly twice
    assert sorted(set(steps)) == list(range(1, 17))
    events = [json.loads(x)["event"] for x in (Path(run["run_dir"]) / "events.jsonl").read_text().splitlines()]
    assert "resumed" in events and events.count("attempt_started") >= 2


def test_stop_leaves_no_process_and_resume_finishes(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=12, save_steps=4))
    run = json.loads(ftl("train", str(cfg), "--json", "--name", "stopme", env=slow_env()).stdout)
    wait_for(lambda: (status("stopme").get("step") or 0) >= 5)
    st = json.loads((Path(run["run_dir"]) / "state.json").read_text())
    r = ftl("stop", "stopme")
    assert r.returncode == 0, r.stderr
    for pid in (st["pid"], st["trainer_pid"]):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    s = status("stopme")
    assert s["status"] == "stopped"
    assert (out / "checkpoint-4").is_dir()  # the last checkpoint stays
    assert ftl("status", "stopme").returncode == 1
    r2 = ftl("resume", "stopme", "--foreground", env=slow_env("0"))
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert status("stopme")["status"] == "succeeded"
    r3 = ftl("resume", "stopme")
    assert "already succeeded" in r3.stdout


def test_second_run_on_same_output_dir_is_refused(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=8))
    run = json.loads(ftl("train", str(cfg), "--json", env=slow_env()).stdout)
    wait_for(lambda: status(run["id"])["status"] == "running")
    r = ftl("train", str(cfg), "--json", env=slow_env())
    assert r.returncode == 7 and said("in use", r.stderr)
    ftl("stop", run["id"])


def test_corrupt_state_is_a_clear_error_and_still_resumable(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=8, save_steps=4))
    r = ftl("train", str(cfg), "--foreground", "--json", env=slow_env("0"))
    run = json.loads(r.stdout)
    (Path(run["run_dir"]) / "state.json").write_text("{ torn")
    bad = ftl("status", run["id"])
    assert bad.returncode == 12 and "unreadable" in bad.stderr and "Traceback" not in bad.stderr
    rs = ftl("runs", "--json")
    assert json.loads(rs.stdout)[0]["status"] == "unreadable"
    again = ftl("resume", run["id"], "--foreground")
    assert again.returncode == 0, again.stdout + again.stderr
    assert status(run["id"])["status"] == "succeeded"


def test_logs_and_runs(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=6))
    r = ftl("train", str(cfg), "--follow", env=slow_env("0.1"))
    assert r.returncode == 0
    assert said("started run", r.stdout) and "train_loss" in r.stdout  # --follow printed the trainer's log
    runs = json.loads(ftl("runs", "--json").stdout)
    assert runs[-1]["status"] == "succeeded" and runs[-1]["step"] == 6
    logs = ftl("logs")
    assert "ftlaunch attempt 1" in logs.stdout


def test_a_second_train_into_a_finished_output_dir_is_refused_and_fresh_trains_for_real(tiny, tmp_path):
    # Issue 13 case 1 with the real trainer: before, the second train auto-resumed the first run's
    # last checkpoint, trained nothing (train_runtime ~0) and said "succeeded".
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=4, save_steps=2))
    assert ftl("train", str(cfg), "--foreground", "--json").returncode == 0
    again = ftl("train", str(cfg), "--foreground", "--json")
    said = " ".join(again.stderr.split())
    assert again.returncode == 7 and "checkpoint-4" in said and "--fresh" in said, again.stderr
    fresh = ftl("train", str(cfg), "--foreground", "--json", "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("out.old-")]
    assert (aside / "checkpoint-4").is_dir() and trainer_steps(aside) == [1, 2, 3, 4]
    assert trainer_steps(out) == [1, 2, 3, 4]  # trained again from step 1, for real
