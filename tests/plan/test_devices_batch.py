"""The global batch is kept exactly: on fewer GPUs where it does not divide over all of them, or with
--keep-devices on all of them with the nearest batch and a warning; never grown or shrunk silently."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from ftlaunch.plan.batch import devices_for
from ftlaunch.plan.config import dump_yaml, read_header
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import PlanOptions, global_batch_for, plan


def _changes(p) -> dict:
    return {c.key: c for c in p.changes}


@pytest.mark.parametrize(
    ("g", "devices", "expected"),
    [(1, 4, 1), (2, 4, 2), (3, 4, 3), (6, 4, 3), (7, 4, 1), (8, 4, 4), (12, 8, 6), (5, 1, 1)],
)
def test_devices_for_is_the_largest_divisor_not_above_the_devices(g, devices, expected):
    got = devices_for(g, devices)
    assert got == expected
    assert g % got == 0 and got <= devices
    assert not any(g % d == 0 for d in range(got + 1, devices + 1))


@pytest.mark.parametrize("g", [1, 2, 3, 6, 7])
def test_a_global_batch_that_does_not_divide_runs_on_fewer_gpus_exactly(g):
    hw = catalog_hardware("A100-80GBx4")
    p = plan({"per_device_train_batch_size": g, "gradient_accumulation_steps": 1}, hw)
    n = devices_for(g, 4)
    assert p.global_batch_source == p.global_batch_target == g  # kept exactly
    assert p.world_size == n < 4
    assert p.micro_batch * p.accumulation * p.world_size == g
    assert p.config["per_device_train_batch_size"] * p.config["gradient_accumulation_steps"] * n == g
    # the launch env runs exactly n processes on n named GPUs
    visible = p.env["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(visible) == n
    if n > 1:
        assert p.env["NPROC_PER_NODE"] == str(n) and p.env["FORCE_TORCHRUN"] == "1"
    else:
        assert "NPROC_PER_NODE" not in p.env  # one process, no torchrun
    # said in the table, with the reason, and in a warning
    ch = _changes(p)
    assert ch["CUDA_VISIBLE_DEVICES"].new == p.env["CUDA_VISIBLE_DEVICES"]
    reason = " ".join(ch["CUDA_VISIBLE_DEVICES"].reason.split())
    assert f"global batch {g}" in reason and f"{n} of them keep it exactly" in reason and "--keep-devices" in reason
    if n > 1:
        assert (ch["NPROC_PER_NODE"].old, ch["NPROC_PER_NODE"].new) == ("4", str(n))
    assert any(f"does not divide over 4 GPUs: {n} of them" in w for w in p.warnings)


def test_keep_devices_uses_every_gpu_with_the_nearest_batch_and_says_so():
    hw = catalog_hardware("A100-80GBx4")
    p = plan({"per_device_train_batch_size": 2}, hw, PlanOptions(keep_devices=True))
    assert p.world_size == 4 and p.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}
    assert (p.global_batch_source, p.global_batch_target) == (2, 4)
    assert any("nearest achievable (--keep-devices)" in w for w in p.warnings)
    assert "nearest divisible" in _changes(p)["per_device_train_batch_size"].reason


def test_a_batch_that_divides_keeps_every_gpu_and_adds_no_rows():
    p = plan({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, catalog_hardware("A100-80GBx4"))
    assert p.world_size == 4 and "CUDA_VISIBLE_DEVICES" not in p.env
    assert not {"CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE"} & set(_changes(p))


def test_fewer_devices_drop_deepspeed_when_one_process_remains():
    values = {"per_device_train_batch_size": 1, "deepspeed": "examples/deepspeed/ds_z3_config.json"}
    p = plan(values, catalog_hardware("A100-80GBx4"))
    assert p.world_size == 1 and "deepspeed" not in p.config
    assert "keep it exactly" in _changes(p)["deepspeed"].reason


def test_replanning_the_adapted_config_changes_nothing():
    hw = catalog_hardware("A100-80GBx4")
    first = plan({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3}, hw)
    assert first.world_size == 3
    text = dump_yaml(first.config, first.header)
    again = plan(yaml.safe_load(text), hw, PlanOptions(), meta=read_header(text))
    assert again.changes == () and again.env == first.env and again.world_size == 3
    assert again.global_batch_target == 6


def test_global_batch_for_says_the_device_count_it_keeps():
    gb = global_batch_for({"per_device_train_batch_size": 3, "gradient_accumulation_steps": 3}, 2)
    assert (gb.source, gb.target, gb.world, gb.per_device, gb.warning) == (9, 9, 1, 9, None)
    assert "does not divide over 2 GPUs" in gb.fewer_devices
    kept = global_batch_for(
        {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 3}, 2, PlanOptions(keep_devices=True)
    )
    assert (kept.target, kept.world, kept.fewer_devices) == (8, 2, None) and "nearest" in kept.warning


def test_keep_devices_is_a_plan_option(tmp_path):
    from ftlaunch.cli.main import main as cli

    cfg = tmp_path / "c.yaml"
    cfg.write_text("stage: sft\ndo_train: true\nfinetuning_type: lora\nper_device_train_batch_size: 2\n")
    runner = CliRunner()
    import json

    out = runner.invoke(cli, ["plan", str(cfg), "--gpu", "A100-80GBx4", "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["world_size"] == 2 and d["global_batch"] == {"source": 2, "target": 2}
    assert d["env"]["NPROC_PER_NODE"] == "2"
    out = runner.invoke(cli, ["plan", str(cfg), "--gpu", "A100-80GBx4", "--keep-devices", "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["world_size"] == 4 and d["global_batch"] == {"source": 2, "target": 4}
