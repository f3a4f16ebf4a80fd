"""Resume anywhere (issue 34) on the real trainer: `--gpu nonex2` trains the tiny model in two CPU
processes over gloo, and `resume RUN --gpu none` continues a run of two processes in one, the global
batch kept, from its last complete checkpoint; plus the pure pieces around it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from ftlaunch.run.control import cpu_processes_refusal, rng_state_notes
from ftlaunch.run.trainer import with_torchrun_beside

from ..conftest import ROOT, child_env, tiny_config, venv_bin, write_yaml
from ..helpers import said, wait_for

INJECT = str(ROOT / "tests" / "inject")


def ftl(*args, env, timeout=300):
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def env_without_torchrun(**extra) -> dict:
    """The caller's environment with no torchrun on PATH: an unactivated virtualenv, as a user runs
    .venv/bin/ftlaunch."""
    path = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if not (Path(p) / "torchrun").exists()
    )
    return child_env(PATH=path, **extra)


def logged(out: Path) -> list[dict]:
    lines = (out / "trainer_log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def run_dir_of(home: Path) -> Path:
    return next((home / "runs").iterdir())


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ pure pieces


def test_torchrun_beside_the_trainer_goes_first_on_path(tmp_path):
    (tmp_path / "bin").mkdir()
    for name in ("llamafactory-cli", "torchrun"):
        (tmp_path / "bin" / name).write_text("")
    cli = [str(tmp_path / "bin" / "llamafactory-cli")]
    env = with_torchrun_beside({"PATH": "/usr/bin", "FORCE_TORCHRUN": "1"}, cli)
    assert env["PATH"].split(os.pathsep) == [str(tmp_path / "bin"), "/usr/bin"]
    assert with_torchrun_beside({"PATH": "/usr/bin"}, cli) == {"PATH": "/usr/bin"}  # no torchrun planned


def test_rng_state_notes_name_the_missing_and_the_unused_files():
    two = {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt"}
    on_one = rng_state_notes(two, 1)
    assert said("missing for the new world size 1: rng_state.pth", on_one[0])
    assert said("written by 2 process(es)", on_one[0])
    assert said("unused on 1 process(es): rng_state_0.pth, rng_state_1.pth", on_one[1])
    on_two = rng_state_notes({"rng_state.pth"}, 2)
    assert said("rng_state_0.pth, rng_state_1.pth", on_two[0]) and said("unused on 2", on_two[1])
    assert rng_state_notes(two, 2) == []


def test_several_cpu_processes_never_resume_an_optimizer_they_cannot_load():
    names = {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
    assert said("tagged with cpu:0", cpu_processes_refusal(2, 0, names))
    assert cpu_processes_refusal(1, 0, names) is None  # one CPU process loads it onto "cpu"
    assert cpu_processes_refusal(2, 2, names) is None  # GPUs: cuda:N
    assert cpu_processes_refusal(2, 0, {"model.safetensors"}) is None  # weights only


# ------------------------------------------------------------------ the real trainer


@pytest.mark.e2e
def test_two_cpu_processes_train_the_tiny_model_over_gloo(tiny, tmp_path, isolated_home):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    r = ftl("train", str(cfg), "--gpu", "nonex2", "--foreground", env=env_without_torchrun())
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = run_dir_of(isolated_home)
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "succeeded" and state["world_size"] == 2
    assert state["trainer_env"]["NPROC_PER_NODE"] == "2" and state["trainer_env"]["FORCE_TORCHRUN"] == "1"
    adapted = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert adapted["ddp_backend"] == "gloo" and adapted["bf16"] is False
    # the global batch kept: 2 x 2 x 1 -> 2 x 1 x 2
    assert (adapted["per_device_train_batch_size"], adapted["gradient_accumulation_steps"]) == (2, 1)
    log = (run_dir / "train.log").read_text()
    assert "world size: 2" in log and "distributed training: True" in log
    steps = [x["current_steps"] for x in logged(out)]
    assert steps == list(range(1, 17))  # 64 rows / global batch 4: every step once


@pytest.mark.e2e
def test_a_run_of_two_processes_resumes_on_one_with_the_global_batch_and_the_loss_kept(tiny, tmp_path, isolated_home):
    over = {"learning_rate": 1.0e-3, "save_steps": 4}
    # the uninterrupted run, for the losses
    ref_out = tmp_path / "ref"
    ref_cfg = write_yaml(tmp_path / "ref.yaml", tiny_config(tiny, ref_out, **over))
    r = ftl("train", str(ref_cfg), "--gpu", "nonex2", "--foreground", "--name", "ref", env=env_without_torchrun())
    assert r.returncode == 0, r.stdout + r.stderr
    reference = {x["current_steps"]: x["loss"] for x in logged(ref_out)}
    ref_dir = run_dir_of(isolated_home)

    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out, **over))
    slow = env_without_torchrun(PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="1.0")
    r = ftl("train", str(cfg), "--gpu", "nonex2", "--name", "moving", env=slow)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: (out / "checkpoint-8" / "trainer_state.json").exists(), "checkpoint-8", timeout=240)
    assert ftl("stop", "moving", env=slow).returncode == 0
    first = [x["current_steps"] for x in logged(out)]

    r = ftl("resume", "moving", "--gpu", "none", "--foreground", env=env_without_torchrun())
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = next(d for d in (isolated_home / "runs").iterdir() if d.name != ref_dir.name)
    replanned = next(e for e in events(run_dir) if e["event"] == "replanned")
    ckpt = int(replanned["checkpoint"].removeprefix("checkpoint-"))
    assert ckpt >= 8 and (replanned["world_before"], replanned["world_after"]) == (2, 1)
    # the change table: devices 2 -> 1, accumulation 1 -> 2, the torchrun variables gone; the RNG files said
    assert said("devices 2 1", r.stderr) and said("gradient_accumulation_steps 1 2", r.stderr)
    assert said("NPROC_PER_NODE 2 -", r.stderr) and said("ddp_backend gloo (removed)", r.stderr)
    assert said("global batch 4 -> 4 = 2 micro x 2 accum x 1 device(s)", r.stderr)
    assert said(f"resumes from checkpoint-{ckpt}", r.stderr)
    assert said("RNG states unused on 1 process(es): rng_state_0.pth, rng_state_1.pth", r.stderr)
    assert "world size: 1" in (run_dir / "train.log").read_text()
    assert json.loads((run_dir / "state.json").read_text())["world_size"] == 1

    records = logged(out)
    resumed = [x["current_steps"] for x in records[len(first) :]]
    assert resumed == list(range(ckpt + 1, 17))  # every step after the checkpoint once, on one process
    assert sorted({*first[: first.index(ckpt) + 1], *resumed}) == list(range(1, 17))
    loss = records[len(first)]["loss"]
    print(f"\nfirst resumed step {ckpt + 1}: loss {loss} (1 process) vs {reference[ckpt + 1]} uninterrupted (2)")
    assert abs(loss - reference[ckpt + 1]) < 1e-3 < abs(reference[1] - reference[ckpt + 1])


@pytest.mark.e2e
def test_a_run_of_one_process_is_not_resumed_on_two_cpu_processes_into_a_crash(tiny, tmp_path, isolated_home):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out))
    slow = env_without_torchrun(PYTHONPATH=INJECT, FTLAUNCH_TEST_STEP_SLEEP="0.6")
    assert ftl("train", str(cfg), "--gpu", "none", "--name", "one", env=slow).returncode == 0
    wait_for(lambda: (out / "checkpoint-4" / "trainer_state.json").exists(), "checkpoint-4", timeout=240)
    assert ftl("stop", "one", env=slow).returncode == 0
    run_dir = run_dir_of(isolated_home)
    config_before = (run_dir / "config.yaml").read_text()
    r = ftl("resume", "one", "--gpu", "nonex2", "--foreground", env=env_without_torchrun())
    assert r.returncode == 3, r.stdout + r.stderr
    assert said("2 CPU processes cannot load the checkpoint's optimizer.pt", r.stderr)
    assert said("resume it on one CPU process (--gpu none)", r.stderr)
    # refused before anything changed: the config, the world size and the status are the stopped run's
    assert (run_dir / "config.yaml").read_text() == config_before
    state = json.loads((run_dir / "state.json").read_text())
    assert (state["status"], state["world_size"]) == ("stopped", 1)
