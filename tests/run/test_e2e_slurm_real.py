"""`train --slurm` on a real Slurm 22.05 cluster: two slurmd (node1, node2) on this machine, started by
scripts/slurm_local.sh (`bash scripts/test.sh --slurm` does it), no accounting (sacct fails), node
names that do not resolve (NodeAddr=localhost). The trainer is the real llamafactory-cli on the tiny
model, one process per CPU node, gloo: world size 2. Slow on purpose only where Slurm is
(a requeued job waits ~120 s unless released with `scontrol update JobId=J StartTime=now`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import tiny_config, venv_bin, write_yaml
from ..helpers import said

pytestmark = pytest.mark.slurm

TERMINAL = {"succeeded", "failed", "lost", "stopped", "stalled", "no_progress", "disk_full", "diverged"}


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    if not os.environ.get("SLURM_CONF") or shutil.which("sbatch") is None:
        pytest.skip("no Slurm cluster: `bash scripts/test.sh --slurm` starts one with scripts/slurm_local.sh")
    r = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    nodes = dict(line.split() for line in r.stdout.splitlines() if line.strip())
    assert r.returncode == 0 and {"node1", "node2"} <= set(nodes), r.stdout + r.stderr
    return nodes


@pytest.fixture
def env(cluster, tmp_path, isolated_home) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{venv_bin()}{os.pathsep}{e.get('PATH', '/usr/bin:/bin')}"  # torchrun beside llamafactory-cli
    return e


def ftl(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def submit(tiny: Path, tmp_path: Path, env: dict, *extra: str, name: str = "out", **over) -> dict:
    cfg = write_yaml(tmp_path / f"{name}.yaml", tiny_config(tiny, tmp_path / name, **over))
    r = ftl("train", str(cfg), "--slurm", "--nodes", "2", "--gpu", "none", "--json", *extra, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    started = json.loads(r.stdout)
    started["out"] = tmp_path / name
    return started


def view(env: dict, run_id: str) -> dict:
    return json.loads(ftl("status", run_id, "--json", env=env).stdout)


def wait_for(env: dict, run_id: str, check, timeout: float = 240, what: str = "") -> dict:
    deadline = time.monotonic() + timeout
    while True:
        v = view(env, run_id)
        if check(v):
            return v
        assert time.monotonic() < deadline, (what, v)
        time.sleep(0.5)


def wait_path(path: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30)


def release(job: str) -> None:
    """A requeued job waits ~120 s (BeginTime); let it start now."""
    deadline = time.monotonic() + 60
    while slurm("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() != "PENDING":
        assert time.monotonic() < deadline, "the requeued job never went back to PENDING"
        time.sleep(0.3)
    # Slurm revokes the killed instance's credential with a one-second stamp: a requeued job made to
    # start within that second is killed as "Job credential revoked" (seen in CI's slurmctld.log).
    # Slurm's own ~120 s BeginTime never meets it; a test that skips the wait must let it pass.
    deadline = time.monotonic() + 60
    while any(not s.strip().startswith("idle") for s in slurm("sinfo", "-h", "-N", "-o", "%T").stdout.splitlines()):
        assert time.monotonic() < deadline, "the requeued job's nodes never went idle"
        time.sleep(0.3)
    time.sleep(2.0)
    r = slurm("scontrol", "update", f"JobId={job}", "StartTime=now")
    assert r.returncode == 0, r.stderr


def every_step_once(out: Path, total: int, resumed: int) -> None:
    """Each step trained, and the resumed attempt's records run on from its checkpoint (the trainer's
    closing record, without a loss, repeats the last step: left out)."""
    records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    steps = [r["current_steps"] for r in records if "loss" in r]
    assert set(steps) == set(range(1, total + 1)), steps
    assert steps[-(total - resumed) :] == list(range(resumed + 1, total + 1)), steps


def resumed_from(run_dir: Path) -> int:
    later = [e for e in events(run_dir) if e["event"] == "attempt_started"][1:]
    assert later, [e["event"] for e in events(run_dir)]
    return int(str(later[-1]["resume_from"]).removeprefix("checkpoint-"))


def trained_only_in_slurm(run_dir: Path) -> None:
    """Every attempt started inside a Slurm job (after that job's batch step began), none elsewhere."""
    in_job = False
    for e in events(run_dir):
        if e["event"] == "slurm_job_started":
            in_job = True
        elif e["event"] in ("resubmitted", "requeued", "requeued_by_slurm"):
            in_job = False
        elif e["event"] == "attempt_started":
            assert in_job, [x["event"] for x in events(run_dir)]


def test_two_cpu_nodes_train_to_success_without_accounting(tiny, tmp_path, env):
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("node1", None)  # the MASTER_ADDR case: Slurm's node name does not resolve
    assert slurm("sacct", "-j", "1").returncode != 0  # no accounting on this cluster
    started = submit(tiny, tmp_path, env)
    run_dir = Path(started["run_dir"])
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "gpus" not in script  # CPU nodes: no GPU request
    config = (run_dir / "config.yaml").read_text()
    assert "ddp_backend: gloo" in config and "bf16: false" in config
    done = wait_for(env, started["id"], lambda v: v["status"] in TERMINAL, what="the job's end")
    log = (run_dir / "train.log").read_text()
    assert done["status"] == "succeeded", log[-3000:]
    assert done["slurm_state"] == "COMPLETED"  # from squeue/scontrol: sacct cannot say
    assert log.count("world size: 2, device: cpu:0, distributed training: True") == 2  # rank 0 and rank 1
    assert "MASTER_ADDR localhost (NodeAddr of node1) resolved on node1 to 127.0.0.1" in log
    assert json.loads((started["out"] / "trainer_log.jsonl").read_text().splitlines()[-1])["current_steps"] == 16
    r = ftl("resume", started["id"], env=env)
    assert r.returncode == 0 and said("already succeeded", r.stdout)


def test_scontrol_requeue_is_slurms_and_resumes_from_the_last_checkpoint(tiny, tmp_path, env):
    started = submit(tiny, tmp_path, env, num_train_epochs=2.0)
    run_dir, job = Path(started["run_dir"]), started["slurm_job_id"]
    wait_path(started["out"] / "checkpoint-8")
    assert slurm("scontrol", "requeue", job).returncode == 0
    queued = wait_for(env, started["id"], lambda v: v["status"] == "queued" and v["slurm_state"] == "PENDING")
    assert "requeued by Slurm" in queued["message"], queued  # never "stopped by the user"
    assert "requeued_by_slurm" in [e["event"] for e in events(run_dir)]
    # resume while Slurm holds the job: nothing submitted, nothing trained here
    r = ftl("resume", started["id"], env=env)
    assert r.returncode == 0 and said("nothing submitted", r.stdout), r.stdout + r.stderr
    assert view(env, started["id"])["slurm_job_id"] == job
    release(job)
    done = wait_for(env, started["id"], lambda v: v["status"] in TERMINAL)
    assert done["status"] == "succeeded", (run_dir / "train.log").read_text()[-3000:]
    resumed = resumed_from(run_dir)
    assert resumed >= 8 and resumed % 4 == 0
    every_step_once(started["out"], 32, resumed)
    trained_only_in_slurm(run_dir)


def test_time_limit_signal_requeues_and_resumes(tiny, tmp_path, env):
    started = submit(tiny, tmp_path, env, num_train_epochs=2.0)
    run_dir, job = Path(started["run_dir"]), started["slurm_job_id"]
    wait_path(started["out"] / "checkpoint-8")
    # what `--signal=B:USR1@180` does before the time limit, sent now
    assert slurm("scancel", "--signal=USR1", "--batch", job).returncode == 0
    wait_for(env, started["id"], lambda v: v["status"] == "queued" and v["slurm_state"] == "PENDING")
    release(job)
    done = wait_for(env, started["id"], lambda v: v["status"] in TERMINAL)
    assert done["status"] == "succeeded", (run_dir / "train.log").read_text()[-3000:]
    kinds = [e["event"] for e in events(run_dir)]
    assert "requeued" in kinds and kinds.count("slurm_job_started") == 2, kinds
    restarts = [e.get("slurm_restart_count") for e in events(run_dir) if e["event"] == "slurm_job_started"]
    assert restarts == [None, "1"]  # Slurm leaves SLURM_RESTART_COUNT unset on the first start
    resumed = resumed_from(run_dir)
    assert resumed >= 8 and resumed % 4 == 0
    every_step_once(started["out"], 32, resumed)


def test_a_lost_run_resumes_through_sbatch(tiny, tmp_path, env):
    started = submit(tiny, tmp_path, env, num_train_epochs=2.0)
    run_dir, job = Path(started["run_dir"]), started["slurm_job_id"]
    wait_path(started["out"] / "checkpoint-8")
    # everything of the job killed at once: nothing of it can record an end
    assert slurm("scancel", "--full", "--signal=KILL", job).returncode == 0
    lost = wait_for(env, started["id"], lambda v: v["status"] == "lost", timeout=90)
    assert lost["slurm_state"] not in ("PENDING", "RUNNING"), lost
    t0 = time.monotonic()
    r = ftl("resume", started["id"], "--no-follow", env=env)
    assert r.returncode == 0 and said("submitted again as Slurm job", r.stdout), r.stdout + r.stderr
    assert time.monotonic() - t0 < 30  # it submitted; it did not train here
    new_job = view(env, started["id"])["slurm_job_id"]
    assert new_job != job
    done = wait_for(env, started["id"], lambda v: v["status"] in TERMINAL)
    assert done["status"] == "succeeded", (run_dir / "train.log").read_text()[-3000:]
    jobs = [e.get("slurm_job_id") for e in events(run_dir) if e["event"] == "slurm_job_started"]
    assert jobs == [job, new_job]
    trained_only_in_slurm(run_dir)
    every_step_once(started["out"], 32, resumed_from(run_dir))


def test_stop_a_pending_and_a_running_job(tiny, tmp_path, env):
    pending = submit(tiny, tmp_path, env, "--sbatch-arg=--begin=now+600", name="pending")
    assert view(env, pending["id"])["status"] == "queued"
    r = ftl("stop", pending["id"], env=env)
    assert r.returncode == 0 and said("cancelled while pending", r.stdout), r.stdout + r.stderr
    assert view(env, pending["id"])["status"] == "stopped"

    running = submit(tiny, tmp_path, env, name="running", num_train_epochs=2.0)
    wait_for(env, running["id"], lambda v: v["status"] == "running" and (v["step"] or 0) >= 1)
    r = ftl("stop", running["id"], env=env)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    v = wait_for(env, running["id"], lambda v: v["slurm_state"] not in ("RUNNING", "COMPLETING"), timeout=60)
    assert v["status"] == "stopped" and v["slurm_state"] == "CANCELLED", v
    kinds = [e["event"] for e in events(Path(running["run_dir"]))]
    assert "stop_requested" in kinds and "requeued" not in kinds and "requeued_by_slurm" not in kinds


def test_no_address_fails_fast_and_an_unreachable_one_is_a_rendezvous_failure(tiny, tmp_path, env):
    bad = submit(tiny, tmp_path, env, "--master-addr", "no-such-host.invalid", name="noaddr")
    v = wait_for(env, bad["id"], lambda v: v["status"] in TERMINAL, timeout=60)
    assert v["status"] == "failed" and v["failure_kind"] == "rendezvous", v
    assert "no-such-host.invalid" in v["message"] and "--master-addr" in v["message"]
    assert "attempt_started" not in [e["event"] for e in events(Path(bad["run_dir"]))]  # no trainer started

    # 192.0.2.1 (TEST-NET-1) resolves but nothing answers: the check gives up after its bound
    far = submit(tiny, tmp_path, env, "--master-addr", "192.0.2.1", "--rendezvous-timeout", "5", name="far")
    v = wait_for(env, far["id"], lambda v: v["status"] in TERMINAL, timeout=90)
    assert v["status"] == "failed" and v["failure_kind"] == "rendezvous", v
    assert "not complete within 5 s" in v["message"] and "not retried" in v["message"]
    assert v["attempt"] == 1


def _rank1_worker(run_id: str) -> int:
    """The pid of the trainer process of rank 1 of this run (torchrun's worker on node2)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "launcher.py" in cmd and run_id in cmd and b"RANK=1" in environ:
            return int(proc.name)
    raise AssertionError("no rank-1 worker found")


def test_one_rank_stopped_is_caught_as_stalled_and_resumed(tiny, tmp_path, env):
    started = submit(tiny, tmp_path, env, "--stall-timeout", "15", num_train_epochs=2.0)
    run_dir = Path(started["run_dir"])
    wait_path(started["out"] / "checkpoint-4")
    pid = _rank1_worker(started["id"])
    os.kill(pid, signal.SIGSTOP)  # rank 0 now waits in gloo's allreduce; no step is logged
    try:
        done = wait_for(env, started["id"], lambda v: v["status"] in TERMINAL)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # ours: the stopped worker, should the stop have missed it
        except ProcessLookupError:
            pass
    assert done["status"] == "succeeded", (run_dir / "train.log").read_text()[-3000:]
    stalled = [e for e in events(run_dir) if e["event"] == "stalled"]
    assert len(stalled) == 1 and done["attempt"] == 2, [e["event"] for e in events(run_dir)]
    every_step_once(started["out"], 32, resumed_from(run_dir))


def test_a_job_sbatch_refuses_leaves_nothing_behind(tiny, tmp_path, env, isolated_home):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, tmp_path / "out"))
    r = ftl("train", str(cfg), "--slurm", "--nodes", "2", "--gpu", "none", "--partition", "nosuch", env=env)
    assert r.returncode == 13, r.stdout + r.stderr
    assert said("sbatch refused the job (sbatch exit 1)", r.stderr) and said("invalid partition", r.stderr), r.stderr
    assert not list((isolated_home / "runs").glob("*")), "a refused job left a run behind"
    assert ftl("runs", "--json", env=env).stdout.strip() == "[]"
