"""Fault run 5's Ray findings (issue 40, items 6 and 8), each on a real Ray head with the real trainer:

- `resume RUN --gpu none` of a 2-process run: the next job runs the re-plan it printed (one process,
  the job's driver asking 1 CPU, no NPROC_PER_NODE=2 left in the job's env), never the old plan;
- `ray job stop` from outside is recorded as a stop from outside the run, not the user's `ftlaunch stop`;
- a second `train --engine ray` of one output_dir, while the first run's job is still pending, is
  refused at once with exit 7 (busy), leaving no run behind;
- `stop` of a run whose head is gone ends `stopped`, saying the head did not answer (it stayed `running`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ftlaunch.run.ray import jobs
from ftlaunch.run.ray.record import read_record

from ..conftest import tiny_config, venv_bin, write_yaml
from ..helpers import said, wait_for
from .conftest import RAY_MISSING, start_head
from .test_e2e_ray import INJECT, events, follower_gone, ftl, launch, state, steps, wait_status

pytestmark = pytest.mark.ray

TERMINAL = {"succeeded", "failed", "lost", "stopped", "no_progress", "diverged", "stalled"}


def test_ray_job_stop_is_from_outside_and_resume_gpu_none_runs_the_plan_it_printed(ray_head, tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    started, env, _took = launch(ray_head, cfg, "nonex2", PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="1.0")
    run_dir = Path(started["run_dir"])
    wait_for(lambda: (out / "checkpoint-4" / "trainer_state.json").exists(), "checkpoint-4", timeout=300)
    sid = read_record(run_dir).current.id
    r = subprocess.run(
        [str(venv_bin() / "ray"), "job", "stop", "--address", ray_head.address, sid],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # The supervisor records "stopped by the user" (a SIGTERM is all it sees); the follower names Ray.
    stopped = wait_for(
        lambda: (s := state(run_dir))["status"] == "stopped" and "from outside" in (s.get("message") or "") and s,
        "the stop recorded as Ray's, from outside the run",
        timeout=120,
    )
    assert said("by Ray (`ray job stop` or the dashboard), not by `ftlaunch stop`", stopped["message"]), stopped
    assert not any(e["event"] == "stop_requested" for e in events(run_dir))
    assert len(read_record(run_dir).submissions) == 1  # a stop is never retried
    before = state(run_dir)
    assert before["world_size"] == 2 and before["trainer_env"]["NPROC_PER_NODE"] == "2"

    r = ftl("resume", run_dir.name, "--gpu", "none", "--no-follow", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert said("devices", r.stderr) and said("resumes from checkpoint-", r.stderr), r.stderr
    assert said("submitted again as Ray job ftlaunch-", r.stdout) and "Slurm" not in r.stdout, r.stdout
    done = wait_status(run_dir, TERMINAL, timeout=400)
    assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
    # What ran is what was printed: one process, and the next job asked Ray for one CPU.
    assert done["world_size"] == 1 and done["gpu_count"] == 0
    assert done["trainer_env"].get("NPROC_PER_NODE") in (None, "1"), done["trainer_env"]
    record = read_record(run_dir)
    assert len(record.submissions) == 2 and record.cpus == 1.0 and record.gpus is None
    assert record.env_vars.get("NPROC_PER_NODE") in (None, "1"), record.env_vars
    assert record.env_vars.get("FORCE_TORCHRUN") == done["trainer_env"].get("FORCE_TORCHRUN"), record.env_vars
    log = (run_dir / "train.log").read_text()
    second = log[log.rindex("attempt 2") :] if "attempt 2" in log else log
    sizes = re.findall(r"world size: (\d+)", second)
    assert sizes and set(sizes) == {"1"}, (sizes, second[-3000:])
    replanned = next(e for e in events(run_dir) if e["event"] == "replanned")
    assert replanned["world_before"] == 2 and replanned["world_after"] == 1
    resumed = int(record.submissions[1].resume_from.removeprefix("checkpoint-"))
    trained = steps(out)
    assert resumed >= 4 and set(trained) == set(range(1, 17))
    assert trained[-(16 - resumed) :] == list(range(resumed + 1, 17))
    wait_for(lambda: follower_gone(run_dir), "the follower's exit", timeout=30)


def test_a_second_train_of_one_output_dir_is_refused_while_the_first_job_is_pending(ray_head, tiny, tmp_path):
    # Every CPU of the head taken: the first run's job stays PENDING (no supervisor, no lock, no trainer).
    blocker = f"blocker-{time.time_ns()}"
    jobs.submit(ray_head.address, blocker, "sleep 600", {}, num_cpus=4)
    try:
        wait_for(lambda: jobs.job(ray_head.address, blocker).status == "RUNNING", "the blocker job", timeout=120)
        cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, tmp_path / "out"))
        first, env, _took = launch(ray_head, cfg)
        run_dir = Path(first["run_dir"])
        assert jobs.job(ray_head.address, read_record(run_dir).current.id).status == "PENDING"
        t0 = time.monotonic()
        r = ftl("train", str(cfg), "--engine", "ray", "--address", ray_head.address, env=env)
        took = time.monotonic() - t0
        assert r.returncode == 7, r.stdout + r.stderr
        assert said(f"is in use by run {run_dir.name} (queued, Ray job", r.stderr), r.stderr
        assert "started" not in r.stdout
        assert [d.name for d in run_dir.parent.iterdir() if d.is_dir()] == [run_dir.name]  # nothing left behind
        assert len(read_record(run_dir).submissions) == 1
        r = ftl("stop", run_dir.name, env=env)
        assert r.returncode == 0 and state(run_dir)["status"] == "stopped", r.stdout + r.stderr
        print(f"second train refused (exit 7) in {took:.1f} s")
    finally:
        jobs.stop(ray_head.address, blocker)


def test_stop_of_a_run_whose_head_is_gone_ends_stopped_and_says_why(tiny, tmp_path):
    if RAY_MISSING:
        pytest.skip(RAY_MISSING)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    head = start_head()
    try:
        started, env, _took = launch(head, cfg, None, PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="1.0")
        run_dir = Path(started["run_dir"])
        wait_for(lambda: steps(out) if (out / "trainer_log.jsonl").exists() else None, "a first step", timeout=300)
    finally:
        head.kill()  # the head's machine is lost, the job's driver and trainer with it
        shutil.rmtree(head.temp_dir, ignore_errors=True)
    assert state(run_dir)["status"] in ("running", "recovering")
    t0 = time.monotonic()
    r = ftl("stop", run_dir.name, env=env)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert said("recorded stopped", r.stdout) and said("did not answer (engine unreachable)", r.stdout), r.stdout
    st = state(run_dir)
    assert st["status"] == "stopped" and said("Ray never confirmed the job's end", st["message"]), st
    shown = json.loads(ftl("status", run_dir.name, "--json", env=env).stdout)
    assert shown["status"] == "stopped", shown
    assert any(e["event"] == "engine_unreachable" and e.get("during") == "stop" for e in events(run_dir))
    wait_for(lambda: follower_gone(run_dir), "the follower's exit once the run is stopped", timeout=60)
    print(f"stop with the head gone: {took:.1f} s")
