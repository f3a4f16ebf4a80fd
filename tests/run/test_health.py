"""The numeric-health judge and the remedy ladder, on sequences recorded from the real tiny model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ftlaunch.run import health as h
from ftlaunch.run import rollback

from ..conftest import needs_train_stack

DATA = Path(__file__).parent.parent / "data" / "health"


def recorded(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def recs(losses, grads=None) -> list[dict]:
    out = []
    for i, loss in enumerate(losses, 1):
        r = {"current_steps": i, "total_steps": len(losses), "loss": loss}
        if grads is not None:
            r["grad_norm"] = grads[i - 1]
        out.append(r)
    return out


def wobble(n: int, base: float = 2.0) -> list[float]:
    """A live loss: never the same twice in a row (a constant one is a dead model, FLAT_LOSS)."""
    return [base + 0.01 * (i % 3) for i in range(n)]


# ---------------------------------------------------------------- recorded from llamafactory-cli


def test_real_nan_hidden_by_logging_nan_inf_filter_is_caught():
    # lr 1e20, fp32 on the CPU, HF default logging_nan_inf_filter: the NaN loss is logged as 0.0
    v = h.judge(recorded("nan_filtered_lr1e20.jsonl"))
    assert v.diverged and v.first_bad.signal is h.Signal.HIDDEN_NAN
    assert v.first_bad.step == 2 and v.last_good_step == 1


def test_real_nan_token_is_caught():
    # the same run with logging_nan_inf_filter: false writes a bare NaN token
    v = h.judge(recorded("nan_unfiltered_lr1e20.jsonl"))
    assert v.diverged and v.first_bad.signal is h.Signal.NONFINITE_LOSS and v.first_bad.step == 2


def test_real_lr1e8_last_good_record_is_before_the_zero():
    v = h.judge(recorded("nan_filtered_lr1e8.jsonl"))
    assert v.first_bad.step == 3 and v.last_good_step == 2


def test_real_checkpoint_history_with_nan_grad_norm_is_not_clean():
    hist = json.loads((DATA / "checkpoint4_log_history_nan.json").read_text())
    assert not h.history_is_clean(hist)
    assert h.history_is_clean(hist[:1])  # step 1 alone was fine


def test_real_single_early_spike_is_a_divergence_even_with_one_loss_of_history():
    # lr 1000: 6.23 at step 1, 2.1e7 at step 2 (no median exists yet), then a flat dead loss
    v = h.judge(recorded("collapse_lr1000.jsonl"))
    assert v.diverged and v.first_bad.signal is h.Signal.HUGE_SPIKE
    assert (v.first_bad.step, v.last_good_step) == (2, 1)
    # without the huge-spike rule the dead model after it is caught: the same loss from step 3 on
    v = h.judge(recorded("collapse_lr1000.jsonl"), h.thresholds_from("huge_spike_factor=1e9"))
    assert v.first_bad.signal is h.Signal.FLAT_LOSS and v.first_bad.step == 3
    assert v.first_bad.values["consecutive"] == 5
    loose = h.thresholds_from("huge_spike_factor=1e9,dead_steps=100")
    assert not h.judge(recorded("collapse_lr1000.jsonl"), loose).diverged  # the thresholds are the user's


def real_lr1e4(with_console: bool = True) -> list[dict]:
    """lr 1e4, save_steps 8 (issue 23): grad_norm 0 and loss 6.2106008 +- 5e-7 from step 2 to 24."""
    rows = recorded("lr1e4_save8.jsonl")
    if with_console:
        norms = [h.parse_console(line)[0]["grad_norm"] for line in (DATA / "lr1e4_save8.console.txt").open()]
        rows = [{**r, "grad_norm": norms[i]} if "loss" in r else r for i, r in enumerate(rows)]
    return rows


def test_real_dead_model_lr1e4_is_caught_by_grad_norm_zero_and_by_the_flat_loss_alone():
    v = h.judge(real_lr1e4())
    assert v.diverged and v.first_bad.signal is h.Signal.ZERO_GRAD_NORM
    assert (v.first_bad.step, v.last_good_step, v.records) == (2, 1, 25)
    v = h.judge(real_lr1e4(with_console=False))  # trainer_log.jsonl alone: no grad_norm there
    assert v.first_bad.signal is h.Signal.FLAT_LOSS and (v.first_bad.step, v.last_good_step) == (2, 1)
    assert not h.judge(real_lr1e4(), h.thresholds_from("dead_steps=30")).diverged  # 23 dead records < 30
    assert h.judge(real_lr1e4(), h.thresholds_from("dead_steps=20")).first_bad.step == 2
    # float32 noise in the dead loss is 8e-8 relative: below that tolerance only the same value five
    # times in a row counts (steps 12-16)
    v = h.judge(real_lr1e4(with_console=False), h.thresholds_from("flat_rtol=1e-9"))
    assert (v.first_bad.step, v.last_good_step) == (12, 11)


def test_zero_grad_norm_and_flat_loss_need_several_records_in_a_row():
    grads = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert not h.judge(recs(wobble(7), grads)).diverged
    v = h.judge(recs(wobble(8), [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]))
    assert v.first_bad.signal is h.Signal.ZERO_GRAD_NORM and (v.first_bad.step, v.last_good_step) == (3, 2)
    assert not h.judge(recs([2.0, 1.9, 1.9, 1.9, 1.9, 1.8])).diverged
    v = h.judge(recs([2.0, 1.9, 1.9, 1.9, 1.9, 1.9]))
    assert v.first_bad.signal is h.Signal.FLAT_LOSS and (v.first_bad.step, v.last_good_step) == (2, 1)


# ---------------------------------------------------------------- the judge's rules


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "nan", "NaN", "Infinity", "-inf", "garbage"])
def test_non_finite_loss_in_any_spelling(bad):
    v = h.judge(recs([2.0, 1.9, bad, 1.8]))
    assert v.diverged and v.first_bad.step == 3 and v.last_good_step == 2


def test_json_nan_tokens_parse_as_llamafactory_writes_them():
    line = '{"current_steps": 7, "loss": NaN, "lr": 1e+20}'
    v = h.judge([json.loads(line)])
    assert v.diverged and v.first_bad.step == 7


def test_zero_loss_before_any_positive_loss_is_not_hidden_nan():
    assert not h.judge(recs([0.0, 0.0])).diverged
    assert not h.judge(recs([2.0, 0.0]), h.Thresholds(zero_loss_is_nan=False)).diverged


def test_non_finite_grad_norm_diverges_outside_fp16():
    v = h.judge(recs([2.0, 2.0, 2.0], grads=[1.0, float("nan"), 1.0]))
    assert v.diverged and v.first_bad.signal is h.Signal.NONFINITE_GRAD_NORM and v.first_bad.step == 2


def test_fp16_scaler_skips_are_tolerated_until_sustained():
    grads = [float("inf")] * 9 + [1.0] * 3
    assert h.judge(recs(wobble(12), grads), fp16=True).health is h.Health.FINITE
    grads = [1.0, 1.0] + [float("inf")] * 10
    v = h.judge(recs(wobble(12), grads), fp16=True)
    assert v.diverged and v.first_bad.signal is h.Signal.SCALER_SKIPS
    assert v.first_bad.step == 3 and v.last_good_step == 2 and v.first_bad.values["consecutive"] == 10


def test_single_spike_is_spiky_not_diverged_and_fades():
    losses = wobble(10) + [9.0] + wobble(5)
    v = h.judge(recs(losses))
    assert v.health is h.Health.SPIKY and not v.diverged
    v = h.judge(recs(losses + wobble(20)))
    assert v.health is h.Health.FINITE


def test_sustained_spike_diverges_at_its_first_record():
    losses = [2.0, 2.1, 1.9, 2.0, 2.0, 2.0, 7.0, 8.0, 9.0, 2.0]
    v = h.judge(recs(losses))
    assert v.diverged and v.first_bad.signal is h.Signal.LOSS_SPIKE
    assert v.first_bad.step == 7 and v.last_good_step == 6 and v.first_bad.values["sustained"] == 3


def test_spike_needs_history_and_factor():
    assert not h.judge(recs([2.0, 9.0, 9.1, 9.0])).diverged  # fewer than min_history losses first
    assert not h.judge(recs(wobble(6) + wobble(5, 5.9))).diverged  # below 3x the median
    assert h.judge(recs(wobble(6) + wobble(5, 5.9)), h.Thresholds(spike_factor=2.5)).diverged
    # 100x the first losses is a divergence at once, after a single loss of history
    v = h.judge(recs([2.0, 250.0]))
    assert v.first_bad.signal is h.Signal.HUGE_SPIKE and v.first_bad.values == {"loss": 250.0, "first_losses": 2.0}
    assert not h.judge(recs([2.0, 150.0]), h.Thresholds(huge_spike_factor=1000)).diverged


def test_slow_decline_and_eval_records_are_fine():
    rows = recs([3.0 - 0.01 * i for i in range(200)])
    rows.insert(50, {"current_steps": 50, "eval_loss": 2.5})
    rows.append({"current_steps": 200, "total_steps": 200, "epoch": 1.0})  # the summary record
    v = h.judge(rows)
    assert v.health is h.Health.FINITE and v.last_good_step == 200


def test_diverged_is_sticky():
    v = h.judge(recs([2.0, float("nan"), 2.1, 2.0]))
    assert v.diverged and v.first_bad.step == 2 and v.records == 4


def test_thresholds_from_text():
    t = h.thresholds_from("spike_factor=4, window=50,zero_loss_is_nan=false")
    assert (t.spike_factor, t.window, t.zero_loss_is_nan, t.sustain) == (4.0, 50, False, 3)
    with pytest.raises(ValueError):
        h.thresholds_from("nope=1")
    with pytest.raises(ValueError):
        h.thresholds_from("window=0")


# ---------------------------------------------------------------- the remedy ladder

BATCH_KEYS = {"per_device_train_batch_size", "gradient_accumulation_steps"}


def test_ladder_halves_lr_then_clips_when_clipping_was_off():
    cfg = {"learning_rate": 2e-4, "max_grad_norm": 0, "per_device_train_batch_size": 4}
    assert h.remedy(1, cfg).edits == {"learning_rate": 1e-4}
    assert h.remedy(2, cfg).edits == {"max_grad_norm": 1.0}


@pytest.mark.parametrize("clip", [None, 0.0, 5.0, "10"])
def test_ladder_clips_when_off_or_looser(clip):
    assert h.remedy(2, {"learning_rate": 1e-4, "max_grad_norm": clip}).edits == {"max_grad_norm": 1.0}


def test_ladder_skips_clip_when_already_tight_then_fp32_only_for_fp16_that_fits():
    cfg = {"learning_rate": 1e-4, "fp16": True}  # max_grad_norm absent: HF's 1.0
    assert h.remedy(2, cfg, fp32_fits=True).edits == {"fp16": False}
    assert h.remedy(2, cfg, fp32_fits=False).edits == {"learning_rate": 5e-5}
    assert h.remedy(2, {"learning_rate": 1e-4, "bf16": True}, fp32_fits=True).edits == {"learning_rate": 5e-5}


def test_ladder_never_touches_the_batch():
    cfg = {"learning_rate": 1e-4, "fp16": True, "max_grad_norm": 0, "per_device_train_batch_size": 2}
    for n in range(1, 6):
        assert not BATCH_KEYS & set(h.remedy(n, cfg, fp32_fits=True).edits)


# ---------------------------------------------------------------- decide


def verdict_at(first_bad: int, start: int = 1) -> h.Verdict:
    losses = wobble(first_bad - start) + [float("nan")]
    return h.judge([{**r, "current_steps": r["current_steps"] + start - 1} for r in recs(losses)])


def hist(upto: int, bad_at: int | None = None) -> list[dict]:
    """A checkpoint's log_history up to its step: loss and grad_norm per step."""
    return [
        {"step": s, "loss": 2.0 + 0.01 * (s % 3), "grad_norm": "nan" if s == bad_at else 1.0}
        for s in range(1, upto + 1)
    ]


