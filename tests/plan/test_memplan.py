"""The verdict (fits / tight / does not fit), the phases that follow the config, the options
offered when nothing fits, and what a refusal prints. Pure planning: no torch, no GPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import DoesNotFitError
from ftlaunch.plan.hardware import Gpu, Hardware, catalog_hardware
from ftlaunch.plan.memory.adapt import ASSUMED_HOST_RAM_PER_GPU_GIB, host_ram_for, make_memory_chooser
from ftlaunch.plan.memory.choose import (
    DOES_NOT_FIT,
    FITS,
    HARDWARE,
    METHOD,
    MIN_HEADROOM,
    NUMERICS,
    SAME_NUMBERS,
    TIGHT,
    choose_micro_batch,
    gib_pair,
    verdict_of,
)
from ftlaunch.plan.memory.peak import estimate
from ftlaunch.plan.memory.setup import TrainSetup, default_optimizer, setup_from_config
from ftlaunch.plan.modelspec import spec_from_config
from ftlaunch.plan.planner import PlanOptions, plan

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "data" / "corpus" / "model-configs"
EXAMPLES = ROOT / "tests" / "data" / "corpus" / "llamafactory-examples" / "examples"
FUSED = ("adamw_torch_fused", "test: transformers 5.6 with torch 2.14")


def spec_of(name: str):
    return spec_from_config(json.loads((MODELS / name / "config.json").read_text()))


def one_gpu(total_gib: float, cc: tuple[int, int] = (7, 0), host_ram_gib: float | None = 64.0) -> Hardware:
    gpu = Gpu(index=0, name="test card", total_mib=int(total_gib * 1024), compute_capability=cc)
    return Hardware(gpus=(gpu,), source="test", host_ram_gib=host_ram_gib)


SEED = {  # the seed's cluster config: Qwen2.5-1.5B full SFT, cutoff 1024, bf16, ZeRO-2, 8 GPUs x 8
    "model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct",
    "stage": "sft",
    "finetuning_type": "full",
    "cutoff_len": 1024,
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "bf16": True,
    "deepspeed": "examples/deepspeed/ds_z2_config.json",
}


# ============================================================ verdict


def test_verdict_thresholds() -> None:
    assert verdict_of(70.0, 80.0, 0.12) == FITS
    assert verdict_of(75.0, 80.0, 0.12) == TIGHT
    assert verdict_of(80.0 * (1 - MIN_HEADROOM) + 0.01, 80.0, 0.12) == DOES_NOT_FIT
    # a headroom below MIN_HEADROOM asked for by the user is honoured as is
    assert verdict_of(79.5, 80.0, 0.005) == FITS


def test_three_way_verdict_from_the_chooser() -> None:
    spec = spec_of("qwen2.5-1.5b")
    setup = TrainSetup(finetuning_type="full", compute_dtype="fp16", seq_len=1024, optimizer="adamw_torch_fused")
    peak = estimate(spec, replace(setup, micro_batch=1, accumulation=1)).peak_gib
    kw = dict(per_device_batch=1, headroom=0.12)
    roomy = choose_micro_batch(spec, setup, capacity_gib=peak / 0.88 * 1.001, **kw)
    assert roomy.verdict == FITS and roomy.micro_batch == 1 and roomy.headroom_share >= 0.12
    tight = choose_micro_batch(spec, setup, capacity_gib=peak / 0.95, **kw)
    assert tight.verdict == TIGHT and tight.micro_batch == 1 and tight.setup.accumulation == 1
    assert MIN_HEADROOM <= tight.headroom_share < 0.12
    assert tight.changes == ()  # tight is preferred to offload: no DeepSpeed switched on
    none = choose_micro_batch(spec, setup, capacity_gib=peak, host_ram_gib=None, **kw)
    assert none.verdict == DOES_NOT_FIT and none.micro_batch is None and none.alternatives


def test_gib_pair_tells_figures_apart() -> None:
    assert gib_pair(13.24, 13.21) == ("13.24", "13.21")
    assert gib_pair(13.249, 13.241) == ("13.25", "13.24")
    assert gib_pair(13.2404, 13.2401) == ("13.240", "13.240")  # 3 decimals at most
    assert gib_pair(31.6, 27.9) == ("31.6", "27.9")


def test_refusal_never_prints_two_equal_figures() -> None:
    spec = spec_of("qwen2.5-1.5b")
    values = {**SEED, "fp16": True, "bf16": False}
    setup = replace(setup_from_config(values, default_optim=FUSED[0]), micro_batch=1, accumulation=8)
    peak = estimate(spec, setup).peak_gib
    # a card whose tight limit sits just under the peak: both would print as the same 0.1 GiB
    hw = one_gpu((peak - 0.02) / (1 - MIN_HEADROOM), host_ram_gib=None)
    chooser = make_memory_chooser(spec, None, headroom=0.12, default_optim=FUSED)
    with pytest.raises(DoesNotFitError) as info:
        chooser(values, hw, 8, 1)
    msg = info.value.message
    shown = msg.split("peak ", 1)[1].split(" GiB at micro-batch 1 > ")
    assert shown[0] != shown[1].split(" GiB")[0], msg


# ============================================================ phases that follow the config


def test_default_optimizer_follows_installed_versions() -> None:
    assert default_optimizer("5.6.0", "2.14.1+cu130") == "adamw_torch_fused"
    assert default_optimizer("4.54.0", "2.8.0") == "adamw_torch_fused"
    assert default_optimizer("4.53.2", "2.8.0") == "adamw_torch"
    assert default_optimizer("4.57.0", "2.7.1") == "adamw_torch"
    assert default_optimizer(None, "2.9") == "adamw_torch"


def test_setup_reads_accumulation_and_default_optimizer() -> None:
    s = setup_from_config({"gradient_accumulation_steps": 4}, default_optim="adamw_torch_fused")
    assert s.accumulation == 4 and s.optimizer == "adamw_torch_fused"
    assert setup_from_config({"optim": "sgd"}, default_optim="adamw_torch_fused").optimizer == "sgd"


def test_gradients_are_alive_in_the_forward_pass_only_with_accumulation() -> None:
    spec = spec_of("qwen2.5-1.5b")
    full = TrainSetup(finetuning_type="full", compute_dtype="fp16", seq_len=1024, optimizer="adamw_torch_fused")
    one, two = (estimate(spec, replace(full, accumulation=a)) for a in (1, 2))
    assert two.tensors_gib > one.tensors_gib
    # accumulation 1: the peak is the end of backward or the step, where gradients are alive anyway
    assert one.tensors_gib >= one.weights_gib - 2 * spec.params / 2**30 + one.gradients_gib + one.optimizer_gib


def test_fused_adamw_needs_less_than_foreach() -> None:
    spec = spec_of("qwen2.5-1.5b")
    base = TrainSetup(finetuning_type="full", compute_dtype="fp16", seq_len=256, accumulation=1)
    fused = estimate(spec, replace(base, optimizer="adamw_torch_fused")).tensors_gib
    foreach = estimate(spec, replace(base, optimizer="adamw_torch")).tensors_gib
    assert foreach > fused


def test_plan_names_the_optimizer_it_assumed() -> None:
    spec = spec_of("qwen2.5-1.5b")
    chooser = make_memory_chooser(spec, None, headroom=0.12, default_optim=FUSED)
    d = chooser({**SEED, "deepspeed": None}, catalog_hardware("A100-80GB"), 8, 1)
    assert d.memory.optimizer == "adamw_torch_fused" and d.memory.optimizer_source == FUSED[1]
    d = chooser({**SEED, "deepspeed": None, "optim": "adamw_torch"}, catalog_hardware("A100-80GB"), 8, 1)
    assert d.memory.optimizer == "adamw_torch" and d.memory.optimizer_source == "config"


# ============================================================ host RAM of a what-if machine


def test_what_if_card_never_uses_this_machines_ram() -> None:
    hw = catalog_hardware("V100-32GB")
    ram, note = host_ram_for(hw)
    assert ram == round(ASSUMED_HOST_RAM_PER_GPU_GIB * hw.gpus[0].total_gib)
    assert note and "assumed" in note and "--host-ram" in note
    assert host_ram_for(catalog_hardware("V100-32GB", host_ram_gib=500.0)) == (500.0, None)
    assert host_ram_for(one_gpu(16, host_ram_gib=23.0)) == (23.0, None)
    assert host_ram_for(one_gpu(16, host_ram_gib=None)) == (None, None)


# ============================================================ the "Done when" cases


def _plan(values: dict, card: str, source_gpus: int, spec) -> object:
    chooser = make_memory_chooser(spec, None, headroom=0.12, default_optim=FUSED)
    return plan(values, catalog_hardware(card), PlanOptions(source_gpus=source_gpus), memory_chooser=chooser)


def test_seed_case_plans_on_v100_keeping_full_finetuning_and_the_global_batch() -> None:
    p = _plan(SEED, "V100-32GB", 8, spec_of("qwen2.5-1.5b"))
    assert p.global_batch_target == p.global_batch_source == 64
    assert p.micro_batch == 1 and p.accumulation == 64
    assert p.config["finetuning_type"] == "full" and p.config["cutoff_len"] == 1024 and p.config["fp16"] is True
    assert p.memory.verdict in (FITS, TIGHT)
    if p.memory.verdict == TIGHT:
        reason = next(c.reason for c in p.changes if c.key == "gradient_accumulation_steps")
        assert "TIGHT" in reason and "headroom" in reason
        assert any(w.startswith("tight:") for w in p.warnings)


def test_upstream_qwen3_full_sft_plans_on_a100_80gb() -> None:
    import yaml

    values = yaml.safe_load((EXAMPLES / "train_full" / "qwen3_full_sft.yaml").read_text())
    values["deepspeed"] = None  # one device: the planner drops it anyway
    p = _plan(values, "A100-80GB", 1, spec_of("qwen3-4b"))
    assert p.memory.verdict in (FITS, TIGHT)
    assert p.config["finetuning_type"] == "full" and p.config["cutoff_len"] == 2048


def test_8b_full_sft_on_t4_offers_offload_first_then_numerics_then_method() -> None:
    values = {"finetuning_type": "full", "cutoff_len": 1024, "fp16": True, "per_device_train_batch_size": 1}
    with pytest.raises(DoesNotFitError) as info:
        _plan(values, "T4", 1, spec_of("llama3-8b"))
    alts = info.value.alternatives
    order = [SAME_NUMBERS, NUMERICS, METHOD, HARDWARE]
    kinds = [a["kind"] for a in alts]
    assert kinds == sorted(kinds, key=order.index)
    assert "offload" in alts[0]["option"].lower() and alts[0]["kind"] == SAME_NUMBERS
    for a in alts:
        assert set(a) >= {"option", "kind", "peak_gib", "host_gib", "fits", "change", "speed"}
        if not a["fits"]:
            assert a["why"]
    offload = next(a for a in alts if a["option"] == "ZeRO-3 CPU offload")
    # the T4 machine's RAM is assumed, never this machine's; the row says so when it decides
    if not offload["fits"] and offload["peak_gib"] < 15:
        assert "host RAM" in offload["why"] and "assumed" in offload["why"]
    assert any(a["fits"] for a in alts if a["kind"] == METHOD)
    payload = info.value.payload
    assert payload["memory"]["verdict"] == DOES_NOT_FIT and payload["memory"]["alternatives"] == alts


def test_plan_json_prints_the_whole_object_on_refusal(tmp_path) -> None:
    cfg = tmp_path / "full8b.yaml"
    cfg.write_text(
        "model_name_or_path: meta-llama/Meta-Llama-3-8B\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
        "dataset: alpaca_en_demo\ntemplate: llama3\ncutoff_len: 1024\noutput_dir: out\n"
        "per_device_train_batch_size: 1\nfp16: true\n"
    )
    args = ["plan", str(cfg), "--gpu", "T4", "--model-config", str(MODELS / "llama3-8b" / "config.json"), "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 5
    d = json.loads(r.stdout)
    assert d["memory"]["verdict"] == DOES_NOT_FIT
    assert d["alternatives"] and d["alternatives"][0]["kind"] == SAME_NUMBERS
    assert d["hardware"]["gpus"][0]["name"] == "Tesla T4" and d["config"]["finetuning_type"] == "full"
    assert "does not fit" not in r.stdout.split("{", 1)[0]  # stdout is the JSON object only


# ============================================================ observed peaks


def test_observed_peak_is_kept_and_only_raises_later_predictions(isolated_home) -> None:
    from ftlaunch.plan.memory.store import correction_from, recall, remember, remember_observed

    env = {"FTLAUNCH_HOME": str(isolated_home)}
    remember_observed(env, "k:V100", observed_peak_gib=31.0, predicted_peak_gib=30.0, micro_batch=1)
    remember_observed(env, "k:V100", observed_peak_gib=30.5, predicted_peak_gib=30.0, micro_batch=1)  # smaller
    remember(env, "k:V100", {"per_device_train_batch_size": 1}, "OOM")  # keeps the observation
    obs = recall(env, "k:V100")["observed"]
    assert obs["observed_peak_gib"] == 31.0
    factor, why = correction_from(obs)
    assert factor == pytest.approx(31 / 30) and "31.00 GiB" in why
    assert correction_from({"observed_peak_gib": 20.0, "predicted_peak_gib": 30.0, "micro_batch": 1}) == (1.0, None)

    spec = spec_of("qwen2.5-1.5b")
    values = {**SEED, "deepspeed": None}
    plain = make_memory_chooser(spec, None, headroom=0.12, default_optim=FUSED)
    seen = make_memory_chooser(spec, None, headroom=0.12, default_optim=FUSED, observed=obs)
    a, b = (c(values, catalog_hardware("A100-80GB"), 1, 1) for c in (plain, seen))
    assert b.memory.peak_gib == pytest.approx(a.memory.peak_gib * 31 / 30)
    assert b.memory.correction_note and any("31.00 GiB" in w for w in b.warnings)


def test_simulate_plan_without_a_config_json_says_why_and_keeps_the_formula() -> None:
    from ftlaunch.plan.memory.simulate import simulate_plan

    spec = spec_of("qwen2.5-1.5b")
    chooser = make_memory_chooser(spec, None, headroom=0.12, default_optim=FUSED)
    p = plan({**SEED, "deepspeed": None}, catalog_hardware("A100-80GB"), memory_chooser=chooser)
    out = simulate_plan(p, None, python="/nonexistent/python")  # a hub id, no local config.json
    assert out["error"] == "no config.json to build the model from"
    assert out["formula_peak_gib"] == p.memory.peak_gib and "simulated_peak_gib" not in out
    liger = plan(
        {**SEED, "deepspeed": None, "enable_liger_kernel": True}, catalog_hardware("A100-80GB"), memory_chooser=chooser
    )
    out = simulate_plan(liger, None, python="/nonexistent/python")
    assert any("enable_liger_kernel" in u for u in out["unsupported"]) and "simulated_peak_gib" not in out
