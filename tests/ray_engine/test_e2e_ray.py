"""The Ray engine on a real Ray head (tests/ray_engine/conftest.py: `ray start --head` on 127.0.0.1,
4 CPUs) with the real llamafactory-cli on the tiny model: the Ray lane (`bash scripts/test.sh --ray`).

- a 2-process CPU job (torchrun over gloo) trains to succeeded;
- kill -9 of the job's driver mid-run: the follower submits the next attempt under a new submission
  id, it resumes from the last complete checkpoint, and every step after it is trained once;
- `stop`: stopped, never retried;
- a config of LLaMA-Factory's own Ray mode (ray_num_workers) is refused in under 5 s, with the reason;
- the OOM ladder, the stall watchdog and the disk guard run beside the trainer inside the job (a
  2-process job on a real tmpfs that holds 2 checkpoints ends disk_full, never resubmitted).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ftlaunch.errors import ConfigError, ExitCode
from ftlaunch.plan.disk import DiskForecast
from ftlaunch.run import engines
from ftlaunch.run.disk import tree_bytes
from ftlaunch.run.launch import start_run
from ftlaunch.run.options import RunOptions
from ftlaunch.run.progress import checkpoint_problems
from ftlaunch.run.ray import jobs
from ftlaunch.run.ray.record import read_record

from ..conftest import ROOT, child_env, tiny_config, venv_bin, write_yaml
from ..helpers import said, wait_for
from ..run.test_e2e_disk import TOLERANCE, Measured, tmpfs
from .conftest import RAY_MISSING, start_head

pytestmark = pytest.mark.ray

INJECT = str(ROOT / "tests" / "inject")


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def steps(out: Path) -> list[int]:
    lines = (out / "trainer_log.jsonl").read_text().splitlines()
    return [r["current_steps"] for r in map(json.loads, lines) if "loss" in r]


def ftl(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def launch(head, cfg: Path, gpu: str | None = None, **env_extra: str):
    """`ftlaunch train cfg --engine ray --address HEAD [--gpu ...] --json`: (its JSON, env, seconds)."""
    env = child_env(**env_extra)
    t0 = time.monotonic()
    r = ftl("train", str(cfg), "--engine", "ray", "--address", head.address, "--json",
            *(["--gpu", gpu] if gpu else []), env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout), env, time.monotonic() - t0


def follower_gone(run_dir: Path) -> bool:
    """The run's follower has exited (it does once the run's end is recorded)."""
    from ftlaunch.run.procs import Liveness, liveness

    record = read_record(run_dir)
    return liveness(record.follower_pid, record.follower_start) is Liveness.DEAD


def wait_status(run_dir: Path, wanted: set[str], timeout: float = 300) -> dict:
    return wait_for(lambda: state(run_dir) if state(run_dir)["status"] in wanted else None, str(wanted), timeout)


def test_two_cpu_processes_train_the_tiny_model_as_a_ray_job(ray_head, tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    started, env, took = launch(ray_head, cfg, "nonex2")
    run_dir = Path(started["run_dir"])
    record = read_record(run_dir)
    assert started["ray_submission_id"] == record.current.id == f"ftlaunch-{run_dir.name}-1"
    assert record.cpus == 2 and record.env_vars["PATH"].startswith(str(Path(os.sys.executable).parent))
    first = wait_for(lambda: next((e for e in events(run_dir) if e["event"] == "attempt_started"), None), "start")
    submitted = next(e for e in events(run_dir) if e["event"] == "ray_submitted")
    done = wait_status(run_dir, {"succeeded", "failed", "lost", "stopped", "no_progress"})
    assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
    assert done["world_size"] == 2 and done["engine"] == "ray"
    assert done["trainer_env"]["NPROC_PER_NODE"] == "2" and done["trainer_env"]["FORCE_TORCHRUN"] == "1"
    log = (run_dir / "train.log").read_text()
    assert "world size: 2" in log and "distributed training: True" in log
    assert steps(out) == list(range(1, 17))
    # The supervisor records its end, then exits: the job ends a moment after.
    assert wait_for(lambda: jobs.job(record.address, record.current.id).terminal, "the job's end")
    assert jobs.job(record.address, record.current.id).status == "SUCCEEDED"
    assert len(read_record(run_dir).submissions) == 1
    shown = json.loads(ftl("status", run_dir.name, "--json", env=env).stdout)
    assert shown["status"] == "succeeded", shown
    wait_for(lambda: follower_gone(run_dir), "the follower's exit", timeout=30)
    latency = _seconds(first["t"]) - _seconds(submitted["t"])
    print(f"start_run (plan, preflight, submit) {took:.1f} s; submitted -> supervisor's attempt 1 {latency:.1f} s")


def _seconds(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def test_a_killed_driver_is_resubmitted_and_resumes_with_every_step_once(ray_head, tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    # One CPU process (a checkpoint of several CPU processes cannot be resumed: accelerate's cpu:N),
    # a second per step so the kill lands mid-run.
    started, _env, _took = launch(ray_head, cfg, None, PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="1.0")
    run_dir = Path(started["run_dir"])
    wait_for(lambda: (out / "checkpoint-8" / "trainer_state.json").exists(), "checkpoint-8", timeout=300)
    driver = state(run_dir)["pid"]  # the entrypoint execs the supervisor: it is the job's driver
    os.kill(driver, signal.SIGKILL)
    killed = time.time()
    done = wait_status(run_dir, {"succeeded", "failed", "lost", "stopped", "no_progress"}, timeout=400)
    assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
    record = read_record(run_dir)
    assert [s.id for s in record.submissions] == [f"ftlaunch-{run_dir.name}-{n}" for n in (1, 2)]
    assert jobs.job(record.address, record.submissions[0].id).driver_exit_code == -9
    ended = next(e for e in events(run_dir) if e["event"] == "ray_job_ended")
    assert ended["job_status"] == "FAILED" and said("failed from outside", ended["message"])
    second = [e for e in events(run_dir) if e["event"] == "attempt_started"][-1]
    resumed = int(second["resume_from"].removeprefix("checkpoint-"))
    assert resumed >= 8 and resumed == int(record.submissions[1].resume_from.removeprefix("checkpoint-"))
    trained = steps(out)
    assert set(trained) == set(range(1, 17))
    assert trained[-(16 - resumed) :] == list(range(resumed + 1, 17))  # the resumed attempt: each step once
    resubmitted = next(e for e in events(run_dir) if e["event"] == "ray_submitted" and e["why"] != "start")
    print(f"kill -9 -> next attempt submitted {_seconds(resubmitted['t']) - killed:.1f} s; resumed from {resumed}")


def test_stop_is_stopped_and_never_retried(ray_head, tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    started, env, _took = launch(ray_head, cfg, None, PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="1.0")
    run_dir = Path(started["run_dir"])
    wait_for(lambda: steps(out) if (out / "trainer_log.jsonl").exists() else None, "a first step", timeout=300)
    r = ftl("stop", run_dir.name, env=env)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    assert state(run_dir)["status"] == "stopped"
    record = read_record(run_dir)
    assert jobs.job(record.address, record.current.id).status == "STOPPED"
    time.sleep(5)  # the follower has seen it by now: nothing submitted again
    assert len(read_record(run_dir).submissions) == 1 and state(run_dir)["status"] == "stopped"
    assert (run_dir / "follower.log").read_text().strip().endswith("stopped")


def test_lf_ray_mode_that_cannot_place_its_workers_is_refused_at_once(ray_head, tiny, tmp_path):
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, tmp_path / "out", ray_num_workers=2))
    env = child_env(USE_RAY="1")
    opts = RunOptions()
    engine = engines.get("ray")(address=ray_head.address, env=env)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:  # the use case `train` calls, in this process
        start_run(opts.plan_request(str(cfg), (), strict=True), env, opts.supervisor_settings(), engine=engine)
    took = time.monotonic() - t0
    assert e.value.exit_code == 3 and took < 5, took
    assert said("would wait forever for its placement group", e.value.message)
    assert said("4 bundles of {CPU: 10}", e.value.message) and said("ray start --num-cpus", e.value.message)
    t0 = time.monotonic()
    r = ftl("train", str(cfg), "--engine", "ray", "--address", ray_head.address, env=env)
    cli = time.monotonic() - t0
    assert r.returncode == 3 and said("would wait forever for its placement group", r.stderr), r.stderr
    assert not (Path(os.environ["FTLAUNCH_HOME"]) / "runs").exists()
    print(f"ray_num_workers refused in {took:.2f} s in process, {cli:.2f} s as `ftlaunch train` (exit 3)")


def test_a_stopped_head_is_unreachable_not_failed_and_resume_on_a_new_head_finishes(tiny, tmp_path):
    if RAY_MISSING:
        pytest.skip(RAY_MISSING)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    first = start_head()
    try:
        started, env, _took = launch(first, cfg, None, PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="1.0")
        run_dir = Path(started["run_dir"])
        wait_for(lambda: (out / "checkpoint-4" / "trainer_state.json").exists(), "checkpoint-4", timeout=300)
    finally:
        first.kill()  # the head's machine is lost: its raylet, the job's driver and the trainer with it
        shutil.rmtree(first.temp_dir, ignore_errors=True)
    r = ftl("status", run_dir.name, "--json", env=env)
    shown = json.loads(r.stdout)
    assert shown["status"] in ("running", "recovering") and shown["slurm_state"] == "engine unreachable", shown
    assert state(run_dir)["status"] in ("running", "recovering")  # never failed
    second = start_head()
    try:
        r = ftl("resume", run_dir.name, "--no-follow", env={**env, "RAY_ADDRESS": second.address})
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Slurm" not in r.stdout, r.stdout  # a Ray run's job is named a Ray job
        done = wait_status(run_dir, {"succeeded", "failed", "lost", "stopped", "no_progress"}, timeout=400)
        assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
        record = read_record(run_dir)
        assert record.address == second.address and len(record.submissions) == 2
        assert any(e["event"] == "engine_unreachable" for e in events(run_dir))
        second_start = [e for e in events(run_dir) if e["event"] == "attempt_started"][-1]
        resumed = int(second_start["resume_from"].removeprefix("checkpoint-"))
        trained = steps(out)
        assert resumed >= 4 and set(trained) == set(range(1, 17))
        assert trained[-(16 - resumed) :] == list(range(resumed + 1, 17))
        wait_for(lambda: follower_gone(run_dir), "the follower's exit", timeout=30)
    finally:
        second.stop()
        shutil.rmtree(second.temp_dir, ignore_errors=True)


def test_the_oom_ladder_runs_beside_the_trainer_inside_the_job(ray_head, tiny, tmp_path):
    """The supervisor is the job's driver: an OOM is retried inside the job (micro-batch halved, the
    global batch kept), with no second submission."""
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "c.yaml",
        tiny_config(tiny, out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4),
    )
    started, _env, _took = launch(ray_head, cfg, None, PYTHONPATH=INJECT, FTLAUNCH_TEST_OOM_ABOVE="1")
    run_dir = Path(started["run_dir"])
    done = wait_status(run_dir, {"succeeded", "failed", "lost", "stopped", "no_progress"}, timeout=400)
    assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
    assert done["micro_batch"] == 1 and done["micro_batch"] * done["accumulation"] == 8  # global batch kept
    retries = [e["message"] for e in events(run_dir) if e["event"] == "retry"]
    assert retries and retries[0].startswith("[1/4] OOM"), retries
    assert len(read_record(run_dir).submissions) == 1  # recovered by the supervisor on the cluster
    assert sorted(set(steps(out))) == [1, 2, 3, 4]


def test_the_stall_watchdog_runs_beside_the_trainer_inside_the_job(ray_head, tiny, tmp_path):
    """A trainer frozen with SIGSTOP on the cluster is found stalled by the supervisor (the job's
    driver), its stacks dumped, and restarted from the last complete checkpoint inside the same job."""
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=24, save_steps=8))
    env = child_env(PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="0.3")
    r = ftl("train", str(cfg), "--engine", "ray", "--address", ray_head.address, "--stall-timeout", "20", "--json",
            env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    wait_for(lambda: (out / "trainer_log.jsonl").exists() and max(steps(out), default=0) >= 11, "step 11", 300)
    os.kill(state(run_dir)["trainer_pid"], signal.SIGSTOP)
    frozen_at = time.time()
    stalled = wait_for(lambda: [e for e in events(run_dir) if e["event"] == "stalled"], "stalled", timeout=120)
    latency = _seconds(stalled[0]["t"]) - frozen_at
    done = wait_status(run_dir, {"succeeded", "failed", "lost", "stopped", "no_progress", "stalled"}, timeout=400)
    assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
    retry = [e for e in events(run_dir) if e["event"] == "retry"]
    assert len(retry) == 1 and "[1/2] stalled" in retry[0]["message"], retry
    assert len(read_record(run_dir).submissions) == 1  # restarted by the supervisor on the cluster
    assert set(steps(out)) == set(range(1, 25))
    print(f"SIGSTOP -> stalled event {latency:.1f} s (stall timeout 20 s)")


# The disk test's job: 2 CPU processes, saves at 6, 12, 18 and 24.
DISK_JOB = {"save_steps": 6, "max_steps": 24}


@pytest.fixture(scope="module")
def ray_measured(ray_head, tiny, tmp_path_factory) -> Measured:
    """The disk test's own job measured on the head (2 processes: a checkpoint holds one rng state per
    rank), never the local engine's 1-process figures: its forecast (state.json "disk") against its
    real largest checkpoint."""
    base = tmp_path_factory.mktemp("ray-measured")
    out = base / "out"
    started, _env, _took = launch(ray_head, write_yaml(base / "c.yaml", tiny_config(tiny, out, **DISK_JOB)), "nonex2")
    run_dir = Path(started["run_dir"])
    done = wait_status(run_dir, {"succeeded", "failed", "lost", "stopped", "no_progress", "disk_full"}, timeout=400)
    assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in checkpoints] == [f"checkpoint-{s}" for s in (6, 12, 18, 24)]
    assert {p.name for p in checkpoints[-1].glob("rng_state*")} == {"rng_state_0.pth", "rng_state_1.pth"}
    fc = DiskForecast.from_dict(done["disk"])
    real = tree_bytes(checkpoints[-1])
    print(f"2-process checkpoint: predicted {fc.checkpoint_bytes:,} B, real {real:,} B")
    assert abs(fc.checkpoint_bytes - real) <= TOLERANCE * real
    return Measured(out, fc, checkpoints)


def test_the_disk_guard_runs_beside_the_trainer_inside_the_job(ray_head, ray_measured, tiny, tmp_path):
    """A 2-process job whose output_dir is a real tmpfs sized for 2 checkpoints: the supervisor (the
    job's driver) saves exactly those, stops before the next save writes a partial one, records
    disk_full and exits 17; the follower sees the recorded end and submits nothing again."""
    fits, fill_step = 2, 18
    with tmpfs(tmp_path / "small", ray_measured.tmpfs_k_for(fits)) as mnt:
        out = mnt / "out"
        cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, **DISK_JOB))
        started, _env, _took = launch(ray_head, cfg, "nonex2", PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="0.1")
        run_dir = Path(started["run_dir"])
        record = read_record(run_dir)
        done = wait_status(run_dir, {"succeeded", "failed", "lost", "stopped", "no_progress", "disk_full"}, 400)
        assert done["status"] == "disk_full" and done["attempt"] == 1, (
            done,
            (run_dir / "train.log").read_text()[-3000:],
        )
        verdict = done["disk"]["verdict"]
        assert verdict["fits"] == fits and verdict["fill_step"] == fill_step, done["disk"]
        msg = " ".join(done["message"].split())
        assert f"step {fill_step}" in msg and str(mnt) in msg and "one checkpoint takes" in msg, msg
        # the supervisor exits as on the local engine (17); the job's end follows it
        assert wait_for(lambda: jobs.job(record.address, record.current.id).terminal, "the job's end")
        job = jobs.job(record.address, record.current.id)
        assert job.status == "FAILED" and job.driver_exit_code == ExitCode.DISK_FULL, job
        wait_for(lambda: follower_gone(run_dir), "the follower's exit", timeout=60)
        assert len(read_record(run_dir).submissions) == 1 and state(run_dir)["status"] == "disk_full"
        assert (run_dir / "follower.log").read_text().strip().endswith("disk_full")
        names = sorted((p.name for p in out.iterdir() if "checkpoint" in p.name), key=lambda n: int(n.split("-")[-1]))
        # the complete ones kept, exactly as many as forecast; no partial, nothing set aside
        assert names == [f"checkpoint-{6 * k}" for k in range(1, fits + 1)], names
        assert all(checkpoint_problems(out / n) == [] for n in names)
