"""The disk forecast and its verdict (ftlaunch.plan.disk): pure, no files.

The tiny model's real checkpoint is measured in tests/run/test_e2e_disk.py; here the formula's parts
are checked against what the HF Trainer and LLaMA-Factory save, by method and precision.
"""

from __future__ import annotations

import json

import pytest

from ftlaunch.plan.disk import (
    GIB,
    HEADROOM_MIN_BYTES,
    DiskForecast,
    DiskVerdictKind,
    RunLength,
    SaveSettings,
    disk_verdict,
    enough_for_save,
    forecast,
    headroom,
    run_length,
)
from ftlaunch.plan.memory.setup import setup_from_config
from ftlaunch.plan.modelspec import spec_from_config

from ..conftest import MODEL_CONFIGS

# The tiny model of scripts/make_tiny.py (145,984 parameters).
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 498,
    "tie_word_embeddings": False,
}
QWEN15 = json.loads((MODEL_CONFIGS / "qwen2.5-1.5b" / "config.json").read_text())


def fc_for(model: dict, cfg: dict, steps: int | None = 16, **kw) -> DiskForecast:
    spec = spec_from_config(model)
    setup = setup_from_config(cfg, default_optim="adamw_torch_fused")
    return forecast(spec, setup, SaveSettings.from_config(cfg), RunLength(steps, steps), **kw)


def test_tiny_full_fp32_is_weights_plus_two_moments():
    fc = fc_for(TINY, {"finetuning_type": "full", "save_steps": 4, "logging_steps": 1})
    p = spec_from_config(TINY).params
    assert p == 145_984
    assert fc.parts["weights"] == pytest.approx(4 * p, rel=0.01)  # fp32 safetensors
    assert fc.parts["optimizer"] == pytest.approx(8 * p, rel=0.02)  # exp_avg + exp_avg_sq, fp32, no master
    assert fc.saves == 4 and fc.kept == 4 and fc.save_every == 4
    assert fc.total_bytes == 4 * fc.checkpoint_bytes + fc.final_bytes
    assert fc.final_bytes < fc.checkpoint_bytes / 2  # the final model has no optimizer state


def test_full_bf16_saves_fp32_weights_unless_pure_bf16():
    """LLaMA-Factory upcasts trainable params to fp32 (adapter.py), so mixed bf16 saves 4 B/param;
    pure_bf16 keeps them (and AdamW's moments) in bf16."""
    p = spec_from_config(QWEN15).params
    mixed = fc_for(QWEN15, {"finetuning_type": "full", "bf16": True})
    pure = fc_for(QWEN15, {"finetuning_type": "full", "bf16": True, "pure_bf16": True})
    assert mixed.parts["weights"] == pytest.approx(4 * p, rel=1e-3)
    assert mixed.parts["optimizer"] == pytest.approx(8 * p, rel=1e-3)
    assert pure.parts["weights"] == pytest.approx(2 * p, rel=1e-3)
    assert pure.parts["optimizer"] == pytest.approx(4 * p, rel=1e-3)


def test_save_only_model_drops_the_optimizer_state():
    cfg = {"finetuning_type": "full", "bf16": True}
    full = fc_for(QWEN15, cfg)
    only = fc_for(QWEN15, {**cfg, "save_only_model": True})
    assert only.parts["optimizer"] == 0 and only.weights_only
    assert only.checkpoint_bytes == pytest.approx(full.parts["weights"], rel=1e-3)
    assert full.checkpoint_bytes / only.checkpoint_bytes == pytest.approx(3.0, rel=0.01)


def test_lora_saves_the_adapter_only():
    spec = spec_from_config(QWEN15)
    fc = fc_for(QWEN15, {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "bf16": True})
    # r x (in + out) per wrapped linear, 7 per layer
    h, kv, inter = 1536, 2 * 128, 8960
    per_layer = 8 * ((h + h) * 2 + (h + kv) * 2 + (h + inter) * 2 + (inter + h))
    trainable = per_layer * spec.num_layers
    assert fc.parts["weights"] == pytest.approx(4 * trainable, rel=0.01)
    assert fc.parts["optimizer"] == pytest.approx(8 * trainable, rel=0.01)
    full = fc_for(QWEN15, {"finetuning_type": "full", "bf16": True})
    assert fc.checkpoint_bytes < 0.01 * full.checkpoint_bytes


def test_freeze_keeps_frozen_layers_in_the_load_dtype():
    p = spec_from_config(QWEN15).params
    fc = fc_for(QWEN15, {"finetuning_type": "freeze", "freeze_trainable_layers": 2, "bf16": True})
    assert 2 * p < fc.parts["weights"] < 2.2 * p  # mostly bf16, two layers fp32


def test_deepspeed_zero2_saves_16_bit_module_twice_and_fp32_master_with_moments():
    p = spec_from_config(QWEN15).params
    cfg = {"finetuning_type": "full", "bf16": True, "deepspeed": "examples/deepspeed/ds_z2_config.json"}
    fc = fc_for(QWEN15, cfg)
    assert fc.parts["weights"] == pytest.approx(2 * p, rel=1e-3)  # model.safetensors, 16-bit
    assert fc.parts["optimizer"] == pytest.approx(2 * p + 12 * p, rel=1e-3)  # model_states + optim_states
    z3 = fc_for(QWEN15, {**cfg, "deepspeed": "examples/deepspeed/ds_z3_config.json"})
    assert z3.parts["optimizer"] == pytest.approx(12 * p, rel=1e-3)


