"""`ftlaunch estimate --gpu A --gpu B ...` compares machines, with real token counts (llamafactory's
own preprocessing on the tiny model's tokenizer) and a real model size (Qwen2.5-1.5B's config.json)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import EXAMPLES, MODEL_CONFIGS, tiny_config, venv_bin, write_yaml
from ..helpers import said

pytestmark = pytest.mark.e2e


def test_seed_config_over_four_cards(tiny, tmp_path):
    # The seed: full SFT, cutoff 1024, bf16, ZeRO-2, 8 x 8 per device, written for 8 GPUs.
    cfg = tiny_config(
        tiny,
        tmp_path / "out",
        cutoff_len=1024,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=8,
        num_train_epochs=2000.0,  # enough tokens that training, not start-up, decides the order
        deepspeed=str(EXAMPLES / "examples" / "deepspeed" / "ds_z2_config.json"),
    )
    path = write_yaml(tmp_path / "seed.yaml", cfg)
    args = ["estimate", str(path), "--model-config", str(MODEL_CONFIGS / "qwen2.5-1.5b" / "config.json")]
    args += ["--source-gpus", "8", "--price", "A100-80GB=1.9", "--json"]
    for card in ("V100-32GB", "A100-80GB", "H100-80GBx8", "T4"):
        args += ["--gpu", card]
    t0 = time.monotonic()
    r = subprocess.run([str(venv_bin() / "ftlaunch"), *args], capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {m["machine"]: m for m in out["machines"]}
    order = [m["machine"] for m in out["machines"]]
    assert order == ["H100-80GBx8", "A100-80GB", "V100-32GB", "T4"], order
    assert rows["V100-32GB"]["precision"] == "fp16" and rows["A100-80GB"]["precision"] == "bf16"
    for name in ("H100-80GBx8", "A100-80GB", "V100-32GB"):
        m = rows[name]
        assert m["fits"] and m["wall_hours"][0] < m["wall_hours"][1]
        # the global batch of the source (8 GPUs x 8 x 8) is kept on every machine
        assert m["micro_batch"] * m["accumulation"] * m["count"] == 512, m
    assert rows["H100-80GBx8"]["count"] == 8
    assert rows["A100-80GB"]["cost"] == [round(h * 1.9, 2) for h in rows["A100-80GB"]["gpu_hours"]]
    assert rows["V100-32GB"]["cost"] is None
    t4 = rows["T4"]
    assert not t4["fits"] and t4["wall_hours"] is None and t4["alternative"]["fits"]
    assert out["tokens"]["samples"] > 0
    print(f"comparison of 4 machines: {took:.1f} s")


def test_train_simulates_a_tight_plan_first(tiny, tmp_path):
    # The seed case on a V100-32GB is tight (about 5% free): train checks it on fake tensors first.
    cfg = tiny_config(tiny, tmp_path / "out", cutoff_len=1024, per_device_train_batch_size=8,
                      gradient_accumulation_steps=8, max_steps=1)  # fmt: skip
    path = write_yaml(tmp_path / "seed.yaml", cfg)
    wrapper = tmp_path / "fake-llamafactory-cli"
    # a trainer that logs one optimizer step (one that logs none did not train: a config error)
    wrapper.write_text(
        '#!/bin/sh\nout=$(sed -n \'s/^output_dir: //p\' "$2")\nmkdir -p "$out"\n'
        'echo \'{"current_steps": 1, "total_steps": 1, "loss": 1.0}\' >> "$out/trainer_log.jsonl"\n'
    )
    wrapper.chmod(0o755)
    env = dict(os.environ, FTLAUNCH_LLAMAFACTORY_CLI=str(wrapper))
    args = ["train", str(path), "--gpu", "V100-32GB", "--foreground", "--json"]
    args += ["--model-config", str(MODEL_CONFIGS / "qwen2.5-1.5b" / "config.json")]
    r = subprocess.run([str(venv_bin() / "ftlaunch"), *args], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert said("plan is tight: simulating", r.stderr) and said("simulated peak", r.stderr)
    plan = json.loads((Path(json.loads(r.stdout)["run_dir"]) / "plan.json").read_text())
    sim = plan["memory"]["simulated"]
    assert plan["memory"]["verdict"] == "tight" and sim["simulated_peak_gib"] > 20
    # the formula and the simulator agree within the calibration band
    assert abs(sim["simulated_peak_gib"] / sim["formula_peak_gib"] - 1) < 0.05
    r = subprocess.run([str(venv_bin() / "ftlaunch"), *args, "--no-simulate", f"output_dir={tmp_path / 'o2'}"],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 0 and "simulating" not in r.stderr, r.stderr