def judged(v: h.Verdict, *steps: int, bad_at: int | None = None) -> list[h.Checkpoint]:
    return h.judge_checkpoints(v, [(s, f"checkpoint-{s}", hist(s, bad_at)) for s in steps])


def test_a_checkpoint_is_clean_only_if_the_record_after_it_is():
    v = verdict_at(11)  # step 11 NaN: it came from checkpoint-10's weights
    got = {c.name: (c.clean, c.why) for c in judged(v, 5, 10, 15)}
    assert got["checkpoint-5"] == (True, "")
    assert got["checkpoint-10"] == (False, "its weights gave the record after it (step 11)")
    assert got["checkpoint-15"] == (False, "written at or after the first bad record (step 11)")
    assert [c.clean for c in judged(verdict_at(12), 5, 10)] == [True, True]


def test_real_lr1e8_save2_checkpoint_2_is_not_clean_with_or_without_the_console():
    rows = recorded("lr1e8_save2.jsonl")
    hist2 = [{"step": 1, "loss": 6.2255, "grad_norm": 1.51}, {"step": 2, "loss": 6.2106}]  # finite, as in the issue
    v = h.judge(rows)  # the jsonl alone: step 3's hidden NaN
    assert (v.first_bad.step, v.last_good_step) == (3, 2)
    [c] = h.judge_checkpoints(v, [(2, "checkpoint-2", hist2)])
    assert not c.clean and c.why == "its weights gave the record after it (step 3)"
    norms = [h.parse_console(line)[0]["grad_norm"] for line in (DATA / "lr1e8_save2.console.txt").open()]
    v = h.judge([{**r, "grad_norm": norms[i]} if "loss" in r else r for i, r in enumerate(rows)])
    assert (v.first_bad.step, v.first_bad.signal) == (2, h.Signal.NONFINITE_GRAD_NORM)
    [c] = h.judge_checkpoints(v, [(2, "checkpoint-2", hist2)])
    assert not c.clean and "first bad record (step 2)" in c.why
    # what torch says of those checkpoints (captured): every weight NaN from checkpoint-2 on
    w = json.loads((DATA / "lr1e8_save2.weights.json").read_text())
    assert w["base"]["max_abs"] == 1.0 and all(w[k]["nonfinite"] == 145984 for k in w if k != "base")


