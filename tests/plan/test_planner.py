"""The pure planner over the real LLaMA-Factory example configs, on several cards."""

from __future__ import annotations

import pytest
import yaml

from ftlaunch.errors import HardwareError
from ftlaunch.plan import rules
from ftlaunch.plan.batch import split_batch
from ftlaunch.plan.change import REMOVED
from ftlaunch.plan.config import dump_yaml, known_keys, load_config, read_header, resolve_paths
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import PlanOptions, global_batch_for, plan

from ..conftest import EXAMPLES, upstream_training_examples

CONFIGS = upstream_training_examples()
assert len(CONFIGS) >= 7, "the vendored corpus under tests/data/corpus is incomplete"
CARDS = ["V100-32GB", "T4", "A100-80GB", "A100-80GBx4", "none"]


def load(rel: str) -> dict:
    loaded = load_config(rel, cwd=EXAMPLES)
    values, problems, _ = resolve_paths(loaded.values, loaded.base_dir, strict=False)
    assert not problems
    return values


def changed(p) -> dict:
    return {c.key: c.new for c in p.changes}


@pytest.mark.parametrize("rel", CONFIGS)
@pytest.mark.parametrize("card", CARDS)
def test_every_example_on_every_card(rel, card):
    values = load(rel)
    hw = catalog_hardware(card)
    if not hw.gpus and rules.cuda_only(values):
        with pytest.raises(HardwareError, match="needs a CUDA GPU"):
            plan(values, hw, PlanOptions(source_gpus=8))
        return
    p = plan(values, hw, PlanOptions(source_gpus=8))
    cfg = p.config
    # never a key llamafactory does not know; untouched keys keep their order and values
    assert set(cfg) <= set(known_keys())
    untouched = [k for k in values if k not in changed(p)]
    assert [k for k in cfg if k in untouched] == untouched
    assert all(cfg[k] == values[k] for k in untouched)
    # the invariant: global batch = micro x accumulation x world size
    g_src = values.get("per_device_train_batch_size", 8) * values.get("gradient_accumulation_steps", 1) * 8
    assert p.global_batch_source == g_src
    micro, accum = cfg["per_device_train_batch_size"], cfg["gradient_accumulation_steps"]
    assert micro * accum * p.world_size == p.global_batch_target
    assert p.global_batch_target == g_src  # 8-GPU batches divide over 1 and 4 devices
    # learning rate, epochs and scheduler never change
    for k in ("learning_rate", "num_train_epochs", "lr_scheduler_type", "finetuning_type", "cutoff_len"):
        assert cfg.get(k) == values.get(k)
    # precision
    if card in ("V100-32GB", "T4") and values.get("bf16"):
        assert cfg["bf16"] is False and cfg["fp16"] is True and p.precision == "fp16"
    if card == "none":
        assert not cfg.get("bf16") and not cfg.get("fp16") and p.precision == "fp32"
    if card.startswith("A100") and values.get("bf16"):
        assert cfg["bf16"] is True and "bf16" not in changed(p)
    # strategy: several processes unless the config refuses them (then one, pinned to GPU 0)
    single = rules.single_process(values) or rules.distributed_refusals(values, zero3=False)
    if hw.world_size == 1:
        assert "deepspeed" not in cfg and p.env == {}
    elif single:
        assert p.world_size == 1 and "deepspeed" not in cfg
        assert p.env in ({}, {"CUDA_VISIBLE_DEVICES": "0"}, {"USE_KT": "1"})  # KTransformers: one process, every GPU
    else:
        assert cfg.get("deepspeed") == values.get("deepspeed")
        assert p.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4"}
    # resume safety
    assert not cfg.get("overwrite_output_dir")


@pytest.mark.parametrize("rel", CONFIGS)
@pytest.mark.parametrize("card", CARDS)
def test_planning_an_adapted_config_changes_nothing(rel, card, tmp_path):
    values = load(rel)
    hw = catalog_hardware(card)
    if not hw.gpus and rules.cuda_only(values):
        return  # refused (test_every_example_on_every_card)
    first = plan(values, hw, PlanOptions(source_gpus=8))
    text = dump_yaml(first.config, first.header)
    again = plan(yaml.safe_load(text), hw, PlanOptions(), meta=read_header(text))
    assert again.changes == ()
    assert again.global_batch_target == first.global_batch_target


