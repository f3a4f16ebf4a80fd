"""Issue 40 item 2 on a real Ray head: a job runs its entrypoint in the folder its head was started in
(Ray's choice, not ftlaunch's). A head started in a folder holding ``ftlaunch/`` made every attempt
after the first die at import (`python -m ftlaunch resume`: no_progress in 7 s, "exit code 1"). With
``-P`` (run/procs.python_module) the driver killed mid-run is resubmitted, and the second attempt
imports the real package, ends the orphaned trainer and finishes the run.

The trainer is tests/fake_trainer.py behind a wrapper that carries its script (a job's environment
carries only what a trainer reads, FTLAUNCH_* among it, not the stand-in's own variables).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from ..fake_trainer import write_config
from ..helpers import wait_for
from ..run.test_cwd_shadow import shadow_folder
from .conftest import RAY_MISSING, start_head
from .test_e2e_ray import events, ftl, state

pytestmark = pytest.mark.ray
FAKE = Path(__file__).resolve().parent.parent / "fake_trainer.py"


def wrapper(folder: Path, script: list[dict]) -> Path:
    w = folder / "llamafactory-cli"
    w.write_text(
        "#!/bin/sh\n"
        f"export FAKE_TRAINER_SCRIPT='{json.dumps(script)}' FAKE_TRAINER_COUNTER={folder / 'counter'}\n"
        f'exec {sys.executable} {FAKE} "$@"\n'
    )
    w.chmod(0o755)
    return w


@pytest.fixture
def shadowed_head(tmp_path, monkeypatch):
    """A head started in a folder holding ``ftlaunch/``: its jobs' entrypoints run there."""
    if RAY_MISSING:
        pytest.skip(RAY_MISSING)
    cwd = shadow_folder(tmp_path)
    monkeypatch.chdir(cwd)
    head = start_head(num_cpus=2)
    try:
        yield head, cwd
    finally:
        head.stop()
        shutil.rmtree(head.temp_dir, ignore_errors=True)


def test_a_killed_driver_is_resubmitted_and_its_resume_imports_the_real_package(shadowed_head, tmp_path):
    head, cwd = shadowed_head
    env = {**os.environ, "FTLAUNCH_HOME": str(tmp_path / "home")}
    env["FTLAUNCH_LLAMAFACTORY_CLI"] = str(wrapper(tmp_path, [{"sleep": 300}, {"ok": True, "steps": 4}]))
    cfg = write_config(tmp_path)
    r = ftl("train", str(cfg), "--engine", "ray", "--address", head.address, "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    wait_for(lambda: state(run_dir).get("trainer_pid"), "the first attempt's trainer", timeout=180)
    driver = state(run_dir)["pid"]  # the entrypoint execs the supervisor: it is the job's driver
    assert Path(f"/proc/{driver}/cwd").resolve() == cwd.resolve()  # the job really runs in the shadowed folder
    os.kill(driver, signal.SIGKILL)

    def ended() -> dict | None:
        s = json.loads(ftl("status", run_dir.name, "--json", env=env).stdout)
        return s if s["status"] in ("succeeded", "failed", "lost", "stopped", "no_progress") else None

    done = wait_for(ended, "the run's end", timeout=300)
    log = (run_dir / "train.log").read_text()
    assert done["status"] == "succeeded", (done, log[-3000:])
    assert "the ftlaunch folder of the cwd was imported" not in log
    assert (tmp_path / "counter").read_text() == "2"  # the resubmitted job ran the second attempt
    kinds = [e["event"] for e in events(run_dir)]
    assert kinds.count("ray_submitted") == 2 and kinds.count("attempt_started") == 2, kinds