def test_a_resumed_attempt_whose_first_record_is_bad_steps_back_past_the_checkpoint_it_resumed_from():
    v = verdict_at(11, start=11)  # resumed from checkpoint-10, its first record NaN
    assert v.last_good_step is None and v.first_step == 11
    got = judged(v, 5, 10)
    assert [(c.name, c.clean) for c in got] == [("checkpoint-5", True), ("checkpoint-10", False)]
    d = h.decide(v, h.OnDiverge.ROLLBACK, {}, got, rollbacks_used=1)
    assert d.resume_from == "checkpoint-5" and d.set_aside == (("checkpoint-10", "diverged"),)
    # checkpoint-5 is judged by the record after it in checkpoint-10's history: a NaN at step 6 rules it out
    got = h.judge_checkpoints(v, [(5, "checkpoint-5", hist(5)), (10, "checkpoint-10", hist(10, bad_at=6))])
    assert not got[0].clean and got[0].why == "its weights gave a bad record (step 6)"


def test_rollback_goes_to_the_newest_clean_checkpoint_and_sets_aside_the_rest_by_why():
    cks = judged(verdict_at(13), 5, 10, 15)
    d = h.decide(verdict_at(13), h.OnDiverge.ROLLBACK, {"learning_rate": 1e-3}, cks, rollbacks_used=0)
    assert d.action == "rollback" and d.resume_from == "checkpoint-10"
    assert d.set_aside == (("checkpoint-15", "diverged"),)
    assert d.edits == {"learning_rate": 5e-4} and d.message.startswith("[1/2]")
    cks = [
        h.Checkpoint(5, "checkpoint-5", True),
        h.Checkpoint(10, "checkpoint-10", False, "weights: 3 non-finite", "badweights"),
    ]
    d = h.decide(verdict_at(13), h.OnDiverge.ROLLBACK, {}, cks, rollbacks_used=0)
    assert d.resume_from == "checkpoint-5" and d.set_aside == (("checkpoint-10", "badweights"),)
    assert "(checkpoint-10: weights: 3 non-finite)" in d.message


