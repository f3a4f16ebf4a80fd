"""End to end: the real ftlaunch binary runs the real llamafactory-cli on the tiny model."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import yaml

from ..conftest import child_env, tiny_config, venv_bin, write_yaml
from ..helpers import said

pytestmark = pytest.mark.e2e


def ftl(*args, env=None, timeout=300, **kw):
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args],
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def test_train_foreground_adapts_and_trains(tiny, tmp_path, isolated_home):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "cluster.yaml", tiny_config(tiny, out, bf16=True))
    r = ftl("train", str(cfg), "learning_rate=2e-4", "--foreground", "--source-gpus", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = next((isolated_home / "runs").iterdir())
    for name in ("source.yaml", "config.yaml", "plan.txt", "plan.json", "train.log", "state.json", "events.jsonl"):
        assert (run_dir / name).exists(), name
    adapted = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert adapted["bf16"] is False  # no GPU here: bf16 would fail in TrainingArguments
    assert adapted["learning_rate"] == 2e-4  # the override reached the trainer
    assert adapted["per_device_train_batch_size"] * adapted["gradient_accumulation_steps"] == 8  # 2x2x2 GPUs
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["global_batch"] == {"source": 8, "target": 8}
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "succeeded" and state["exit_code"] == 0
    assert (out / "model.safetensors").exists()
    log = (run_dir / "train.log").read_text()
    assert "train_loss" in log or "Training completed" in log
    # the trainer's own progress made it into the state
    assert state["progress"]["step"] == state["progress"]["total_steps"] > 0


def test_bad_config_writes_nothing(tmp_path, isolated_home):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("stage: sft\nbogus_key: 1\noutput_dir: out\n")
    r = ftl("train", str(cfg), "--foreground")
    assert r.returncode == 3
    assert "bogus_key" in r.stderr and "Traceback" not in r.stderr
    assert not (isolated_home / "runs").exists() or not any((isolated_home / "runs").iterdir())


def test_plan_is_fast_and_light(tmp_path):
    """`ftlaunch plan` imports neither torch nor transformers (and stays well under a second)."""
    from ..conftest import EXAMPLES

    code = (
        "import sys, time; t=time.perf_counter(); from ftlaunch.cli.main import main\n"
        "try:\n main(['plan','examples/train_full/qwen3_full_sft.yaml','--gpu','V100-32GB','--json'])\n"
        "except SystemExit: pass\n"
        "bad=[m for m in ('torch','transformers','llamafactory','datasets','ray') if m in sys.modules]\n"
        "print('HEAVY', bad, file=sys.stderr); print('SECONDS', time.perf_counter()-t, file=sys.stderr)"
    )
    t0 = time.perf_counter()
    r = subprocess.run(
        [str(venv_bin() / "python"), "-c", code], cwd=EXAMPLES, capture_output=True, text=True, env=child_env()
    )
    wall = time.perf_counter() - t0
    assert said("HEAVY []", r.stderr), r.stderr
    plan = json.loads(r.stdout)
    assert plan["config"]["fp16"] is True
    print(f"plan wall time {wall:.2f}s")
