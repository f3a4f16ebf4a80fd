"""A full FTLAUNCH_HOME under a detached run of the real trainer (issue 31 item 1).

FTLAUNCH_HOME is a real 4 MiB tmpfs, filled while the tiny model trains: the supervisor (whose own
stderr, supervisor.log, is on that filesystem too) must keep its trainer going, count what it could not
write and say it once there is room, and leave the run's end where `status` finds it when state.json
cannot take it. Mounting a tmpfs needs root: the test skips, saying why, where it is not permitted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ..conftest import child_env, tiny_config, write_yaml
from .test_e2e_detached import ftl, slow_env, trainer_steps, wait_for
from .test_e2e_disk import fill, tmpfs

pytestmark = pytest.mark.e2e

NOTICE = "could not be written while its folder refused writes"


def _status(name: str, env: dict) -> tuple[int, dict, str]:
    r = ftl("status", name, "--json", env=env)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout), r.stderr


def _steps(out: Path) -> list[int]:
    try:
        return trainer_steps(out)
    except (OSError, ValueError):
        return []


def test_a_detached_run_survives_a_full_home_and_ends_succeeded(tiny, tmp_path, isolated_home):
    out = tmp_path / "out"
    # 64 rows, 2 x 2 a step, 2.5 epochs: 40 steps (the fault run's length), a checkpoint every 10
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, num_train_epochs=2.5, save_steps=10))
    with tmpfs(tmp_path / "home", 4096) as home:
        env = slow_env("0.2", FTLAUNCH_HOME=str(home))
        plain = child_env(FTLAUNCH_HOME=str(home))
        r = ftl("train", str(cfg), "--json", "--name", "fullhome", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        run_dir = Path(json.loads(r.stdout)["run_dir"])
        try:
            wait_for(lambda: max(_steps(out), default=0) >= 3, timeout=240)
            # First spell: full from step 3 to step 15, then room again.
            fill(home / "filler")
            code, st, _ = _status("fullhome", plain)  # reading works on a full home
            assert code == 11 and st["status"] == "running", st
            wait_for(lambda: max(_steps(out), default=0) >= 15, timeout=240)
            os.unlink(home / "filler")
            wait_for(lambda: NOTICE in (run_dir / "train.log").read_text(errors="replace"), timeout=60)
            # Second spell: full from here to the end: state.json cannot take the run's end.
            fill(home / "filler2")
            wait_for(lambda: _status("fullhome", plain)[1]["status"] not in ("starting", "running"), timeout=300)
            code, st, _ = _status("fullhome", plain)
            assert (code, st["status"]) == (0, "succeeded"), st
            word = st["supervisor_last_word"]
            assert word["status"] == "succeeded" and "state.json could not be written" in word["cause"], word
            assert Path(word["where"]).parent == run_dir  # the room reserved at the start took it
            steps = _steps(out)
            assert steps[-1] == 40 and set(range(1, 41)) <= set(steps), steps  # the trainer did every step
            os.unlink(home / "filler2")
            r = ftl("status", "fullhome", env=plain)
            assert r.returncode == 0 and "succeeded" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
        finally:
            ftl("stop", "fullhome", env=plain)  # the mount must not be busy when it goes
        # What was lost is said once a spell ends, each spell once: never a running total.
        log = (run_dir / "train.log").read_text(errors="replace")
        notices = [line for line in log.splitlines() if NOTICE in line]
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if '"unwritten"' in x]
        assert notices and len(notices) == len(events), (notices, events)
        assert all("the trainer kept running" in n for n in notices)
        assert sum(e["records"] for e in events) >= 1
        assert "Traceback" not in (run_dir / "supervisor.log").read_text(errors="replace")
