"""The memory table as values (plan/memory/prediction.py): plan.json's shape key for key and in order,
read back the same, the verdict an enum the simulator compares, and does-not-fit rows that keep where
the trainer's refusal stands."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.memory.adapt import make_memory_chooser
from ftlaunch.plan.memory.choose import choose_micro_batch
from ftlaunch.plan.memory.prediction import Alternative, Kind, MemoryPrediction, Verdict, memory_json
from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.memory.simulate import simulation_wanted, with_simulation
from ftlaunch.plan.modelspec import spec_from_config
from ftlaunch.plan.planner import plan

MODELS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "model-configs"
PLAN_JSON_KEYS = [  # plan.json's "memory", in the order it is written
    "weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "logits_gib", "overhead_gib",
    "peak_gib", "host_gib", "trainable_params", "transient_gib", "tensors_gib", "capacity_gib",
    "usable_gib", "headroom", "verdict", "headroom_gib", "headroom_share", "fits", "tried",
    "model_params", "optimizer", "optimizer_source", "host_ram_gib", "host_ram_note", "correction",
    "correction_note", "device",
]  # fmt: skip
SEED = {"model_name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "stage": "sft", "do_train": True,
        "finetuning_type": "full", "cutoff_len": 1024, "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 8, "bf16": True}  # fmt: skip


def spec_of(name: str):
    return spec_from_config(json.loads((MODELS / name / "config.json").read_text()))


def planned(gpu: str):
    chooser = make_memory_chooser(
        spec_of("qwen2.5-1.5b"), None, headroom=0.12, default_optim=("adamw_torch", "test: the foreach default")
    )
    return plan(SEED, catalog_hardware(gpu), memory_chooser=chooser)


def test_plan_json_memory_keeps_its_keys_in_order_and_reads_back_the_same():
    p = planned("A100-80GB")
    d = p.to_dict()["memory"]
    assert list(d) == PLAN_JSON_KEYS
    assert d["verdict"] == "fits" and type(d["verdict"]) is str and d["fits"] is True
    assert d["tried"] and all(isinstance(t, list) for t in d["tried"])
    text = json.dumps(d)
    back = MemoryPrediction.from_dict(json.loads(text))
    assert back == p.memory and json.dumps(back.to_dict()) == text
    assert MemoryPrediction.from_dict(None) is None and MemoryPrediction.from_dict({"peak_gib": 3.0}) is None


def test_tight_is_an_enum_the_simulator_compares_and_its_result_sits_beside_the_prediction():
    fits = planned("A100-80GB")
    p = replace(fits, memory=replace(fits.memory, verdict=Verdict.TIGHT))
    assert p.memory.fits and p.to_dict()["memory"]["verdict"] == "tight"
    assert simulation_wanted(p, None) and not simulation_wanted(p, False)
    assert not simulation_wanted(fits, None) and simulation_wanted(fits, True)
    sim = {"simulated_peak_gib": 99.0, "formula_peak_gib": p.memory.peak_gib}
    s = with_simulation(p, sim)
    assert s.memory == p.memory and s.to_dict()["memory"] == {**p.memory.to_dict(), "simulated": sim}
    assert any("above the card's" in w for w in s.warnings)
    # no prediction (no model shape), still a measurement: plan.json keeps it alone
    assert memory_json(None, {"error": "no GPU"}) == {"simulated": {"error": "no GPU"}} and memory_json(None) is None


def test_does_not_fit_rows_are_typed_and_a_refusal_replaces_the_reason_where_it_stood():
    refused = "DeepSpeed is not installed"
    c = choose_micro_batch(spec_of("llama3-8b"), TrainSetup(finetuning_type="full"), capacity_gib=24,
                           per_device_batch=1, host_ram_gib=512, deepspeed_refused=refused)  # fmt: skip
    assert c.verdict is Verdict.DOES_NOT_FIT and c.micro_batch is None
    assert all(isinstance(a, Alternative) and isinstance(a.kind, Kind) for a in c.alternatives)
    off = next(a for a in c.alternatives if a.option == "ZeRO-3 CPU offload")
    # the offload would fit on the card and in 512 GiB: only the refusal says no, and it comes last
    assert off.refused and not off.fits and off.verdict is Verdict.DOES_NOT_FIT and off.why is None
    row = off.to_dict()
    assert list(row)[-2:] == ["host_ram_gib", "why"] and row["why"] == "DeepSpeed is not installed"
    # where a memory reason stood, the refusal takes its place (before host_ram_gib)
    moved = replace(off, why="peak 30.0 GiB > 23.5 GiB").to_dict()
    assert list(moved)[-2:] == ["why", "host_ram_gib"] and moved["why"] == "DeepSpeed is not installed"
    assert Alternative.from_dict(row).reason == "DeepSpeed is not installed"
    assert [Alternative.from_dict(a.to_dict()).to_dict() for a in c.alternatives if not a.refused] == [
        a.to_dict() for a in c.alternatives if not a.refused
    ]
