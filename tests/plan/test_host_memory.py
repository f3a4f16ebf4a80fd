"""A plan without a GPU gets the same three-way memory verdict as a card, against host RAM: fp32
weights, gradients, optimizer states and activations plus the trainer's own resident set."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftlaunch.errors import DoesNotFitError
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.memory.adapt import make_memory_chooser
from ftlaunch.plan.memory.host import (
    CHECKPOINT_BYTES,
    HOST_BASE_GIB,
    HOST_BASE_SPREAD_GIB,
    HOST_SLACK,
    choose_on_host,
    host_estimate,
)
from ftlaunch.plan.memory.peak import GIB, estimate
from ftlaunch.plan.memory.prediction import Verdict
from ftlaunch.plan.memory.setup import setup_from_config
from ftlaunch.plan.modelspec import spec_from_config
from ftlaunch.plan.planner import plan

from ..conftest import needs_train_stack

MODELS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "model-configs"
OPTIM = ("adamw_torch", "set in the test")


def spec_of(name: str):
    return spec_from_config(json.loads((MODELS / name / "config.json").read_text()))


FULL = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "full",
    "cutoff_len": 1024,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "bf16": True,
    "optim": "adamw_torch",
}


def cpu_plan(values, spec, host_ram, headroom=0.12):
    chooser = make_memory_chooser(spec, None, headroom=headroom, default_optim=OPTIM)
    return plan(values, catalog_hardware("none", host_ram_gib=host_ram), memory_chooser=chooser)


def test_host_estimate_is_fp32_tensors_plus_the_trainers_own_memory():
    spec = spec_of("qwen2.5-1.5b")
    setup = setup_from_config({**FULL, "bf16": False, "per_device_train_batch_size": 1})
    est = host_estimate(spec, setup)
    tensors = estimate(spec, setup).tensors_gib  # the GPU model's tensors, without the CUDA overhead
    assert est.tensors_gib == pytest.approx(tensors)
    assert est.peak_gib == pytest.approx(tensors * (1 + HOST_SLACK) + HOST_BASE_GIB)  # training peak > loading
    # LoRA: the loading peak (checkpoint pages + the fp32 copy) is larger than a step's tensors
    lora = host_estimate(spec, setup_from_config({**FULL, "finetuning_type": "lora", "cutoff_len": 64}))
    loading = spec.params * (CHECKPOINT_BYTES + 4) / GIB
    assert lora.tensors_gib < loading and lora.peak_gib == pytest.approx(loading + HOST_BASE_GIB)
    # fp32 whatever the config asked for: weights + gradients + AdamW moments = 16 bytes a parameter
    assert (est.weights_gib + est.gradients_gib + est.optimizer_gib) * GIB == pytest.approx(16 * spec.params)
    bf16 = host_estimate(spec, setup_from_config({**FULL, "per_device_train_batch_size": 1}))
    assert bf16.peak_gib == pytest.approx(est.peak_gib)


def test_full_fine_tuning_of_an_8b_model_is_refused_on_a_30_gib_host():
    """Issue 30: fp32 weights plus gradients alone are ~60 GiB; it used to plan with exit 0."""
    spec = spec_of("llama3-8b")
    with pytest.raises(DoesNotFitError) as e:
        cpu_plan(FULL, spec, 30.0)
    msg = " ".join(e.value.message.split())
    assert "on the CPU (fp32)" in msg and "30 GiB of host RAM" in msg and "OOM killer" in msg
    rows = {a["option"]: a for a in e.value.alternatives}
    assert {"LoRA r=8", "cutoff_len 512"} <= set(rows)
    gpu = [a for a in e.value.alternatives if a["kind"] == "hardware"]
    # no single catalog card holds 8B of full AdamW: ZeRO-3 over the fewest A100-80GBs that do
    assert len(gpu) == 1 and gpu[0]["fits"] and gpu[0]["change"]["deepspeed"] == "ds_z3"
    assert gpu[0]["change"]["gpu"].startswith("A100-80GBx")
    small = {**FULL, "finetuning_type": "lora"}
    with pytest.raises(DoesNotFitError) as e2:
        cpu_plan(small, spec, 16.0)
    one = [a for a in e2.value.alternatives if a["kind"] == "hardware"]
    assert one[0]["option"].startswith("a GPU: ") and one[0]["fits"]
    assert e.value.payload["memory"]["device"] == "host"
    assert e.value.payload["memory"]["verdict"] == "does_not_fit"


def test_lora_of_a_1_5b_model_fits_and_says_so():
    spec = spec_of("qwen2.5-1.5b")
    p = cpu_plan({**FULL, "finetuning_type": "lora", "cutoff_len": 512}, spec, 30.0)
    m = p.memory
    assert m is not None and m.device == "host" and m.verdict is Verdict.FITS
    assert m.capacity_gib == 30.0 and m.peak_gib <= 30.0 * 0.88
    assert p.precision == "fp32" and not p.config.get("bf16")
    assert p.micro_batch * p.accumulation == 8  # the global batch is kept


def test_tight_is_a_warning_and_the_largest_fitting_micro_batch_is_taken():
    spec = spec_of("qwen2.5-1.5b")
    setup = setup_from_config({**FULL, "bf16": False})
    need = host_estimate(spec, replace(setup, micro_batch=1, accumulation=8)).peak_gib
    # RAM between the peak at micro-batch 1 and the 12% headroom above it: tight
    ram = need / 0.95
    p = cpu_plan(FULL, spec, ram)
    assert p.memory.verdict is Verdict.TIGHT
    peaks = dict(p.memory.tried)
    assert peaks[p.micro_batch] <= ram * 0.98 and all(peaks[b] > ram * 0.98 for b in peaks if b > p.micro_batch)
    assert any("tight: predicted host peak" in w for w in p.warnings)
    # plenty of RAM: the micro-batch the config asked for
    roomy = cpu_plan(FULL, spec, 512.0)
    assert roomy.memory.verdict is Verdict.FITS and roomy.micro_batch == 8  # largest dividing 4 x 2
    tried = choose_on_host(spec, setup, host_ram_gib=ram, per_device_batch=8).tried
    assert [b for b, _ in tried][:2] == [8, 4] and all(a > b for (_, a), (_, b) in zip(tried, tried[1:], strict=False))


def test_a_70b_lora_at_cutoff_20k_is_refused_on_30_gib():
    spec = spec_from_config(
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "intermediate_size": 28672,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
        }
    )
    with pytest.raises(DoesNotFitError):
        cpu_plan({**FULL, "finetuning_type": "lora", "cutoff_len": 20000}, spec, 30.0)


def test_without_a_model_size_there_is_no_verdict():
    p = plan(FULL, catalog_hardware("none", host_ram_gib=30.0))
    assert p.memory is None


def test_plan_gpu_none_uses_this_machines_ram_or_host_ram(tmp_path, monkeypatch):
    from ftlaunch.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in FULL.items()))
    mc = str(MODELS / "llama3-8b" / "config.json")
    runner = CliRunner()
    r = runner.invoke(main, ["plan", str(cfg), "--gpu", "none", "--host-ram", "30", "--model-config", mc, "--json"])
    assert r.exit_code == 5, r.output
    d = json.loads(r.stdout)
    assert d["memory"]["device"] == "host" and any(a["option"] == "LoRA r=8" for a in d["alternatives"])
    # without --host-ram: this machine's RAM, probed (psutil) in the shell, named in the plan
    monkeypatch.setattr("ftlaunch.run.prepare.host_memory", lambda: (512.0, 400.0))
    r = runner.invoke(main, ["plan", str(cfg), "--gpu", "none", "--model-config", mc, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["memory"]["capacity_gib"] == 512.0 and "this machine's" in d["memory"]["host_ram_note"]


@pytest.mark.e2e
@needs_train_stack
def test_a_real_cpu_run_peaks_near_the_prediction(tiny, tmp_path):
    """The tiny model trained for real on the CPU (llamafactory-cli, 4 steps): its process tree's peak
    resident set against the plan's host prediction (scripts/bench_host_memory.py samples it)."""
    import importlib.util

    from ftlaunch.plan.config import dump_yaml
    from ftlaunch.run.prepare import PlanRequest, make_plan

    from ..conftest import ROOT, tiny_config, write_yaml

    spec = importlib.util.spec_from_file_location("bench_host_memory", ROOT / "scripts" / "bench_host_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, tmp_path / "out", max_steps=4, save_steps=4))
    _, p = make_plan(PlanRequest(config=str(cfg), gpu="none", host_ram_gib=64.0), {})
    assert p.memory is not None and p.memory.device == "host" and p.memory.verdict is Verdict.FITS
    adapted = tmp_path / "adapted.yaml"
    adapted.write_text(dump_yaml(p.config))
    got = bench.measure(adapted, tmp_path / "train.log")["peak_rss_gib"]
    # 10% of the peak, or the interpreter base's spread between machines, whichever is larger: the
    # tiny model's peak is almost all base (torch, transformers, datasets), measured 1.14-1.28 GiB
    # here and 1.36 GiB on the CI's machine; a larger model's tensors are held to the 10%
    allowed = max(0.10 * got, HOST_BASE_SPREAD_GIB)
    assert abs(p.memory.peak_gib - got) <= allowed, (p.memory.peak_gib, got)
