"""``--gpu nonexN``: N trainer processes on the CPU (torchrun over gloo, fp32), the global batch kept
exactly, shown in the change table, and the host-RAM verdict counting every process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftlaunch.errors import HardwareError
from ftlaunch.plan.hardware import Hardware, catalog_hardware, parse_gpu_spec
from ftlaunch.plan.memory.adapt import make_memory_chooser
from ftlaunch.plan.memory.host import host_estimate
from ftlaunch.plan.memory.setup import setup_from_config
from ftlaunch.plan.modelspec import spec_from_config
from ftlaunch.plan.planner import plan

MODELS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "model-configs"
OPTIM = ("adamw_torch", "set in the test")
CFG = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "full",
    "cutoff_len": 128,
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "bf16": True,
    "output_dir": "out",
}


def _changes(p) -> dict:
    return {c.key: c for c in p.changes}


@pytest.mark.parametrize("spec", ["nonex2", "cpux2", "2xnone", "NONE x 2"])
def test_nonexN_parses_to_n_cpu_processes(spec):
    assert parse_gpu_spec(spec) == ("none", 2)
    hw = catalog_hardware(spec)
    assert (hw.gpus, hw.world_size, hw.cpu_processes) == ((), 2, 2)
    assert "2 processes" in hw.describe()


def test_plain_none_is_still_one_process():
    assert parse_gpu_spec("none") == ("none", 0)
    hw = catalog_hardware("none")
    assert (hw.world_size, hw.describe(), hw.to_dict().get("cpu_processes")) == (1, "no GPU (CPU only)", None)


@pytest.mark.parametrize("spec", ["nonex0", "nonex17", "nonex" + "9" * 40])
def test_a_cpu_process_count_out_of_bounds_is_refused(spec):
    with pytest.raises(HardwareError, match="CPU processes must be 1 to 16"):
        parse_gpu_spec(spec)


def test_cpu_processes_survive_a_hardware_file_round_trip():
    hw = catalog_hardware("nonex3")
    assert Hardware.from_dict(hw.to_dict()).world_size == 3


def test_two_cpu_processes_plan_torchrun_gloo_fp32_and_keep_the_global_batch():
    p = plan(CFG, catalog_hardware("nonex2"))
    assert p.world_size == 2
    assert p.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    assert p.precision == "fp32" and not p.config["bf16"]
    assert p.config["ddp_backend"] == "gloo"
    assert p.micro_batch * p.accumulation * p.world_size == 4 == p.global_batch_source == p.global_batch_target
    ch = _changes(p)
    assert (ch["gradient_accumulation_steps"].old, ch["gradient_accumulation_steps"].new) == (2, 1)
    assert (ch["NPROC_PER_NODE"].old, ch["NPROC_PER_NODE"].new) == (None, "2")
    assert ch["FORCE_TORCHRUN"].new == "1" and "CPU" in ch["FORCE_TORCHRUN"].reason
    assert ch["ddp_backend"].new == "gloo" and "gloo" in ch["ddp_backend"].reason
    assert ch["bf16"].new is False


def test_a_batch_that_does_not_divide_runs_on_fewer_cpu_processes_exactly():
    p = plan(CFG, catalog_hardware("nonex3"))  # 4 does not divide over 3: the largest count that keeps it is 2
    assert p.world_size == 2 and p.env["NPROC_PER_NODE"] == "2"
    assert p.micro_batch * p.accumulation * 2 == 4 == p.global_batch_target
    assert "keep it exactly" in _changes(p)["NPROC_PER_NODE"].reason
    assert any("2 of them keep it exactly" in w for w in p.warnings)


def test_replanning_the_adapted_config_for_the_same_processes_changes_nothing():
    first = plan(CFG, catalog_hardware("nonex2"))
    again = plan(first.config, catalog_hardware("nonex2"), meta=first.header)
    assert again.changes == () and again.env == first.env
    assert (again.micro_batch, again.accumulation, again.world_size) == (2, 1, 2)


def test_a_config_written_for_two_processes_replanned_on_one_keeps_its_global_batch():
    two = plan(CFG, catalog_hardware("nonex2"))
    one = plan(two.config, catalog_hardware("none"), meta=two.header)
    assert one.world_size == 1 and one.env == {}
    assert one.micro_batch * one.accumulation == 4 == one.global_batch_target
    assert _changes(one)["gradient_accumulation_steps"].new == 2


def test_gpu_plans_are_unchanged_by_cpu_processes():
    p = plan(CFG, catalog_hardware("A100-80GBx2"))
    assert "ddp_backend" not in p.config and "FORCE_TORCHRUN" not in _changes(p)
    assert p.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}


def _spec():
    return spec_from_config(json.loads((MODELS / "qwen2.5-1.5b" / "config.json").read_text()))


def test_the_host_estimate_counts_every_process():
    spec = _spec()
    setup = setup_from_config(dict(CFG), world_size=1, default_optim="adamw_torch")
    one, two = host_estimate(spec, setup), host_estimate(spec, setup, processes=2)
    assert two.peak_gib == pytest.approx(2 * one.peak_gib)


def test_the_host_verdict_of_a_cpu_plan_counts_n_processes():
    spec = _spec()
    chooser = make_memory_chooser(spec, None, headroom=0.12, default_optim=OPTIM)
    one = plan(CFG, catalog_hardware("none", host_ram_gib=64), memory_chooser=chooser)
    two = plan(CFG, catalog_hardware("nonex2", host_ram_gib=64), memory_chooser=chooser)
    assert two.memory.peak_gib == pytest.approx(2 * one.memory.peak_gib, rel=0.05)
    assert "2 trainer processes" in _changes(two)["gradient_accumulation_steps"].reason


def test_one_cpu_process_drops_the_ddp_backend_a_process_group_would_need():
    two = plan(CFG, catalog_hardware("nonex2"))
    one = plan(two.config, catalog_hardware("none"), meta=two.header)
    assert "ddp_backend" not in one.config
    assert "process group" in _changes(one)["ddp_backend"].reason