def test_no_clean_checkpoint_ends_diverged_unless_the_base_model_is_allowed():
    cks = judged(verdict_at(3), 5, 10)
    d = h.decide(verdict_at(3), h.OnDiverge.ROLLBACK, {"learning_rate": 1.0}, cks, rollbacks_used=0)
    assert d.action == "give_up" and d.resume_from is None
    assert d.set_aside == (("checkpoint-5", "diverged"), ("checkpoint-10", "diverged"))
    assert "no clean checkpoint remains (checkpoint-5: written at or after the first bad record (step 3);" in d.message
    assert "--on-diverge rollback-or-restart would" in d.message
    d = h.decide(verdict_at(3), h.OnDiverge.ROLLBACK_OR_RESTART, {"learning_rate": 1.0}, cks, rollbacks_used=0)
    assert d.action == "rollback" and d.resume_from is None and d.edits == {"learning_rate": 0.5}
    assert "rolling back from the base model (no clean checkpoint remains" in d.message
    d = h.decide(verdict_at(3), h.OnDiverge.ROLLBACK, {}, [], rollbacks_used=0)
    assert "no clean checkpoint remains (none was written before it)" in d.message


def test_rollbacks_are_bounded_and_the_message_says_what_was_tried():
    cks = judged(verdict_at(13), 5, 10)
    d = h.decide(verdict_at(13), h.OnDiverge.ROLLBACK, {}, cks, rollbacks_used=2, tried=["a", "b"])
    assert d.action == "give_up" and "tried: a; b" in d.message and d.edits == {}


