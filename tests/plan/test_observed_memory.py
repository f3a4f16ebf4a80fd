"""Predicted vs observed GPU memory (issue 12, item 6): the supervisor samples what the trainer's
processes use (NVML; a seam here), records it beside the prediction, and the next plan of the same
config on the same card plans with it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from ftlaunch.plan.memory.store import recall
from ftlaunch.probe.usage import gpu_peak_of
from ftlaunch.run.launch import create_run
from ftlaunch.run.prepare import PlanRequest, make_plan
from ftlaunch.run.store import read_state
from ftlaunch.run.supervisor import Supervisor

ROOT = Path(__file__).resolve().parents[2]


def setup_run(tmp_path: Path) -> tuple[dict, PlanRequest]:
    cfg = {
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "cutoff_len": 1024,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    wrapper = tmp_path / "fake-llamafactory-cli"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "fake_trainer.py"} "$@"\n')
    wrapper.chmod(0o755)
    env = {
        "FTLAUNCH_HOME": str(tmp_path / "home"),
        "PATH": "/usr/bin:/bin",
        "FAKE_TRAINER_SCRIPT": json.dumps([{"sleep": 1.5, "ok": True, "steps": 4}]),
        "FAKE_TRAINER_COUNTER": str(tmp_path / "counter"),
        "FTLAUNCH_LLAMAFACTORY_CLI": str(wrapper),
    }
    return env, PlanRequest(config=str(tmp_path / "c.yaml"), gpu="A10G", params="1B")


def test_observed_peak_is_recorded_beside_the_prediction_and_corrects_the_next_plan(tmp_path):
    env, req = setup_run(tmp_path)
    loaded, p = make_plan(req, env)
    predicted = p.memory.peak_gib
    run_dir = create_run(loaded, p, env)
    seen = predicted * 1.25  # the card really held 25% more than predicted
    code = Supervisor(run_dir, env, poll=0.05, sample_every=0.1, gpu_sampler=lambda pids: seen).run()
    assert code == 0
    state = read_state(run_dir)
    assert state.predicted_peak_gib == predicted and state.observed_peak_gib == round(seen, 3)
    from ftlaunch.run.view import run_view

    view = run_view(run_dir)
    assert (view.predicted_peak_gib, view.observed_peak_gib) == (predicted, round(seen, 3))
    learned = recall(env, state.memory_key)["observed"]
    assert learned["observed_peak_gib"] == round(seen, 3) and learned["micro_batch"] == p.micro_batch
    _, again = make_plan(req, env)
    assert again.memory.correction > 1.2 and again.memory.peak_gib > predicted * 1.2
    assert any("observed" in w or "used" in w for w in again.warnings), again.warnings


def test_a_remembered_micro_batch_is_planned_once_with_the_memory_model(tmp_path):
    """What worked after an OOM caps the micro-batch; the plan keeps its memory table and the
    observed correction (one plan, the chooser included)."""
    from ftlaunch.plan.memory.store import config_key, remember, remember_observed

    env, req = setup_run(tmp_path)
    loaded, first = make_plan(req, env)
    assert first.micro_batch > 1 and first.memory is not None
    key = config_key(loaded.values, first.hardware.gpu_model, first.global_batch_target)
    remember(env, key, {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}, "OOM at step 3")
    predicted = first.memory.peak_gib
    remember_observed(env, key, observed_peak_gib=predicted * 1.1, predicted_peak_gib=predicted, micro_batch=1)
    _, again = make_plan(req, env)
    assert (again.micro_batch, again.accumulation) == (1, 8)
    assert again.global_batch_target == first.global_batch_target
    assert again.memory is not None and again.memory.correction > 1.05
    reasons = {c.key: c.reason for c in again.changes}
    assert (
        "worked on" in reasons["per_device_train_batch_size"]
        and "OOM at step 3" in reasons["per_device_train_batch_size"]
    )


def test_no_gpu_no_sample(tmp_path):
    env, req = setup_run(tmp_path)
    loaded, p = make_plan(PlanRequest(config=req.config, gpu="none"), env)
    run_dir = create_run(loaded, p, env)
    calls = []
    assert Supervisor(run_dir, env, poll=0.05, sample_every=0.1, gpu_sampler=lambda pids: calls.append(pids)).run() == 0
    assert calls == [] and read_state(run_dir).observed_peak_gib is None


class FakeNvml:
    """NVML as pynvml shows it: two GPUs, processes with their memory."""

    def __init__(self, procs: list[list[tuple[int, int]]]):
        self.procs = procs

    def nvmlInit(self): ...
    def nvmlShutdown(self): ...
    def nvmlDeviceGetCount(self):
        return len(self.procs)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, i):
        return [type("P", (), {"pid": pid, "usedGpuMemory": used}) for pid, used in self.procs[i]]


def test_gpu_peak_is_the_busiest_device_of_these_processes():
    gib = 2**30
    nvml = FakeNvml([[(10, 6 * gib), (99, 30 * gib)], [(11, 7 * gib), (10, 1 * gib)]])
    assert gpu_peak_of({10, 11}, nvml_loader=lambda: nvml) == 8.0  # device 1: 7 + 1; pid 99 is not ours
    assert gpu_peak_of({12}, nvml_loader=lambda: nvml) is None
    assert gpu_peak_of({10}, nvml_loader=lambda: (_ for _ in ()).throw(OSError("no driver"))) is None
