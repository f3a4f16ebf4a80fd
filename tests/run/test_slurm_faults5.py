"""Fault run 5's Slurm finding (issue 40, item 8): "a job whose processes were all killed showed
`running` for 80+ s". On the real two-node cluster (scripts/slurm_local.sh), every process of a running
job is SIGKILLed at once, as a user killing them would: the batch step (ftlaunch.run.slurm.job), the
supervisor, the srun steps, the trainers on both nodes, and Slurm's own slurmstepd of the job; status
must say `lost` within seconds, never `running` on. Measured here: 1-5 s (COMPLETING for 1-2 s, read
as the recorded `running` while Slurm ends the job, then `lost`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import ROOT
from .test_e2e_slurm_real import cluster, env, submit, wait_for  # noqa: F401  (cluster, env: fixtures)

pytestmark = pytest.mark.slurm

INJECT = str(ROOT / "tests" / "inject")


def processes_of_job(job: str) -> list[int]:
    """Every process of this machine that belongs to Slurm job ``job``: SLURM_JOB_ID=job in its
    environment (the batch step, the supervisor, srun, the trainers), and the job's slurmstepd."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ or cmd.startswith(f"slurmstepd: [{job}."):
            found.append(int(proc.name))
    return found


def test_every_process_of_a_running_job_killed_reads_lost_within_seconds(tiny, tmp_path, env):  # noqa: F811
    slow = {**env, "PYTHONPATH": INJECT, "FTLAUNCH_TEST_STEP_SLEEP": "1.0"}
    started = submit(tiny, tmp_path, slow)
    run_id, job = started["id"], started["slurm_job_id"]
    try:
        wait_for(env, run_id, lambda v: v["status"] == "running" and (v["step"] or 0) >= 1, what="a first step")
        beat = json.loads((Path(started["run_dir"]) / "slurm-beat.json").read_text())
        assert beat["job"] == job and time.time() - beat["t"] < 15, beat
        # slurmstepd first (the lowest pids): nothing is left to tell slurmctld that the job ended.
        pids = processes_of_job(job)
        assert len(pids) >= 6, pids  # job step, supervisor, srun, a trainer on each node, slurmstepd
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        lost = wait_for(env, run_id, lambda v: v["status"] != "running", timeout=90, what="not running")
        took = time.monotonic() - t0
        assert lost["status"] == "lost", lost
        assert "silent" in lost["slurm_state"] or lost["slurm_state"] not in ("PENDING", "RUNNING"), lost
        assert took < 40, took
        print(f"every process of job {job} killed -> status lost {took:.1f} s later ({lost['slurm_state']})")
    finally:
        # Slurm finds the batch step missing minutes later and requeues the job: it must not run again.
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
