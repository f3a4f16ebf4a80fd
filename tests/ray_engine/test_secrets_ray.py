"""A notification secret never reaches the Ray dashboard (issue 40, item 1), on a real Ray head with
the real trainer: `train --engine ray` with FTLAUNCH_NOTIFY='http://127.0.0.1:9/hook?token=MARKER'.
The marker is neither in the run's ray.json nor anywhere in the dashboard's GET /api/jobs/ (the
job's runtime env, entrypoint and metadata), and the job's supervisor still notifies that destination:
it reads it from the run's secrets.json (0600), where the submission kept it."""

from __future__ import annotations

import json
import secrets
import stat
import urllib.request
from pathlib import Path

import pytest

from ..conftest import tiny_config, write_yaml
from ..helpers import wait_for
from .test_e2e_ray import INJECT, events, ftl, launch, wait_status

pytestmark = pytest.mark.ray

TERMINAL = {"succeeded", "failed", "lost", "stopped", "no_progress", "diverged", "stalled"}


def dashboard_jobs(address: str) -> bytes:
    with urllib.request.urlopen(f"{address}/api/jobs/", timeout=30) as resp:
        return resp.read()


def test_ftlaunch_notify_is_in_neither_ray_json_nor_the_dashboards_job_list(ray_head, tiny, tmp_path):
    marker = f"MARKER{secrets.token_hex(10)}"
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    started, env, _took = launch(
        ray_head, cfg, None, PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="1.0",
        FTLAUNCH_NOTIFY=f"http://127.0.0.1:9/hook?token={marker}",
    )  # fmt: skip
    run_dir = Path(started["run_dir"])
    try:
        listed = dashboard_jobs(ray_head.address)
        ours = [j for j in json.loads(listed) if (j.get("metadata") or {}).get("ftlaunch_run") == run_dir.name]
        assert ours and "FTLAUNCH_HOME" in ours[0]["runtime_env"]["env_vars"]  # the job's env is what it shows
        # The job's supervisor has the destination all the same: it tries it (port 9: refused) and says so.
        tried = wait_for(
            lambda: [e for e in events(run_dir) if e["event"] == "notified" and e.get("notice") == "started"],
            "the job's supervisor to notify started",
            timeout=300,
        )
        assert tried[0]["target"] == "http://127.0.0.1:9/***" and not tried[0]["ok"]
        listed += dashboard_jobs(ray_head.address)  # again, with the job running
    finally:
        ftl("stop", run_dir.name, env=env)
    wait_status(run_dir, TERMINAL)
    assert marker.encode() not in listed
    assert marker not in (run_dir / "ray.json").read_text()
    kept = run_dir / "secrets.json"
    assert marker in kept.read_text() and stat.S_IMODE(kept.stat().st_mode) == 0o600
