"""`train --slurm` end to end against stand-ins for the Slurm commands (tests/slurm/fakeslurm.py)
that really run the batch script and its srun step: two "nodes" are two trainer processes with
different SLURM_NODEID. The trainer is tests/slurm/fake_dist_trainer.py.

Why stand-ins here: a GPU job (8 GPUs a node, NPROC_PER_NODE=8, the global batch kept over 16 GPUs)
cannot be produced on the CPU cluster of the Slurm lane, and this runs in the e2e lane where no
Slurm is installed. Everything a real Slurm can show (CPU nodes, real requeue and signal timing,
stop, status without accounting, resume through sbatch, stalls) is in test_e2e_slurm_real.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import ROOT, venv_bin, write_yaml

pytestmark = pytest.mark.e2e

SLURM = ROOT / "tests" / "slurm"
COMMANDS = ("sbatch", "srun", "squeue", "sacct", "scancel", "scontrol")


@pytest.fixture
def cluster(tmp_path, isolated_home):
    bindir = tmp_path / "slurm-bin"
    bindir.mkdir()
    for name in COMMANDS:
        f = bindir / name
        f.write_text(f'#!/bin/sh\nFAKE_SLURM_COMMAND={name} exec {sys.executable} {SLURM / "fakeslurm.py"} "$@"\n')
        f.chmod(0o755)
    trainer = tmp_path / "llamafactory-cli"
    trainer.write_text(f'#!/bin/sh\nexec {sys.executable} {SLURM / "fake_dist_trainer.py"} "$@"\n')
    trainer.chmod(0o755)
    env = dict(os.environ)
    env.update(
        PATH=f"{bindir}{os.pathsep}{venv_bin()}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        FAKE_SLURM_DIR=str(tmp_path / "slurm-jobs"),
        FAKE_SLURM_QUEUE_SECONDS="2",
        FTLAUNCH_LLAMAFACTORY_CLI=str(trainer),
        FAKE_STEP_SECONDS="0.25",
        HF_TOKEN="hf_secret_never_written",
    )
    out = tmp_path / "out"
    cfg = {
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 30,
        "save_steps": 5,
        "logging_steps": 1,
        "bf16": True,
    }
    return {"env": env, "config": write_yaml(tmp_path / "c.yaml", cfg), "out": out, "home": isolated_home}


def ftl(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def submit(cluster: dict, *extra: str) -> dict:
    r = ftl(
        "train", str(cluster["config"]), "--slurm", "--nodes", "2", "--gpu", "A100-80GBx8",
        "--source-gpus", "16", "--partition", "gpu", "--time", "1:00:00", "--sbatch-arg=--exclusive",
        "--json", *extra, env=cluster["env"],
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def view(cluster: dict, run_id: str) -> dict:
    return json.loads(ftl("status", run_id, "--json", env=cluster["env"]).stdout)


def wait_for(cluster: dict, run_id: str, statuses: set[str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        v = view(cluster, run_id)
        if v["status"] in statuses:
            return v
        assert time.monotonic() < deadline, v
        time.sleep(0.3)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def test_two_nodes_signal_requeue_resume_to_the_end(cluster):
    # The time limit "nears" once checkpoint-10 exists (mid-run, whatever the machine's load).
    cluster["env"]["FAKE_SLURM_SIGNAL_WHEN"] = str(cluster["out"] / "checkpoint-10")
    cluster["env"]["FAKE_STEP_SECONDS"] = "0.4"
    started = submit(cluster)
    run_id, run_dir = started["id"], Path(started["run_dir"])
    first = view(cluster, run_id)
    assert first["status"] == "queued" and first["slurm_state"] == "PENDING", first
    assert ftl("status", run_id, env=cluster["env"]).returncode == 11

    script = (run_dir / "job.sbatch").read_text()
    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--requeue", "--signal=B:USR1@180",
                 "--partition=gpu", "--time=1:00:00", "--exclusive", "--open-mode=append"):  # fmt: skip
        assert f"#SBATCH {line}" in script, line
    assert "srun --nodes=2 --ntasks-per-node=1" in (run_dir / "srun-trainer.sh").read_text()

    done = wait_for(cluster, run_id, {"succeeded", "failed", "lost", "stopped"}, timeout=150)
    assert done["status"] == "succeeded", (done, (run_dir / "train.log").read_text()[-3000:])
    kinds = [e["event"] for e in events(run_dir)]
    assert "requeued" in kinds and kinds.count("slurm_job_started") == 2, kinds
    restarts = [e.get("slurm_restart_count") for e in events(run_dir) if e["event"] == "slurm_job_started"]
    assert restarts == ["0", "1"]

    # The step count is continuous: the second start resumed from the last complete checkpoint
    # (checkpoint-10, which triggered the signal, or a later one written before the stop landed),
    # and every step 1..30 was trained.
    second = [e for e in events(run_dir) if e["event"] == "attempt_started"][1]
    resumed = int(str(second["resume_from"]).removeprefix("checkpoint-"))
    assert resumed >= 10 and resumed % 5 == 0, second
    lines = (cluster["out"] / "trainer_log.jsonl").read_text().splitlines()
    steps = [json.loads(line)["current_steps"] for line in lines]
    assert set(steps) == set(range(1, 31))
    assert steps[-(30 - resumed) :] == list(range(resumed + 1, 31))  # the resumed attempt's steps
    # Every node got the rendezvous from the allocation, both times.
    nodes = [json.loads(line) for line in (cluster["out"].parent / "nodes.jsonl").read_text().splitlines()]
    assert len(nodes) == 4 and sorted(n["NODE_RANK"] for n in nodes) == ["0", "0", "1", "1"]
    for n in nodes:
        assert (n["NNODES"], n["NPROC_PER_NODE"], n["FORCE_TORCHRUN"], n["MASTER_ADDR"]) == ("2", "8", "1", "127.0.0.1")
        assert n["MASTER_PORT"] and n["MASTER_PORT"].isdigit()
    # The global batch is kept across 2 nodes x 8 GPUs; secrets never reach a file.
    state = json.loads((run_dir / "state.json").read_text())
    assert state["micro_batch"] * state["accumulation"] * 16 == 128 and state["world_size"] == 16
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert "hf_secret_never_written" not in f.read_text(errors="replace"), f
