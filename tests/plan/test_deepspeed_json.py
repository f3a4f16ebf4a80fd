"""A user's own DeepSpeed JSON: its fixed batch numbers are the source global batch; when the plan's
differ, the adapted config carries a copy with "auto" there (transformers refuses a mismatch); when
offload replaces it, its other settings are carried over and what is dropped is said."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ftlaunch.plan.config import dump_yaml, read_header
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.memory.adapt import make_memory_chooser, offload_config
from ftlaunch.plan.modelspec import spec_from_config
from ftlaunch.plan.offload import (
    batch_mismatch,
    carry_over,
    fixed_batch,
    source_batch,
    with_auto_batch,
)
from ftlaunch.plan.planner import PlanOptions, global_batch_for, plan

MODELS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "model-configs"
OPTIM = ("adamw_torch", "set in the test")
# the shape of a JSON users paste (LLaMA-Factory issue 366): it fixes micro-batch 16 x accumulation 8
USER_DS = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 8,
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {
        "stage": 2,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
        "sub_group_size": 1e8,
    },
}
CFG = {"stage": "sft", "do_train": True, "finetuning_type": "lora", "deepspeed": "ds.json", "fp16": True}


def test_fixed_numbers_and_the_source_batch_they_give():
    assert fixed_batch(USER_DS) == {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 8}
    assert fixed_batch({"train_batch_size": "auto", "gradient_accumulation_steps": True}) == {}
    assert source_batch(USER_DS, 8, 1, 1)[0] == 128
    assert source_batch(USER_DS, 8, 1, 4)[0] == 512  # x the world size it was written for
    assert source_batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}, 8, 1, 4)[0] == 64
    assert source_batch({"gradient_accumulation_steps": 4}, 2, 1, 1)[0] == 8  # the YAML's micro-batch
    assert source_batch({"train_batch_size": "auto"}, 2, 1, 1) is None
    gb = global_batch_for({"per_device_train_batch_size": 8}, 1, ds=USER_DS)
    assert (gb.source, gb.target) == (128, 128) and "DeepSpeed JSON" in gb.why
    # --global-batch still wins
    assert global_batch_for({}, 1, PlanOptions(global_batch=32), ds=USER_DS).source == 32


def test_a_kept_json_gets_auto_where_the_plans_numbers_differ():
    p = plan(CFG, catalog_hardware("A100-80GBx4"), deepspeed_config=USER_DS)
    assert p.world_size == 4 and p.global_batch_target == 128
    ds = p.config["deepspeed"]
    assert isinstance(ds, dict)
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_accumulation_steps"] == "auto"
    # every other setting as written
    fixed = fixed_batch(USER_DS)
    assert {k: v for k, v in ds.items() if k not in fixed} == {k: v for k, v in USER_DS.items() if k not in fixed}
    # micro-batch 16 x accumulation 2 x 4 GPUs keeps 128: the JSON's accumulation 8 would not
    assert (p.micro_batch, p.accumulation) == (16, 2)
    row = next(c for c in p.changes if c.key == "deepspeed")
    reason = " ".join(row.reason.split())
    assert "gradient_accumulation_steps 8 (the plan: 2)" in reason and '"auto"' in reason
    assert not batch_mismatch(ds, p.micro_batch, p.accumulation, p.world_size)
    # planning the adapted config again changes nothing
    text = dump_yaml(p.config, p.header)
    again = plan(yaml.safe_load(text), catalog_hardware("A100-80GBx4"), meta=read_header(text), deepspeed_config=ds)
    assert again.changes == () and again.config["deepspeed"] == ds


def test_a_json_whose_numbers_match_is_left_alone():
    ds = {**USER_DS, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}
    values = {**CFG, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8}
    p = plan(values, catalog_hardware("A100-80GBx4"), PlanOptions(source_gpus=4), deepspeed_config=ds)
    assert (p.micro_batch, p.accumulation, p.world_size) == (4, 8, 4)
    assert p.config["deepspeed"] == "ds.json"


def test_auto_copy_does_not_touch_the_original():
    copy = with_auto_batch(USER_DS)
    assert USER_DS["train_micro_batch_size_per_gpu"] == 16 and copy["train_micro_batch_size_per_gpu"] == "auto"


def test_offload_carries_the_users_settings_and_says_what_it_drops():
    merged, dropped = carry_over(USER_DS, offload_config())
    zero = merged["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"  # offload's
    assert zero["sub_group_size"] == 1e8 and zero["allgather_bucket_size"] == 5e8  # the user's tuning
    assert merged["zero_allow_untested_optimizer"] is True and merged["fp16"]["initial_scale_power"] == 16
    assert merged["train_micro_batch_size_per_gpu"] == "auto"
    assert set(dropped) == {
        "train_micro_batch_size_per_gpu 16",
        "gradient_accumulation_steps 8",
        "zero_optimization.stage 2",
    }


def test_a_plan_that_needs_offload_keeps_the_users_json_settings():
    spec = spec_from_config(json.loads((MODELS / "qwen2.5-7b" / "config.json").read_text()))
    values = {**CFG, "finetuning_type": "full", "cutoff_len": 1024, "bf16": True, "fp16": False, "optim": "adamw_torch"}
    chooser = make_memory_chooser(spec, USER_DS, headroom=0.12, default_optim=OPTIM)
    p = plan(values, catalog_hardware("A100-80GB", host_ram_gib=512), memory_chooser=chooser, deepspeed_config=USER_DS)
    ds = p.config["deepspeed"]
    assert isinstance(ds, dict) and ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["sub_group_size"] == 1e8
    row = " ".join(next(c for c in p.changes if c.key == "deepspeed").reason.split())
    assert "carried over" in row and "zero_optimization.stage 2" in row
    assert p.env.get("FORCE_TORCHRUN") == "1" and p.env.get("NPROC_PER_NODE") == "1"