def test_stop_and_ignore_policies():
    cks = judged(verdict_at(13), 5, 10, 15)
    d = h.decide(verdict_at(13), h.OnDiverge.STOP, {}, cks, rollbacks_used=0)
    assert d.action == "stop" and d.set_aside == (("checkpoint-15", "diverged"),)
    assert h.decide(verdict_at(13), h.OnDiverge.IGNORE, {}, cks, rollbacks_used=0).action == "ignore"


def scan(**tensors: float) -> dict:
    return {"files": 1, "elements": 10, "nonfinite": 0, "max_abs": max(tensors.values()), "tensors": tensors}


def test_weights_are_judged_against_the_base_model_or_the_previous_clean_checkpoint():
    cks = [h.Checkpoint(2, "checkpoint-2", True), h.Checkpoint(4, "checkpoint-4", True)]
    base = scan(a=1.0, b=0.5)
    got = h.judge_weights(cks, {"checkpoint-2": scan(a=1.2, b=0.6), "checkpoint-4": scan(a=36180.6, b=1.0)}, base, 100)
    assert [c.clean for c in got] == [True, False] and got[1].aside_as == "badweights"
    assert got[1].why == "weights blown up: max |w| 3.62e+04, 3.62e+04 x the base model's 1"
    nan = {**scan(a=1.0), "nonfinite": 7}
    assert (
        h.judge_weights(cks[:1], {"checkpoint-2": nan}, base, 100)[0].why
        == "weights: 7 non-finite of 10 sampled values"
    )
    # adapters share no tensor with the base: the previous clean checkpoint is the reference
    lora = {"checkpoint-2": scan(lora_b=0.01), "checkpoint-4": scan(lora_b=5.0)}
    got = h.judge_weights(cks, lora, base, 100)
    assert not got[1].clean and "previous clean checkpoint (checkpoint-2)" in got[1].why
    assert all(c.clean for c in h.judge_weights(cks, {}, base, 100))  # no scan (no safetensors): records decide


# ---------------------------------------------------------------- the file side


def fake_checkpoint(out: Path, step: int, history: list[dict]) -> Path:
    ck = out / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    (ck / "optimizer.pt").write_bytes(b"opt")
    return ck


def test_set_aside_renames_and_never_deletes(tmp_path):
    for s in (5, 10, 15):
        fake_checkpoint(tmp_path, s, [])
    (tmp_path / "model.safetensors").write_bytes(b"final")
    moved = rollback.set_aside(tmp_path, ["checkpoint-15", "checkpoint-99"], stamp=7)
    moved += rollback.set_aside_final(tmp_path, stamp=7)
    assert moved == ["checkpoint-15 -> diverged-checkpoint-15-7", "model.safetensors -> diverged-final-7/"]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-10", "checkpoint-5", "diverged-checkpoint-15-7", "diverged-final-7"]
    assert (tmp_path / "diverged-final-7" / "model.safetensors").read_bytes() == b"final"


