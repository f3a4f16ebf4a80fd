"""The simulator (ftlaunch.plan.memory.simulate): what it measures on fake tensors, what it refuses, and that
planning never imports torch because of it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.memory.simulate import run_child, unsupported
from ftlaunch.plan.memory.states import trainable_params
from ftlaunch.plan.modelspec import spec_from_config

from ..helpers import said

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "data" / "corpus" / "model-configs"
EXAMPLES = ROOT / "tests" / "data" / "corpus" / "llamafactory-examples"
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
}
SETUP = TrainSetup(
    finetuning_type="full", compute_dtype="fp16", optimizer="adamw_torch_fused", micro_batch=2, seq_len=32
)


def test_import_and_plain_plan_stay_torch_free() -> None:
    code = (
        "import sys\nimport ftlaunch, ftlaunch.plan.memory.simulate, ftlaunch.plan.memory.adapt\n"
        "from ftlaunch.cli.main import main\n"
        "try:\n main(['plan','examples/train_full/qwen3_full_sft.yaml','--gpu','A100-80GB','--json',"
        f"'--model-config','{MODELS / 'qwen3-4b' / 'config.json'}'])\nexcept SystemExit: pass\n"
        "print('HEAVY', [m for m in ('torch','transformers','peft') if m in sys.modules], file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLES, capture_output=True, text=True, timeout=60)
    assert said("HEAVY []", r.stderr), r.stderr
    assert json.loads(r.stdout)["memory"]["verdict"] in ("fits", "tight")


def test_what_cannot_be_simulated_is_named_and_never_started() -> None:
    qlora = replace(SETUP, finetuning_type="lora", quantization_bit=4)
    assert any("bitsandbytes" in u for u in unsupported(qlora))
    assert any("DeepSpeed" in u for u in unsupported(replace(SETUP, zero_stage=3)))
    assert any("flash-attention" in u for u in unsupported(replace(SETUP, attn_impl="fa2")))
    assert any("bitsandbytes" in u for u in unsupported(replace(SETUP, optimizer="paged_adamw_8bit")))
    assert unsupported(SETUP) == ()
    moe = {**TINY, "model_type": "qwen2_moe", "num_experts": 4}
    assert any("MoE" in u for u in unsupported(SETUP, moe))  # experts upcast to fp32
    assert unsupported(replace(SETUP, pure_bf16=True, compute_dtype="bf16"), moe) == ()
    assert unsupported(replace(SETUP, finetuning_type="lora"), moe) == ()
    res = run_child(TINY, qlora, python="/nonexistent/python")  # would fail if it tried to start
    assert res.peak_gib is None and res.unsupported and res.error is None


# These run torch (in this process or a child): ~10-25 s each on a loaded 2-core machine, so they
# are in the slow lane with the other tests that run the real training stack.


@pytest.fixture(scope="module")
def simulate():
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from ftlaunch.plan.memory.simulate import simulate as run

    return run


def _bytes(result, kind: str) -> float:
    return result.by_kind_bytes.get(kind, 0)


@pytest.mark.e2e
def test_full_finetuning_holds_fp32_params_and_two_adam_states(simulate) -> None:
    spec = spec_from_config(TINY)
    res = simulate(TINY, SETUP)
    assert res.peak_gib is not None and not res.unsupported
    # llamafactory upcasts trainable params to fp32: 4 bytes each; AdamW keeps two fp32 moments
    assert _bytes(res, "Parameter") == pytest.approx(4 * spec.params, rel=0.01)
    assert _bytes(res, "Optstate") == pytest.approx(8 * spec.params, rel=0.02)
    assert res.peak_gib * 2**30 >= 16 * spec.params


@pytest.mark.e2e
def test_lora_trains_exactly_the_adapters_the_formula_counts(simulate) -> None:
    spec = spec_from_config(TINY)
    lora = replace(SETUP, finetuning_type="lora", lora_rank=4, lora_target="all")
    res = simulate(TINY, lora)
    t = trainable_params(spec, lora)
    assert _bytes(res, "Optstate") == pytest.approx(8 * t, rel=0.05)
    # the frozen base stays in the compute dtype (2 bytes), the adapters in fp32
    assert _bytes(res, "Parameter") == pytest.approx(2 * spec.params + 4 * t, rel=0.01)


@pytest.mark.e2e
def test_accumulation_keeps_gradients_alive_into_the_next_forward(simulate) -> None:
    one = simulate(TINY, replace(SETUP, accumulation=1))
    two = simulate(TINY, replace(SETUP, accumulation=2))
    assert two.peak_gib >= one.peak_gib


@pytest.mark.e2e
def test_child_process_round_trip() -> None:
    pytest.importorskip("torch")
    res = run_child(TINY, SETUP, timeout=300)
    assert res.error is None and res.peak_gib and res.peak_gib > 0 and res.seconds > 0


@pytest.mark.e2e
def test_plan_simulate_uses_the_model_config_it_is_given(tmp_path) -> None:
    """`ftlaunch plan CFG --gpu CARD --model-config FILE --simulate --json`: the simulator builds the
    model from FILE (the CLI must pass it on) and reports its peak beside the formula's."""
    import json

    from click.testing import CliRunner

    from ftlaunch.cli.main import main

    pytest.importorskip("torch")
    model_config = tmp_path / "config.json"
    model_config.write_text(json.dumps(TINY))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "model_name_or_path: org/not-on-disk\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
        "dataset: demo\ntemplate: llama3\ncutoff_len: 32\nper_device_train_batch_size: 2\n"
        f"fp16: true\noutput_dir: {tmp_path / 'out'}\n"
    )
    r = CliRunner().invoke(
        main, ["plan", str(cfg), "--gpu", "A10G", "--model-config", str(model_config), "--simulate", "--json"]
    )
    assert r.exit_code == 0, r.output
    sim = json.loads(r.stdout)["memory"]["simulated"]
    assert sim.get("error") is None and sim["simulated_peak_gib"] > 0 and sim["formula_peak_gib"] > 0