def test_v100_full_sft_table_reads_like_a_hand_fix():
    values = load("examples/train_full/qwen3_full_sft.yaml")
    p = plan(values, catalog_hardware("V100-32GB"), PlanOptions(source_gpus=8))
    ch = {c.key: c for c in p.changes}
    assert ch["bf16"].old is True and ch["bf16"].new is False and "7.0" in ch["bf16"].reason
    assert ch["deepspeed"].new == REMOVED and "FORCE_TORCHRUN" in ch["deepspeed"].reason
    assert ch["gradient_accumulation_steps"].new == 16  # 1 x 2 x 8 GPUs = 16 on one card
    assert "16" in ch["gradient_accumulation_steps"].reason
    assert ch["overwrite_output_dir"].new is False


def test_pure_bf16_on_pre_ampere():
    p = plan({"pure_bf16": True, "per_device_train_batch_size": 2}, catalog_hardware("T4"))
    assert p.config["pure_bf16"] is False and p.config["fp16"] is True


def test_global_batch_option_and_nearest_when_not_divisible():
    p = plan(
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        catalog_hardware("A100-80GBx4"),
        PlanOptions(global_batch=6, keep_devices=True),
    )
    assert p.global_batch_source == 6 and p.global_batch_target in (4, 8)
    assert any("nearest" in w for w in p.warnings)
    exact = plan(
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        catalog_hardware("A100-80GBx4"),
        PlanOptions(global_batch=6),
    )
    assert exact.global_batch_target == 6 and exact.world_size == 3  # fewer GPUs, the batch exact
    p2 = plan(
        {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 8},
        catalog_hardware("T4"),
        PlanOptions(source_gpus=1),
    )
    assert (p2.micro_batch, p2.accumulation, p2.global_batch_target) == (8, 8, 64)


def test_split_batch_takes_the_largest_divisor():
    assert split_batch(64, 8) == (8, 8)
    assert split_batch(12, 8) == (6, 2)
    assert split_batch(7, 4) == (1, 7)
    assert split_batch(1, 8) == (1, 1)


def test_plan_is_json_serialisable():
    import json

    p = plan(load("examples/train_lora/qwen3_lora_sft.yaml"), catalog_hardware("A10G"))
    d = json.loads(json.dumps(p.to_dict()))
    for key in ("hardware", "config", "env", "changes", "global_batch"):
        assert key in d
    assert d["global_batch"] == {"source": 8, "target": 8}


@pytest.mark.parametrize("card", ["T4", "V100-32GB", "A100-80GB", "H100-80GBx4", "none"])
@pytest.mark.parametrize("name", ["qwen3_lora_sft_ds3", "qwen3_lora_sft", "qwen3_full_sft"])
def test_memory_driven_plan_is_idempotent(name, card, tmp_path):
    """With the memory model in the loop (offload, micro-batch), re-planning changes nothing."""
    from ftlaunch.errors import DoesNotFitError
    from ftlaunch.run.prepare import PlanRequest, make_plan

    from ..conftest import ROOT

    templates = ROOT / "templates"
    mc = str(templates / "models/qwen3-4b/config.json")
    req = PlanRequest(
        config=f"cluster/{name}.yaml", gpu=card, source_gpus=8, model_config=mc, cwd=str(templates), host_ram_gib=128
    )
    try:
        _, first = make_plan(req, {})
    except DoesNotFitError:
        return
    adapted = tmp_path / "adapted.yaml"
    adapted.write_text(dump_yaml(first.config, first.header))
    _, again = make_plan(PlanRequest(config=str(adapted), gpu=card, model_config=mc, host_ram_gib=128), {})
    assert again.changes == (), again.changes


def test_global_batch_target_is_what_plan_keeps():
    values = {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 3}
    gb = global_batch_for(values, 2, PlanOptions(source_gpus=1, keep_devices=True))
    assert (gb.source, gb.per_device, gb.target) == (9, 4, 8) and "nearest achievable" in gb.warning
    p = plan(values, catalog_hardware("A100-80GBx2"), PlanOptions(source_gpus=1, keep_devices=True))
    assert (p.global_batch_source, p.global_batch_target) == (gb.source, gb.target) and gb.warning in p.warnings
    gb = global_batch_for(values, 2, PlanOptions(source_gpus=1))
    p = plan(values, catalog_hardware("A100-80GBx2"), PlanOptions(source_gpus=1))
    assert (gb.target, gb.world) == (9, 1) and (p.global_batch_target, p.world_size) == (9, 1)
    assert global_batch_for(values, 3, meta={"world_size": 2}).target == 18