def test_checkpoints_are_judged_on_their_own_history(tmp_path):
    nan = json.loads((DATA / "checkpoint4_log_history_nan.json").read_text())
    fake_checkpoint(tmp_path, 1, nan[:1])
    fake_checkpoint(tmp_path, 4, nan)
    (tmp_path / "checkpoint-6").mkdir()  # unreadable state: not clean
    v = h.judge(recs(wobble(8)))
    got = rollback.checkpoints_of(
        [(1, tmp_path / "checkpoint-1"), (4, tmp_path / "checkpoint-4"), (6, tmp_path / "checkpoint-6")],
        v,
        h.Thresholds(),
        fp16=False,
    )
    assert [(c.step, c.clean, c.aside_as) for c in got] == [
        (1, True, "diverged"),
        (4, False, "diverged"),
        (6, False, "unverified"),
    ]


def test_scale_lr_rewrites_a_copy_and_keeps_the_original(tmp_path):
    torch = pytest.importorskip("torch")
    ck = fake_checkpoint(tmp_path, 10, [])
    torch.save({"base_lrs": [1e-3], "_last_lr": [8e-4], "last_epoch": 10}, ck / "scheduler.pt")
    torch.save({"state": {}, "param_groups": [{"lr": 8e-4, "initial_lr": 1e-3, "params": [0]}]}, ck / "optimizer.pt")
    (ck / "model.safetensors").write_bytes(b"w" * 100)
    stamp = int(time.time())
    import sys

    assert rollback.scale_lr(tmp_path, "checkpoint-10", 5e-4, sys.executable, stamp) is None
    kept = tmp_path / f"rolledback-checkpoint-10-{stamp}"
    sched = torch.load(ck / "scheduler.pt", weights_only=False)
    opt = torch.load(ck / "optimizer.pt", weights_only=False)
    assert sched["base_lrs"] == [5e-4] and sched["_last_lr"] == [4e-4] and sched["last_epoch"] == 10
    assert opt["param_groups"][0]["lr"] == 4e-4 and opt["param_groups"][0]["initial_lr"] == 5e-4
    assert torch.load(kept / "scheduler.pt", weights_only=False)["base_lrs"] == [1e-3]  # original untouched
    assert (ck / "model.safetensors").stat().st_ino == (kept / "model.safetensors").stat().st_ino  # linked


def test_scale_lr_failure_leaves_everything_in_place(tmp_path):
    ck = fake_checkpoint(tmp_path, 10, [])
    err = rollback.scale_lr(tmp_path, "checkpoint-10", 5e-4, "/bin/false", 1)
    assert err and ck.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10"]


def test_fp32_fits_only_with_room_for_full_precision_activations():
    from dataclasses import replace

    from ftlaunch.plan.memory.peak import MemoryEstimate
    from ftlaunch.plan.memory.prediction import MemoryPrediction, Verdict

    est = MemoryEstimate(8.0, 4.0, 2.0, 3.0, 1.0, 2.0, peak_gib=20.0, host_gib=0.0, trainable_params=1)
    mem = MemoryPrediction(est, 32.0, usable_gib=28.0, headroom=0.12, verdict=Verdict.FITS, headroom_gib=12.0,
                           headroom_share=0.375)  # fmt: skip
    assert h.fp32_fits(mem)
    assert not h.fp32_fits(replace(mem, estimate=replace(est, activations_gib=7.5)))
    assert not h.fp32_fits(replace(mem, verdict=Verdict.DOES_NOT_FIT))
    assert not h.fp32_fits(None) and not h.fp32_fits(MemoryPrediction.from_dict({}))
    # as a run's plan.json holds it
    assert h.fp32_fits(MemoryPrediction.from_dict(mem.to_dict()))


# ---------------------------------------------------------------- HealthWatch, the supervisor's calls


def complete_checkpoint(out: Path, step: int, history: list[dict], lr: float) -> Path:
    import struct

    torch = pytest.importorskip("torch")
    ck = fake_checkpoint(out, step, history)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (ck / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    torch.save({"base_lrs": [lr], "_last_lr": [lr]}, ck / "scheduler.pt")
    torch.save({"state": {}, "param_groups": [{"lr": lr, "initial_lr": lr, "params": [0]}]}, ck / "optimizer.pt")
    return ck


def write_weights(folder: Path, **tensors: float) -> None:
    """A real safetensors file (numpy): each tensor 1000 float32 values, the last one ``value``."""
    import numpy as np

    np_ = pytest.importorskip("safetensors.numpy")
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.linspace(0, v, 1000, dtype=np.float32) for k, v in tensors.items()}
    np_.save_file(arrays, str(folder / "model.safetensors"))


