"""`train --engine slurm` goes through start_run as every run does (issue 32), on the real Slurm lane
(scripts/slurm_local.sh: two slurmd on this machine, CPU nodes) with the real llamafactory-cli:

- a config LLaMA-Factory's own parser refuses (and ftlaunch's rules do not) exits 3 in the user's shell
  before sbatch: no job, no run left;
- a tight (GPU) plan is simulated before the submission;
- the run's state has the disk forecast, which the supervisor on the node guards its saves with; the
  notifier settings travel to the node's supervisor (--notify-cmd runs there on started and succeeded)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, MODEL_CONFIGS, tiny_config, venv_bin, write_yaml
from ..helpers import said
from .test_e2e_slurm_real import TERMINAL, events, ftl, slurm, wait_for
from .test_e2e_slurm_real import cluster as cluster  # the lane's fixture: skips without a Slurm cluster

pytestmark = pytest.mark.slurm


@pytest.fixture
def env(cluster, tmp_path, isolated_home) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{venv_bin()}{os.pathsep}{e.get('PATH', '/usr/bin:/bin')}"  # torchrun beside llamafactory-cli
    return e


Z3 = EXAMPLES / "examples" / "deepspeed" / "ds_z3_config.json"


def _jobs() -> set[str]:
    return set(slurm("squeue", "-h", "-t", "all", "-o", "%i").stdout.split())


def test_a_config_llamafactory_refuses_exits_3_before_sbatch(tiny, tmp_path, env, isolated_home):
    # pure_bf16 under ZeRO-3: LLaMA-Factory's parser refuses it (hparams/parser.py), ftlaunch's rules do not
    cfg = tiny_config(tiny, tmp_path / "out", bf16=False, pure_bf16=True, deepspeed=str(Z3))
    path = write_yaml(tmp_path / "z3.yaml", cfg)
    before = _jobs()
    t0 = time.monotonic()
    r = ftl("train", str(path), "--engine", "slurm", "--nodes", "2", "--gpu", "A100-80GBx1", env=env, timeout=400)
    seconds = time.monotonic() - t0
    assert r.returncode == 3, r.stdout + r.stderr
    assert said("`pure_bf16` is incompatible with DeepSpeed ZeRO-3.", r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert _jobs() == before  # nothing was submitted
    runs = isolated_home / "runs"
    assert not runs.exists() or not list(runs.glob("*"))  # no run left behind
    print(f"refused in the user's shell in {seconds:.1f} s (the parser child included)")


def test_a_tight_plan_is_simulated_before_the_submission(tiny, tmp_path, env, isolated_home):
    # The seed case on a V100-32GB is tight (about 5% free): checked on fake tensors before sbatch. This
    # cluster has CPU nodes only: sbatch refuses the GPU request (exit 13) or holds it; either way after.
    cfg = tiny_config(tiny, tmp_path / "out", cutoff_len=1024, per_device_train_batch_size=8,
                      gradient_accumulation_steps=8, max_steps=1)  # fmt: skip
    path = write_yaml(tmp_path / "seed.yaml", cfg)
    t0 = time.monotonic()
    r = ftl(
        "train", str(path), "--engine", "slurm", "--nodes", "1", "--gpu", "V100-32GB",
        "--model-config", str(MODEL_CONFIGS / "qwen2.5-1.5b" / "config.json"), "--json", env=env, timeout=500,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    assert said("plan is tight: simulating", r.stderr) and said("simulated peak", r.stderr), r.stdout + r.stderr
    print(f"tight plan: simulated before sbatch in {seconds:.1f} s, then exit {r.returncode}")
    if r.returncode == 13:  # refused by sbatch, after the simulation: nothing left behind
        assert said("sbatch refused the job", r.stderr), r.stderr
        assert not list((isolated_home / "runs").glob("*"))
        return
    assert r.returncode == 0, r.stdout + r.stderr
    started = json.loads(r.stdout)
    plan = json.loads((Path(started["run_dir"]) / "plan.json").read_text())
    assert plan["memory"]["verdict"] == "tight" and plan["memory"]["simulated"]["simulated_peak_gib"] > 20
    assert ftl("stop", started["id"], env=env).returncode == 0


def test_the_disk_forecast_goes_to_the_node_and_notifications_travel(tiny, tmp_path, env, isolated_home):
    got = tmp_path / "notified.jsonl"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, tmp_path / "out"))
    t0 = time.monotonic()
    r = ftl(
        "train", str(cfg), "--engine", "slurm", "--nodes", "2", "--gpu", "none",
        "--notify-cmd", f"cat >> {got}; echo >> {got}", "--json", env=env, timeout=400,
    )  # fmt: skip
    to_sbatch = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    started = json.loads(r.stdout)
    run_dir = Path(started["run_dir"])
    state = json.loads((run_dir / "state.json").read_text())
    assert state["engine"] == "slurm" and state["slurm_job_id"] == started["slurm_job_id"]
    # the forecast the supervisor on the node guards each save with (its disk watch exists iff state.disk)
    assert state["disk"]["checkpoint_bytes"] > 0, state.get("disk")
    done = wait_for(env, started["id"], lambda v: v["status"] in TERMINAL, what="the job's end")
    assert done["status"] == "succeeded", (run_dir / "train.log").read_text()[-3000:]
    assert "slurm_job_started" in [e["event"] for e in events(run_dir)]
    # the notifier settings travelled: the node's supervisor ran the command on started and succeeded
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "succeeded" not in (got.read_text() if got.exists() else ""):
        time.sleep(0.5)
    text = got.read_text() if got.exists() else ""
    assert '"started"' in text and '"succeeded"' in text, text[-2000:]
    print(f"train --engine slurm -> sbatch: {to_sbatch:.1f} s (plan, preflight, disk forecast)")


def test_the_stall_dump_of_a_slurm_run_holds_the_ranks_python_stacks(tiny, tmp_path, env, isolated_home):
    """Issue 31: the ranks are srun's (slurmstepd's children), not the trainer's: the dump finds them by
    the job's environment. Here both nodes are this machine, so both ranks are dumped."""
    import signal

    from .test_e2e_slurm_real import _rank1_worker

    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, tmp_path / "out", num_train_epochs=2.0))
    r = ftl("train", str(cfg), "--engine", "slurm", "--nodes", "2", "--gpu", "none", "--stall-timeout", "15",
            "--json", env=env, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    started = json.loads(r.stdout)
    run_dir = Path(started["run_dir"])
    deadline = time.monotonic() + 300
    while not (tmp_path / "out" / "checkpoint-4").exists():
        assert time.monotonic() < deadline, (run_dir / "train.log").read_text()[-2000:]
        time.sleep(0.3)
    pid = _rank1_worker(started["id"])
    os.kill(pid, signal.SIGSTOP)  # rank 0 now waits in gloo's allreduce; no step is logged
    try:
        wait_for(env, started["id"], lambda v: "stalled" in [e["event"] for e in events(run_dir)], timeout=240)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    dumps = sorted((run_dir / "stacks").glob("*.txt"))
    assert dumps, sorted(p.name for p in run_dir.iterdir())
    text = dumps[0].read_text()
    # torchrun and its rank on each node (their command lines name launcher.py), found though srun does
    # not parent them; py-spy read their Python stacks (a "Thread" line each), the SIGSTOPped rank's too
    ranks = [block for block in text.split("===== pid ")[1:] if "launcher.py" in block.splitlines()[0]]
    assert len(ranks) >= 2, text[:3000]
    assert sum("Thread" in block for block in ranks) >= 2, text[:4000]
    ftl("stop", started["id"], env=env)
