"""Commands in-process with click's CliRunner: output shapes, exit codes, errors without tracebacks."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ftlaunch.cli.main import main

from ..conftest import EXAMPLES
from ..helpers import said


def run(*args, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


def test_plan_json_shape(monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    r = run(
        "plan",
        "examples/train_full/qwen3_full_sft.yaml",
        "learning_rate=2e-5",
        "--gpu",
        "V100-32GB",
        "--source-gpus",
        "8",
        "--json",
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["config"]["learning_rate"] == 2e-5
    assert d["global_batch"] == {"source": 16, "target": 16}
    assert {c["key"] for c in d["changes"]} >= {"bf16", "fp16", "deepspeed", "overwrite_output_dir"}
    assert d["hardware"]["gpus"][0]["compute_capability"] == "7.0"


def test_plan_table_for_people(monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    r = run("plan", "examples/train_lora/qwen3_lora_sft_ds3.yaml", "--gpu", "T4")
    assert r.exit_code == 0, r.output
    assert "bf16" in r.output and said("global batch", r.output) and "fp16" in r.output


def test_plan_for_four_gpus_sets_torchrun(monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    # written for 4 GPUs (1 x 2 x 4 = 8): the global batch divides over all four
    r = run(
        "plan", "examples/train_lora/qwen3_lora_sft_ds3.yaml", "--gpu", "A100-80GBx4", "--source-gpus", "4", "--json"
    )
    d = json.loads(r.output)
    assert d["env"] == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}
    assert d["config"]["deepspeed"].endswith("ds_z3_config.json")
    # as written (global batch 1 x 2 = 2): two of the four GPUs keep it exactly
    d = json.loads(run("plan", "examples/train_lora/qwen3_lora_sft_ds3.yaml", "--gpu", "A100-80GBx4", "--json").output)
    assert d["env"] == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert d["global_batch"] == {"source": 2, "target": 2}


def test_config_error_exit_code_and_no_traceback(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: sft\nper_device_train_batch_size: many\nnot_a_key: 1\n")
    r = CliRunner().invoke(main, ["plan", str(cfg), "--gpu", "T4"])
    assert r.exit_code == 3
    assert "not_a_key" in r.output and "per_device_train_batch_size" in r.output
    assert "Traceback" not in r.output


def test_unknown_gpu_exit_code(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: sft\n")
    r = CliRunner().invoke(main, ["plan", str(cfg), "--gpu", "Z9000"])
    assert r.exit_code == 4 and "catalog" in r.output


def test_env_json(tmp_path):
    r = run("env", "--json")
    d = json.loads(r.output)
    assert d["gpus"] == [] and d["host_ram_gib"] > 0  # CUDA_VISIBLE_DEVICES="" in tests
    assert "llamafactory" in d["versions"]
    hw = tmp_path / "hw.json"
    hw.write_text(r.output)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: sft\nbf16: true\n")
    r2 = run("plan", str(cfg), "--hardware", str(hw), "--json")
    assert json.loads(r2.output)["config"]["bf16"] is False


def test_status_of_nothing_is_not_found():
    r = CliRunner().invoke(main, ["status"])
    assert r.exit_code == 6 and said("no runs", r.output)


def test_both_module_entry_points_run_the_cli():
    """`python -m ftlaunch` (new crontab lines) and `python -m ftlaunch.cli` (lines written before the
    package split) are the same command line."""
    import subprocess
    import sys

    for module in ("ftlaunch", "ftlaunch.cli"):
        r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "ftlaunch" in r.stdout, (module, r.stderr)