@needs_train_stack
def test_health_watch_records_halts_scans_weights_sets_aside_by_why_and_prepares_the_rollback(tmp_path):
    from ftlaunch.run.store import read_events, read_state

    run_dir, out, base = tmp_path / "run", tmp_path / "out", tmp_path / "base"
    run_dir.mkdir()
    (run_dir / "state.json").write_text(json.dumps({"version": 1, "id": "r", "on_diverge": "rollback"}))
    said: list[str] = []
    values = {"learning_rate": 1e-3, "output_dir": str(out), "model_name_or_path": str(base)}
    w = rollback.HealthWatch(run_dir, values, {"FTLAUNCH_HEALTH": "bogus=1"}, said.append)
    assert "unknown setting" in said[0] and w.thresholds == h.Thresholds()  # a typo never kills the run
    w.start()
    write_weights(base, a=1.0, b=0.5)
    for step in (2, 4, 6):
        complete_checkpoint(out, step, hist(step), 1e-3)
    write_weights(out / "checkpoint-2", a=1.1, b=0.5)
    write_weights(out / "checkpoint-4", a=1.4e7, b=0.5)  # blown up, though every record is finite
    assert not w.feed(recs(wobble(5)))
    assert w.feed([{"current_steps": 6, "loss": float("nan")}]) and w.halt
    assert not w.feed([{"current_steps": 7, "loss": float("nan")}])  # told once
    ev = [e for e in read_events(run_dir) if e["event"] == "diverged"]
    assert len(ev) == 1 and ev[0]["step"] == 6 and read_state(run_dir).health["health"] == "diverged"
    assert any(">>> first bad record: diverged at step 6" in s for s in said)
    d = w.after(out, values, weights_only=False)
    assert d.action == "rollback" and d.resume_from == "checkpoint-2" and d.edits == {"learning_rate": 5e-4}
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "badweights-checkpoint-4-" + names[0].rsplit("-", 1)[1]
    assert names[1] == "checkpoint-2" and names[2].startswith("diverged-checkpoint-6-")
    assert names[3].startswith("rolledback-checkpoint-2-") and len(names) == 4
    # the message names every folder it moved, with why, as the listing shows them
    assert f"checkpoint-4 -> {names[0]} (weights blown up: max |w| 1.4e+07, 1.4e+07 x the base model's 1)" in d.message
    assert f"checkpoint-6 -> {names[2]} (written at or after the first bad record (step 6))" in d.message
    torch = pytest.importorskip("torch")
    assert torch.load(out / "checkpoint-2" / "scheduler.pt", weights_only=False)["base_lrs"] == [5e-4]
    last = read_events(run_dir)[-1]
    assert last["event"] == "rolled_back" and last["message"] == d.message and last["weight_scan_s"] < 30
    assert w.tried() == ["learning_rate 0.001 -> 0.0005"]


@needs_train_stack
def test_weights_child_agrees_with_a_full_read(tmp_path):
    import numpy as np

    np_ = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    big = rng.standard_normal(300_000).astype(np.float32)
    big[123_456] = 77.0  # outside every sampled run: the scan samples, it does not read all
    bf = (rng.standard_normal(1000).astype(np.float32) * 3).view(np.uint32) >> 16
    arrays = {
        "big": big,
        "small": np.array([1.0, -5.0, np.nan], dtype=np.float32),
        "half": np.ones(10, dtype=np.float16) * -2,
    }
    (tmp_path / "m").mkdir()
    np_.save_file(arrays, str(tmp_path / "m" / "model.safetensors"))
    # bf16 by hand: safetensors.numpy has no bfloat16
    header = json.dumps({"x": {"dtype": "BF16", "shape": [1000], "data_offsets": [0, 2000]}}).encode()
    import struct

    (tmp_path / "m" / "bf.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bf.astype("<u2").tobytes()
    )
    import sys

    got = rollback.scan_weights(sys.executable, [("m", str(tmp_path / "m")), ("gone", str(tmp_path / "nope"))])
    m = got["m"]
    assert m["files"] == 2 and m["nonfinite"] == 1 and m["tensors"]["small"] == 5.0 and m["tensors"]["half"] == 2.0
    truth_bf = float(np.abs((bf.astype(np.uint32) << 16).view(np.float32)).max())
    assert m["tensors"]["x"] == pytest.approx(truth_bf)
    assert m["elements"] == 65536 + 3 + 10 + 1000
    assert 4.0 < m["tensors"]["big"] < 77.0
    assert "error" in got["gone"]