def test_saves_follow_the_trainer_including_the_last_step():
    # save_steps 6 over 16 steps: 6, 12 and the last step (DefaultFlowCallback saves at the end)
    fc = fc_for(TINY, {"finetuning_type": "full", "save_steps": 6})
    assert fc.saves == 3
    assert [fc.save_step(k) for k in (1, 2, 3, 4)] == [6, 12, 16, None]
    assert fc.next_save_after(0) == 6 and fc.next_save_after(12) == 16 and fc.next_save_after(16) is None
    ratio = fc_for(TINY, {"finetuning_type": "full", "save_steps": 0.25})  # a ratio of the total
    assert ratio.save_every == 4 and ratio.saves == 4
    assert fc_for(TINY, {"finetuning_type": "full", "save_strategy": "no"}).saves == 0


def test_save_total_limit_caps_what_is_kept_plus_one_being_written():
    fc = fc_for(TINY, {"finetuning_type": "full", "save_steps": 2, "save_total_limit": 2})
    assert fc.saves == 8 and fc.kept == 2
    c = fc.checkpoint_bytes
    assert fc.total_bytes == max(3 * c, 2 * c + fc.final_bytes)


def test_run_length_like_the_trainer():
    # 64 rows, micro-batch 2, accumulation 2, one device, 1 epoch: 16 steps
    assert run_length({"num_train_epochs": 1.0}, 64, 2, 2, 1).total_steps == 16
    assert run_length({"num_train_epochs": 1.5}, 65, 2, 2, 1).total_steps == 26  # ceil(1.5 x ceil(33/2))
    assert run_length({"max_steps": 7}, None, 2, 2, 1).total_steps == 7
    assert run_length({}, None, 2, 2, 1).total_steps is None


def test_forecast_round_trips_through_run_state_json():
    fc = fc_for(TINY, {"finetuning_type": "full", "save_steps": 4})
    back = DiskForecast.from_dict(json.loads(json.dumps({**fc.to_dict(), "newer_key": 1})))
    assert back == fc


# ------------------------------------------------------------------------------------------ verdict


def tiny_fc(**cfg) -> DiskForecast:
    return fc_for(TINY, {"finetuning_type": "full", "save_steps": 6, **cfg})


def test_refused_when_one_checkpoint_cannot_fit():
    fc = tiny_fc()
    v = disk_verdict(fc, fc.checkpoint_bytes, "/mnt/small (tmpfs)")  # fits only without the headroom
    assert v.kind is DiskVerdictKind.REFUSE
    assert "1.8 MB" in v.message and "/mnt/small (tmpfs)" in v.message


def test_warned_with_the_step_that_fills_the_disk():
    fc = tiny_fc()
    v = disk_verdict(fc, int(1.5 * fc.checkpoint_bytes) + headroom(fc), "/mnt/small")
    assert v.kind is DiskVerdictKind.WARN and v.fits == 1 and v.fill_step == 12
    assert "step 12" in v.message and "1 of 3" in v.message


def test_ok_when_everything_fits_and_warned_when_only_the_final_model_does_not():
    fc = tiny_fc()
    assert disk_verdict(fc, fc.total_bytes + headroom(fc)).kind is DiskVerdictKind.OK
    v = disk_verdict(fc, 3 * fc.checkpoint_bytes + headroom(fc) + fc.final_bytes // 2)
    assert v.kind is DiskVerdictKind.WARN and v.fill_step == 16 and "final model" in v.message


def test_a_limit_that_fits_never_fills_the_disk():
    fc = tiny_fc(save_steps=1, save_total_limit=2)
    assert fc.saves == 16
    v = disk_verdict(fc, 3 * fc.checkpoint_bytes + fc.final_bytes + headroom(fc))
    assert v.kind is DiskVerdictKind.OK


def test_unknown_length_says_where_it_would_fill_without_warning():
    fc = fc_for(TINY, {"finetuning_type": "full", "save_steps": 6}, steps=None)
    assert fc.saves is None and fc.total_bytes is None
    v = disk_verdict(fc, 2 * fc.checkpoint_bytes + headroom(fc))
    assert v.kind is DiskVerdictKind.UNKNOWN_LENGTH and v.fill_step == 18 and "if the run gets that far" in v.message
    assert disk_verdict(fc, fc.checkpoint_bytes).kind is DiskVerdictKind.REFUSE


def test_headroom_and_the_check_before_a_save():
    fc = tiny_fc()
    assert headroom(fc) == HEADROOM_MIN_BYTES
    big = fc_for(QWEN15, {"finetuning_type": "full", "bf16": True})
    assert headroom(big) == int(0.02 * big.checkpoint_bytes)
    assert enough_for_save(fc, fc.checkpoint_bytes + headroom(fc))
    assert not enough_for_save(fc, fc.checkpoint_bytes + headroom(fc) - 1)


def test_qwen_1_5b_full_sft_figures():
    """The figures in docs/disk.md: 1.5B full SFT in bf16, 4 B weights + 8 B AdamW = 12 B/param."""
    p = spec_from_config(QWEN15).params
    assert p == 1_543_714_304
    fc = fc_for(QWEN15, {"finetuning_type": "full", "bf16": True, "save_steps": 500}, steps=3000)
    assert fc.checkpoint_bytes / GIB == pytest.approx(12 * p / GIB, rel=0.001)  # 17.3 GiB
    assert fc.saves == 6
    only = fc_for(QWEN15, {"finetuning_type": "full", "bf16": True, "save_only_model": True}, steps=3000)
    assert only.checkpoint_bytes / GIB == pytest.approx(4 * p / GIB, rel=0.001)  # 5.8 GiB
