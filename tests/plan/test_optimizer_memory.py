"""Optimizer memory by optimizer: each optimizer LLaMA-Factory can train with is sized from its own
definition (plan/memory/optimizers.py cites the lines), not as full AdamW. The expected figures are
recomputed here from those definitions on the model's real shapes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ftlaunch.errors import DoesNotFitError
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.memory.adapt import make_memory_chooser
from ftlaunch.plan.memory.optimizers import (
    CustomOptimizer,
    custom_optimizer,
    optimizer_state_bytes,
    optimizer_step_transient,
)
from ftlaunch.plan.memory.peak import GIB, estimate
from ftlaunch.plan.memory.setup import setup_from_config
from ftlaunch.plan.memory.simulate import unsupported
from ftlaunch.plan.modelspec import layer_params, linear_shapes, spec_from_config
from ftlaunch.plan.planner import plan

MODELS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "model-configs"
SPEC = spec_from_config(json.loads((MODELS / "qwen2.5-1.5b" / "config.json").read_text()))
OPTIM = ("adamw_torch", "set in the test")

# the case: Qwen2.5-1.5B full pre-training, written for bf16, planned for a V100-32GB
PT = {
    "stage": "pt",
    "do_train": True,
    "finetuning_type": "full",
    "cutoff_len": 1024,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "fp16": True,
    "optim": "adamw_torch",
}


def est(**extra):
    return estimate(SPEC, setup_from_config({**PT, **extra}))


def linears():
    return [(i, o, c) for entries in linear_shapes(SPEC).values() for i, o, c in entries]


def test_galore_moments_live_in_the_projected_space():
    adam, galore = est(), est(use_galore=True, galore_rank=16)
    P = SPEC.params
    assert adam.optimizer_gib * GIB == 8 * P  # two fp32 moments of every parameter
    # GaLore: (max x r) moments + an (r x min) projector per linear weight; AdamW moments elsewhere
    projected = sum(c * (2 * 4 * max(i, o) * 16 + 4 * 16 * min(i, o)) for i, o, c in linears())
    rest = P - sum(i * o * c for i, o, c in linears())
    assert galore.optimizer_gib * GIB == pytest.approx(projected + 8 * rest, rel=1e-9)
    assert galore.weights_gib == adam.weights_gib and galore.gradients_gib == adam.gradients_gib
    # the rank is honoured, and APOLLO's projected moments are sized alike
    assert est(use_galore=True, galore_rank=128).optimizer_gib > galore.optimizer_gib
    assert est(use_apollo=True, apollo_rank=16).optimizer_gib == pytest.approx(galore.optimizer_gib)


def test_galore_pretraining_of_a_1_5b_model_fits_a_v100():
    """Issue 30: refused on a V100-32GB when sized as full AdamW (the only way out, ZeRO-3 offload, is
    refused with GaLore); its moments are ~1.9 GiB, not 11.5, and it fits as it is."""
    hw = catalog_hardware("V100-32GB")

    def chooser():
        return make_memory_chooser(SPEC, None, headroom=0.12, default_optim=OPTIM)

    adam = plan(PT, hw, memory_chooser=chooser())
    assert "ds_z3_offload" in str(adam.config.get("deepspeed"))  # full AdamW needs offload here
    p = plan({**PT, "use_galore": True}, hw, memory_chooser=chooser())
    assert p.memory is not None and p.memory.fits and "deepspeed" not in p.config
    assert p.memory.optimizer.startswith("galore (rank 16")
    assert p.memory.estimate.optimizer_gib < 2.5
    # sized as AdamW it could not have fitted: the same setup's peak with 8 bytes of moments per parameter
    assert p.memory.peak_gib + (8 * SPEC.params / GIB - p.memory.estimate.optimizer_gib) > 32 * 0.98


def test_layerwise_galore_keeps_one_gradient_at_a_time():
    whole, layerwise = est(use_galore=True), est(use_galore=True, galore_layerwise=True, gradient_accumulation_steps=1)
    largest = max(SPEC.vocab_size * SPEC.hidden_size, max(i * o for i, o, _ in linears()))
    assert layerwise.gradients_gib * GIB == 4 * largest < whole.gradients_gib * GIB


def test_badam_trains_one_layer_in_half_precision():
    b = est(use_badam=True)
    block = layer_params(SPEC)
    assert b.trainable_params == round(block)
    # 16-bit model + an fp32 copy of the block (BlockOptimizer param_idx2hp), no fp32 upcast of the model
    assert b.weights_gib * GIB == pytest.approx(2 * SPEC.params + 4 * block, rel=1e-6)
    assert b.optimizer_gib * GIB == pytest.approx(8 * block, rel=1e-6)  # AdamW moments of the block only
    assert b.gradients_gib * GIB == pytest.approx(2 * block, rel=1e-6)
    assert b.peak_gib < est().peak_gib / 2


def test_adam_mini_keeps_m_and_one_v_per_neuron():
    m = est(use_adam_mini=True)
    # m: 4 bytes a parameter (fp32 upcast); v: one value per output row, at most params / hidden_size
    assert m.optimizer_gib * GIB == pytest.approx(4 * SPEC.params * (1 + 1 / SPEC.hidden_size))
    assert m.optimizer_gib < est().optimizer_gib / 1.9


def test_muon_keeps_one_buffer_for_matrices_and_adamw_for_the_rest():
    m = est(use_muon=True)
    mats = sum(i * o * c for i, o, c in linears())
    assert m.optimizer_gib * GIB == pytest.approx(4 * mats + 8 * (SPEC.params - mats), rel=1e-9)


def test_loraplus_is_sized_as_its_optim():
    lora = {**PT, "finetuning_type": "lora", "optim": "adamw_torch"}
    a = estimate(SPEC, setup_from_config(lora))
    b = estimate(SPEC, setup_from_config({**lora, "loraplus_lr_ratio": 16.0}))
    assert a == b and custom_optimizer({"loraplus_lr_ratio": 16}) is None


@pytest.mark.parametrize(
    ("optim", "states", "per_state"),
    [
        ("adamw_torch", 2, 4),
        ("adamw_torch_fused", 2, 4),
        ("adamw_8bit", 2, 1 + 4 / 256),
        ("paged_adamw_8bit", 2, 1 + 4 / 256),
        ("paged_adamw_32bit", 2, 4),
        ("ademamix", 3, 4),
        ("ademamix_8bit", 3, 1 + 4 / 256),
        ("grokadamw", 3, 4),
        ("lion_8bit", 1, 1 + 4 / 256),
        ("lion_32bit", 1, 4),
        ("rmsprop", 1, 4),
        ("rmsprop_bnb_8bit", 1, 1 + 4 / 256),
        ("adagrad", 1, 4),
        ("schedule_free_sgd", 1, 4),
        ("schedule_free_adamw", 2, 4),
        ("adamw_torch_4bit", 2, 0.5 + 4 / 128),
        ("sgd", 0, 0),
        ("lomo", 0, 0),
    ],
)
def test_hf_optimizers_state_bytes(optim, states, per_state):
    assert optimizer_state_bytes(optim, 4, SPEC) == pytest.approx(states * per_state)


def test_pure_bf16_halves_torch_states_but_not_bitsandbytes_32bit():
    assert optimizer_state_bytes("adamw_torch", 2, SPEC) == 4
    assert optimizer_state_bytes("paged_adamw_32bit", 2, SPEC) == 8  # bitsandbytes keeps fp32 states


def test_adafactor_is_factored():
    assert optimizer_state_bytes("adafactor", 4, SPEC) == pytest.approx(8 / SPEC.hidden_size)
    assert optimizer_step_transient("adafactor") == 0 and optimizer_step_transient("adamw_torch") == 1


def test_custom_optimizer_follows_llamafactorys_order_and_names():
    assert custom_optimizer({"use_galore": True, "galore_rank": 64, "galore_target": ["q_proj", "v_proj"]}) == (
        CustomOptimizer("galore", 64, "q_proj,v_proj", False)
    )
    assert custom_optimizer({"use_apollo": True, "apollo_layerwise": True}).layerwise
    assert custom_optimizer({"use_badam": True, "badam_mode": "ratio", "badam_update_ratio": 0.1}) == (
        CustomOptimizer("badam", badam_mode="ratio", badam_ratio=0.1)
    )
    assert custom_optimizer({"use_adam_mini": True}).kind == "adam_mini"
    assert custom_optimizer({"use_muon": True}).kind == "muon"
    # transformers' own GaLore names: rank from optim_args, default 128
    assert custom_optimizer({"optim": "galore_adamw_layerwise", "optim_args": "rank=32"}) == (
        CustomOptimizer("galore", 32, "all", True)
    )
    assert custom_optimizer({"optim": "galore_adamw"}).rank == 128
    assert custom_optimizer({"optim": "adamw_torch"}) is None


def test_galore_8bit_and_adafactor_bases():
    eight = est(use_galore=True, optim="adamw_8bit")
    fact = est(use_galore=True, optim="adafactor")
    assert fact.optimizer_gib < eight.optimizer_gib < est(use_galore=True).optimizer_gib


def test_lora_alternative_drops_galore():
    """Nothing fits: the LoRA rows turn GaLore off (LLaMA-Factory refuses LoRA with GaLore)."""
    hw = catalog_hardware("T4")
    chooser = make_memory_chooser(SPEC, None, headroom=0.12, default_optim=OPTIM)
    with pytest.raises(DoesNotFitError) as e:
        plan({**PT, "use_galore": True, "cutoff_len": 8192}, hw, memory_chooser=chooser)
    rows = {a["option"]: a for a in e.value.alternatives}
    assert rows["LoRA r=8"]["change"]["use_galore"] is False


def test_the_simulator_does_not_claim_optimizers_it_cannot_build():
    s = setup_from_config({**PT, "use_galore": True})
    assert any("galore" in u for u in unsupported(s))
    assert any("adafactor" in u for u in unsupported(replace(s, custom=None, optimizer="adafactor")))
    assert not unsupported(replace(s, custom=None, optimizer="adamw_torch_fused"))


def test_galore_on_an_optim_llamafactory_cannot_build_it_on_is_said():
    """transformers >= 4.54 defaults to adamw_torch_fused, on which LLaMA-Factory cannot build GaLore."""
    hw = catalog_hardware("A100-80GB")
    fused = ("adamw_torch_fused", "test: transformers 5 with torch 2.14")
    values = {k: v for k, v in PT.items() if k != "optim"}

    def chooser():
        return make_memory_chooser(SPEC, None, headroom=0.12, default_optim=fused)

    p = plan({**values, "use_galore": True}, hw, memory_chooser=chooser())
    assert any("NotImplementedError" in w and "optim: adamw_torch" in w for w in p.warnings)
    ok = plan({**PT, "use_galore": True}, hw, memory_chooser=chooser())
    assert not any("NotImplementedError" in w for w in ok.warnings)