# ---------------------------------------------------------------- grad_norm from the console


def console_lines() -> list[str]:
    # as the supervisor's pump reads them: bytes split on \n only (tqdm's \r stays inside a line)
    return [b.decode() for b in (DATA / "console_lr1e8.txt").read_bytes().split(b"\n") if b]


def test_parse_console_on_the_real_trainer_output():
    got = [d for line in console_lines() for d in h.parse_console(line)]
    assert [d["grad_norm"] for d in got] == ["1.51", "nan", "nan", "nan", "nan", "nan"]
    assert got[1] == {"loss": "6.211", "grad_norm": "nan", "learning_rate": "1e+08", "epoch": "0.125"}
    assert h.parse_console("{'eval_loss': '1.0', 'epoch': '1.0'}") == []
    assert h.parse_console("{'train_runtime': '12.1', 'train_loss': '3.0'}") == []


def watch(tmp_path: Path, **values) -> rollback.HealthWatch:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.json").write_text(json.dumps({"version": 1, "id": "r"}))
    w = rollback.HealthWatch(run_dir, values, {}, lambda s: None)
    w.start()
    return w


def test_console_grad_norm_catches_the_real_nan_a_step_before_the_loss_shows_it(tmp_path):
    w = watch(tmp_path)
    for line in console_lines()[:2]:  # the console line comes first (the jsonl is written by a thread)
        w.console(line)
    assert w.feed(recorded("nan_filtered_lr1e8.jsonl")[:2])
    assert (w.verdict.first_bad.step, w.verdict.first_bad.signal) == (2, h.Signal.NONFINITE_GRAD_NORM)
    assert w.verdict.last_good_step == 1


def test_a_late_console_line_is_paired_with_its_record_and_moves_the_last_good_step_back(tmp_path):
    w = watch(tmp_path)
    assert not w.feed(recs([2.0, 2.0, 2.0]))  # no console lines yet
    for g in ("1.0", "nan", "1.0"):
        w.console(f"{{'loss': '2.0', 'grad_norm': '{g}', 'learning_rate': '1e-4', 'epoch': '0.1'}}")
    assert w.feed([])
    assert w.verdict.first_bad.step == 2 and w.verdict.last_good_step == 1


def test_fp16_scaler_skips_from_the_console(tmp_path):
    w = watch(tmp_path, fp16=True)

    def line(i: int) -> str:
        return f"{{'loss': '2.0', 'grad_norm': 'inf', 'learning_rate': '1e-4', 'epoch': '{i / 100}'}}"

    for i in range(1, 10):
        w.console(line(i))
    assert not w.feed(recs(wobble(9)))  # 9 skipped steps: the scaler finding its scale
    w.console(line(10))
    assert w.feed([{"current_steps": 10, "loss": 2.05}])
    assert w.verdict.first_bad.signal is h.Signal.SCALER_SKIPS and w.verdict.first_bad.step == 1


def test_bad_values_are_kept_as_strict_json():
    v = h.judge(recs([2.0, float("nan")]))
    assert json.dumps(v.to_dict(), allow_nan=False) and v.first_bad.values == {"loss": "nan"}
    v = h.judge(recs([2.0, 2.0], grads=[1.0, float("-inf")]))
    assert v.first_bad.values == {"grad_norm": "-inf"}


def test_identical_console_dicts_of_several_nodes_count_once(tmp_path):
    w = watch(tmp_path)
    for g in ("1.0", "1.0", "nan", "nan"):  # two nodes print each step's (reduced, identical) dict
        w.console(f"{{'loss': '2.0', 'grad_norm': '{g}', 'learning_rate': '1e-4', 'epoch': '0.1'}}")
    assert w.feed(recs([2.0, 2.0])) and w.verdict.first_bad.step == 2
