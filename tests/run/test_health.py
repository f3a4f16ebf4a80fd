"""The numeric-health judge and the remedy ladder, on sequences recorded from the real tiny model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ftlaunch.run import health as h
from ftlaunch.run import rollback

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


def test_real_collapse_without_nan_is_not_called_diverged():
    # lr 1000: one huge loss at step 2 (before any median exists), then a flat dead loss: finite
    v = h.judge(recorded("collapse_lr1000.jsonl"))
    assert v.health is h.Health.FINITE and v.records == 17


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
    assert h.judge(recs([2.0] * 12, grads), fp16=True).health is h.Health.FINITE
    grads = [1.0, 1.0] + [float("inf")] * 10
    v = h.judge(recs([2.0] * 12, grads), fp16=True)
    assert v.diverged and v.first_bad.signal is h.Signal.SCALER_SKIPS
    assert v.first_bad.step == 3 and v.last_good_step == 2 and v.first_bad.values["consecutive"] == 10


def test_single_spike_is_spiky_not_diverged_and_fades():
    losses = [2.0] * 10 + [9.0] + [2.0] * 5
    v = h.judge(recs(losses))
    assert v.health is h.Health.SPIKY and not v.diverged
    v = h.judge(recs(losses + [2.0] * 20))
    assert v.health is h.Health.FINITE


def test_sustained_spike_diverges_at_its_first_record():
    losses = [2.0, 2.1, 1.9, 2.0, 2.0, 2.0, 7.0, 8.0, 9.0, 2.0]
    v = h.judge(recs(losses))
    assert v.diverged and v.first_bad.signal is h.Signal.LOSS_SPIKE
    assert v.first_bad.step == 7 and v.last_good_step == 6 and v.first_bad.values["sustained"] == 3


def test_spike_needs_history_and_factor():
    assert not h.judge(recs([2.0, 9.0, 9.0, 9.0])).diverged  # fewer than min_history losses first
    assert not h.judge(recs([2.0] * 6 + [5.9] * 5)).diverged  # below 3x the median
    assert h.judge(recs([2.0] * 6 + [5.9] * 5), h.Thresholds(spike_factor=2.5)).diverged


def test_slow_decline_and_eval_records_are_fine():
    rows = recs([3.0 - 0.01 * i for i in range(200)])
    rows.insert(50, {"current_steps": 50, "eval_loss": 2.5})
    rows.append({"current_steps": 200, "total_steps": 200, "epoch": 1.0})  # the summary record
    v = h.judge(rows)
    assert v.health is h.Health.FINITE and v.last_good_step == 200


def test_diverged_is_sticky():
    v = h.judge(recs([2.0, float("nan"), 2.0, 2.0]))
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


def verdict_at(first_bad: int) -> h.Verdict:
    losses = [2.0] * (first_bad - 1) + [float("nan")]
    return h.judge(recs(losses))


CKPTS = [h.Checkpoint(5, "checkpoint-5", True), h.Checkpoint(10, "checkpoint-10", True)]


def test_rollback_goes_to_the_newest_clean_checkpoint_before_the_first_bad_record():
    more = [*CKPTS, h.Checkpoint(15, "checkpoint-15", True)]
    d = h.decide(verdict_at(13), h.OnDiverge.ROLLBACK, {"learning_rate": 1e-3}, more, rollbacks_used=0)
    assert d.action == "rollback" and d.resume_from == "checkpoint-10" and d.set_aside == ("checkpoint-15",)
    assert d.edits == {"learning_rate": 5e-4} and d.message.startswith("[1/2]")


def test_checkpoint_at_the_bad_step_or_unclean_is_not_a_rollback_target():
    cks = [*CKPTS, h.Checkpoint(11, "checkpoint-11", True)]
    d = h.decide(verdict_at(11), h.OnDiverge.ROLLBACK, {}, cks, rollbacks_used=0)
    assert d.resume_from == "checkpoint-10" and d.set_aside == ("checkpoint-11",)
    cks = [h.Checkpoint(5, "checkpoint-5", True), h.Checkpoint(10, "checkpoint-10", False)]
    d = h.decide(verdict_at(13), h.OnDiverge.ROLLBACK, {}, cks, rollbacks_used=0)
    assert d.resume_from == "checkpoint-5" and d.set_aside == ("checkpoint-10",)


def test_no_clean_checkpoint_rolls_back_to_the_start():
    d = h.decide(verdict_at(3), h.OnDiverge.ROLLBACK, {"learning_rate": 1.0}, CKPTS, rollbacks_used=0)
    assert d.action == "rollback" and d.resume_from is None and d.set_aside == ("checkpoint-5", "checkpoint-10")
    assert "from the start" in d.message


def test_rollbacks_are_bounded_and_the_message_says_what_was_tried():
    d = h.decide(verdict_at(13), h.OnDiverge.ROLLBACK, {}, CKPTS, rollbacks_used=2, tried=["a", "b"])
    assert d.action == "give_up" and "tried: a; b" in d.message and d.edits == {}


def test_stop_and_ignore_policies():
    d = h.decide(
        verdict_at(13), h.OnDiverge.STOP, {}, [*CKPTS, h.Checkpoint(15, "checkpoint-15", True)], rollbacks_used=0
    )
    assert d.action == "stop" and d.set_aside == ("checkpoint-15",)
    assert h.decide(verdict_at(13), h.OnDiverge.IGNORE, {}, CKPTS, rollbacks_used=0).action == "ignore"


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
    got = rollback.checkpoints_of(
        [(1, tmp_path / "checkpoint-1"), (4, tmp_path / "checkpoint-4"), (6, tmp_path / "checkpoint-6")],
        h.Thresholds(),
        fp16=False,
    )
    assert [(c.step, c.clean) for c in got] == [(1, True), (4, False), (6, False)]


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
    mem = {"fits": True, "peak_gib": 20.0, "usable_gib": 28.0, "activations_gib": 3.0, "logits_gib": 1.0}
    assert h.fp32_fits(mem)
    assert not h.fp32_fits({**mem, "activations_gib": 7.5})
    assert not h.fp32_fits({**mem, "fits": False})
    assert not h.fp32_fits(None) and not h.fp32_fits({})


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


def test_health_watch_records_halts_sets_aside_and_prepares_the_rollback(tmp_path):
    from ftlaunch.run.store import read_events, read_state

    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    (run_dir / "state.json").write_text(json.dumps({"version": 1, "id": "r", "on_diverge": "rollback"}))
    said: list[str] = []
    values = {"learning_rate": 1e-3, "output_dir": str(out)}
    w = rollback.HealthWatch(run_dir, values, {"FTLAUNCH_HEALTH": "bogus=1"}, said.append)
    assert "unknown setting" in said[0] and w.thresholds == h.Thresholds()  # a typo never kills the run
    w.start()
    good = [{"loss": 2.0, "grad_norm": 1.0, "step": s} for s in (1, 2)]
    complete_checkpoint(out, 2, good, 1e-3)
    complete_checkpoint(out, 4, [*good, {"loss": float("nan"), "step": 3}], 1e-3)
    assert not w.feed(recs([2.0, 2.0]))
    assert w.feed([{"current_steps": 3, "loss": float("nan")}]) and w.halt
    assert not w.feed([{"current_steps": 4, "loss": float("nan")}])  # told once
    ev = [e for e in read_events(run_dir) if e["event"] == "diverged"]
    assert len(ev) == 1 and ev[0]["step"] == 3 and read_state(run_dir).health["health"] == "diverged"
    assert any(">>> first bad record: diverged at step 3" in s for s in said)
    d = w.after(out, values, weights_only=False)
    assert d.action == "rollback" and d.resume_from == "checkpoint-2" and d.edits == {"learning_rate": 5e-4}
    names = sorted(p.name for p in out.iterdir())
    assert names[0] == "checkpoint-2" and names[1].startswith("diverged-checkpoint-4-")
    assert names[2].startswith("rolledback-checkpoint-2-") and len(names) == 3
    torch = pytest.importorskip("torch")
    assert torch.load(out / "checkpoint-2" / "scheduler.pt", weights_only=False)["base_lrs"] == [5e-4]
    assert [e["event"] for e in read_events(run_dir)][-1] == "rolled_back"
    assert w.tried() == ["learning_rate 0.001 -> 0.0005"]


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
    assert not w.feed(recs([2.0] * 9))  # 9 skipped steps: the scaler finding its scale
    w.console(line(10))
    assert w.feed([{"current_steps": 10, "loss": 2.0}])
    assert w.verdict.first_bad.signal is h.Signal.SCALER_SKIPS and w.verdict.first_bad.step == 1


def test_a_resumed_attempt_whose_first_record_is_bad_rolls_back_to_the_checkpoint_it_resumed_from():
    v = h.judge([{"current_steps": 11, "loss": float("nan")}])  # resumed from checkpoint-10
    assert v.last_good_step is None
    d = h.decide(v, h.OnDiverge.ROLLBACK, {}, CKPTS, rollbacks_used=1)
    assert d.resume_from == "checkpoint-10" and d.set_aside == ()


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
