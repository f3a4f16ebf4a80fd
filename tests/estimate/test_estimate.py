"""The estimate's arithmetic on hand-made length distributions, probe logs and run histories."""

from __future__ import annotations

import itertools
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftlaunch.cli.estimate import estimate_cmd
from ftlaunch.cli.plot import plot_cmd
from ftlaunch.estimate import core as est
from ftlaunch.estimate import padding as est_pad
from ftlaunch.estimate import probe as est_run
from ftlaunch.estimate import throughput as est_tp
from ftlaunch.run import accounting as acc

from ..conftest import needs_train_stack
from ..helpers import said


def stats_of(lengths, *, cutoff=64, packing=False, raw=None, rows=None, labels=None, stage="sft", **kw):
    lengths = tuple(lengths)
    return est_pad.TokenStats(
        stage=stage,
        cutoff_len=cutoff,
        packing=packing,
        rows=len(lengths) if rows is None else rows,
        samples=len(lengths),
        lengths=lengths,
        raw_lengths=tuple(raw) if raw is not None else lengths,
        label_tokens=sum(lengths) // 2 if labels is None else labels,
        truncation_at=cutoff - 1 if packing else cutoff,
        **kw,
    )


# ---------------------------------------------------------------- percentiles


def test_percentiles_nearest_rank():
    assert est_pad.length_percentiles(range(1, 101)) == {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    assert est_pad.length_percentiles([7]) == {"p50": 7, "p90": 7, "p99": 7, "max": 7}
    assert est_pad.length_percentiles([]) == {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    # ten values: p90 is the 9th, p99 the 10th
    assert est_pad.length_percentiles([5, 1, 9, 3, 7, 2, 8, 4, 6, 10]) == {"p50": 5, "p90": 9, "p99": 10, "max": 10}


# ---------------------------------------------------------------- padding without packing


def test_expected_batch_max_matches_enumeration():
    lengths = [3, 9, 12, 17, 17, 30, 41]
    for b in (1, 2, 3, 7):
        for m in (1, 8):
            subsets = list(itertools.combinations(lengths, b))
            want = sum(est_pad.round_up(max(s), m) for s in subsets) / len(subsets)
            assert est_pad.expected_batch_max(lengths, b, m) == pytest.approx(want, rel=1e-12)
    assert est_pad.expected_batch_max([1, 2, 3], 2) == pytest.approx(8 / 3)


def test_random_padding_equals_the_average_over_every_shuffle():
    # b divides n: every micro-batch of a shuffled epoch is a uniformly random b-subset
    lengths = [5, 11, 16, 23, 40, 64]
    b, m = 2, 8
    total = count = 0
    for perm in itertools.permutations(lengths):
        total += sum(len(perm[i : i + b]) * est_pad.round_up(max(perm[i : i + b]), m) for i in range(0, len(perm), b))
        count += 1
    assert est_pad.padded_tokens(lengths, b, m, "random") == pytest.approx(total / count, rel=1e-12)
    assert est_pad.padding_share(lengths, b, m) == pytest.approx(1 - sum(lengths) / (total / count))


def test_padding_share_hand_cases():
    assert est_pad.padding_share([16] * 10, 4, 8) == 0.0  # equal lengths, multiples of 8: nothing to pad
    assert est_pad.padding_share([8, 16], 2, 1) == pytest.approx(0.25)  # 8 of 32 computed tokens
    assert est_pad.padding_share([8, 16], 1, 1) == 0.0  # micro-batch 1: no padding ...
    assert est_pad.padding_share([5] * 4, 1, 8) == pytest.approx(3 / 8)  # ... except to the multiple of 8
    assert est_pad.padding_share([], 4) == 0.0


def test_sequential_and_length_grouped_padding_are_exact():
    # sequential: batches [10, 20] and [30, 40] -> 2*20 + 2*40 = 120 computed for 100 real
    assert est_pad.padded_tokens([10, 20, 30, 40], 2, 1, "sequential") == 120
    assert est_pad.padding_share([10, 20, 30, 40], 2, 1, "sequential") == pytest.approx(1 / 6)
    # another order: [40, 10] [30, 20] -> 80 + 60 = 140
    assert est_pad.padded_tokens([40, 10, 30, 20], 2, 1, "sequential") == 140
    # grouped by length: sorted first, back to 120; a short last batch counts its own size
    assert est_pad.padded_tokens([40, 10, 30, 20], 2, 1, "group_by_length") == 120
    assert est_pad.padded_tokens([10, 20, 30], 2, 8, "sequential") == 2 * 24 + 1 * 32
    with pytest.raises(ValueError):
        est_pad.padded_tokens([1], 1, 1, "shuffled")


# ---------------------------------------------------------------- packing


def test_greedy_knapsack_matches_llamafactorys_algorithm():
    # largest first that fits, then the largest that fits the rest
    assert est_pad.greedy_knapsack([9, 1, 8, 2, 7, 3], 10) == [[9, 1], [8, 2], [7, 3]]
    assert est_pad.greedy_knapsack([5, 5, 5, 5], 10) == [[5, 5], [5, 5]]
    assert est_pad.greedy_knapsack([6, 6, 6], 10) == [[6], [6], [6]]
    assert est_pad.greedy_knapsack([11, 4], 10) == [[4]]  # over capacity: llamafactory drops it first


def test_map_batches_follow_datasets_sharding():
    assert est_pad.map_batches(2500, 1000, 1) == [range(0, 1000), range(1000, 2000), range(2000, 2500)]
    assert est_pad.map_batches(2500, 1000, 2) == [
        range(0, 1000),
        range(1000, 1250),
        range(1250, 2250),
        range(2250, 2500),
    ]
    assert est_pad.map_batches(5, 1000, 2) == [range(0, 3), range(3, 5)]  # the first shard takes the remainder
    assert est_pad.map_batches(0) == []


def test_packed_rows_and_padding_share_packed():
    # cutoff 13: llamafactory packs to cutoff - 1 = 12 per row, pads each row to 13 tokens
    assert est_pad.packed_rows([6, 6, 6, 6], 13) == 2
    assert est_pad.packed_rows([6, 6, 6, 6], 13, batch_size=1) == 4  # each map batch packs alone
    assert est_pad.packed_rows([13, 13], 13) == 2  # clipped to 12, one per row
    assert est_pad.padding_share_packed([6, 6, 6, 6], 13, multiple=1) == pytest.approx(1 - 24 / 26)
    assert est_pad.padding_share_packed([6, 6, 6, 6], 13, multiple=8) == pytest.approx(1 - 24 / 32)
    assert est_pad.padding_share_packed([], 13) == 0.0


def test_packing_removes_most_padding_of_a_skewed_distribution():
    lengths = [20] * 90 + [500] * 10  # mostly short, a few long: random batches pad to the long ones
    unpacked = est_pad.padding_share(lengths, 8)
    packed = est_pad.padding_share_packed(lengths, 512)
    assert unpacked > 0.6 and packed < 0.2
    s = stats_of(lengths, cutoff=512)
    p = est_pad.padding_for(s, 8)
    assert p.share == pytest.approx(unpacked) and p.share_packed == pytest.approx(packed)
    assert p.padded_tokens == pytest.approx(sum(lengths) / (1 - unpacked))
    assert p.padded_tokens_packed == p.packed_rows * 512


def test_padding_for_non_sft_stages_offers_no_packing_what_if():
    s = stats_of([10, 20, 30, 40], stage="rm", sequences_per_row=2, rows=2)
    p = est_pad.padding_for(s, 1)  # pairs: chosen + rejected are one micro-batch of 2 sequences
    assert p.share == p.share_packed == pytest.approx(est_pad.padding_share([10, 20, 30, 40], 2))


# ---------------------------------------------------------------- what the counting child returns


def test_token_stats_from_child_with_packing():
    data = {
        "stage": "sft",
        "packing": True,
        "truncation_at": 63,
        "preprocessing_batch_size": 1000,
        "preprocessing_num_workers": 1,
        "train": {"rows": 2, "lengths": [64, 64], "label_tokens": 40, "sequences_per_row": 1},
        "samples": {"rows": 3, "lengths": [30, 30, 63], "label_tokens": 40, "sequences_per_row": 1},
        "raw": {"lengths": [30, 30, 90]},
        "eval": {"rows": 1, "tokens": 12},
        "notes": [],
    }
    s = est_pad.token_stats_from_child(data, 64)
    assert (s.rows, s.samples, s.total_tokens, s.label_tokens) == (2, 3, 123, 40)
    assert s.truncated == 1 and s.packing and s.eval_tokens == 12
    assert s.summary()["length_percentiles"]["max"] == 90
    assert est_pad.padding_for(s, 1).packed_rows == 2  # [63], [30, 30]: what llamafactory made


def test_sampling_of_config():
    assert est_pad.sampling_of({}) == "random"
    assert est_pad.sampling_of({"disable_shuffling": True}) == "sequential"
    assert est_pad.sampling_of({"train_sampling_strategy": "group_by_length"}) == "group_by_length"


# ---------------------------------------------------------------- steps


def test_optimizer_steps_as_the_hf_trainer_counts():
    s = est.optimizer_steps(64, 2, 2, 1, epochs=2)
    assert (s.batches_per_epoch, s.per_epoch, s.total, s.global_batch) == (32, 16, 32, 4)
    assert est.optimizer_steps(65, 2, 2, 1, epochs=1).per_epoch == 17  # 33 micro-batches: a short last step
    assert est.optimizer_steps(64, 2, 2, 1, epochs=1.5).total == 24
    capped = est.optimizer_steps(64, 2, 2, 1, epochs=3, max_steps=10)
    assert capped.total == 10 and capped.epochs == pytest.approx(10 / 16)
    assert est.optimizer_steps(64, 2, 1, 2, epochs=1).per_epoch == 16  # 2 devices share the batches
    assert est.optimizer_steps(3, 8, 4, 1, epochs=1).per_epoch == 1  # at least one step
    with pytest.raises(ValueError):
        est.optimizer_steps(10, 0, 1, 1)


def test_count_events():
    assert est.count_events("steps", 4, 32, 2) == 8
    assert est.count_events("steps", 0.25, 32, 2) == 4  # a ratio of the total
    assert est.count_events("epoch", None, 32, 2.0) == 2
    assert est.count_events("no", 4, 32, 2) == 0
    assert est.count_events(None, 4, 32, 2) == 0


# ---------------------------------------------------------------- throughput from a probe


def probe_records(steps=12, slow_first=3, sps=0.5, tokens_per_step=200, final=True):
    recs, t, tok = [], 0.0, 0
    for s in range(1, steps + 1):
        t += 3.0 if s <= slow_first else sps
        tok += tokens_per_step
        recs.append({"current_steps": s, "loss": 1.0, "total_tokens": tok, "throughput": round(tok / t, 2)})
    if final:
        recs.append({"current_steps": steps, "total_tokens": tok, "throughput": round(tok / t, 2)})
    return recs, t


def test_sustained_rate_discards_warmup():
    recs, _ = probe_records()
    pts = acc.trainer_clock(recs)
    assert len(pts) == 12  # the final summary record is left out
    sps, tps, n = est_tp.sustained(pts, warmup=3)
    assert sps == pytest.approx(0.5, rel=1e-4) and tps == pytest.approx(400, rel=1e-4) and n == 9
    slow, _, _ = est_tp.sustained(pts, warmup=0)
    assert slow > 0.5  # the warm-up would inflate it


def test_throughput_from_probe_measures_startup_and_teardown():
    recs, last_t = probe_records()
    startup, teardown = 10.0, 2.0
    observed = {r["current_steps"]: startup + r["total_tokens"] / r["throughput"] + 0.05 for r in recs}
    observed[1] -= 0.04  # the poll closest to the write
    wall = startup + last_t + teardown
    th = est_tp.throughput_from_probe(recs, observed, wall, warmup=3)
    assert th.clock == "trainer"
    assert th.startup_seconds == pytest.approx(10.01, abs=1e-3)
    assert th.teardown_seconds == pytest.approx(2.0 - 0.01, abs=1e-3)
    assert th.tokens_per_step == pytest.approx(200, rel=1e-4)


def test_throughput_falls_back_to_observed_times_without_token_counts():
    recs = [{"current_steps": s, "loss": 1.0} for s in range(1, 11)]
    observed = {s: 5.0 + s * 0.25 for s in range(1, 11)}
    th = est_tp.throughput_from_probe(recs, observed, 5.0 + 2.5 + 1.0, warmup=2)
    assert th.clock == "observed" and th.tokens_per_second is None
    assert th.seconds_per_step == pytest.approx(0.25)
    assert th.startup_seconds == pytest.approx(5.0) and th.teardown_seconds == pytest.approx(1.0)
    with pytest.raises(ValueError):
        est_tp.sustained([(1, 1.0, None)], 0)


# ---------------------------------------------------------------- time ranges and GPU-hours


def run_shape(**kw):
    base = dict(
        steps=est.optimizer_steps(400, 4, 1, 1, epochs=1),
        tokens=10_000.0,
        padding=0.2,
        gpus=2,
        world_size=2,
    )
    base.update(kw)
    return est.RunShape(**base)


def test_time_from_probe_range():
    th = est_tp.Throughput(1.0, 100.0, 100.0, 20, 5, startup_seconds=10.0, teardown_seconds=2.0)
    t = est.time_from_probe(run_shape(), th, margin=0.15)  # 100 steps x 1 s = 10,000 tokens / 100 tokens/s
    assert t.source == "probe"
    assert t.train_seconds == pytest.approx((85.0, 115.0))
    assert t.wall_seconds == pytest.approx((97.0, 127.0))
    assert t.central_seconds == pytest.approx(112.0)
    # rounded outwards to a microhour: the range still holds the seconds it was made of
    assert t.wall_hours == [0.026944, 0.035278] and t.gpu_hours == [0.053888, 0.070556]
    low, high = (h * 3600 for h in t.wall_hours)
    assert low <= 97.0 and high >= 127.0 and low <= t.central_shown <= high
    # by steps and by tokens disagree: the range spans both
    t2 = est.time_from_probe(run_shape(tokens=12_000.0), th, margin=0.0)
    assert t2.train_seconds == pytest.approx((100.0, 120.0)) and t2.train_central == pytest.approx(120.0)
    assert any("restarts" in a for a in t.assumptions)


def test_central_wall_time_never_prints_outside_its_range():
    """A seconds-long run whose range is narrower than the 0.1 s rounding of its central value
    (the CI's e2e estimate printed 8.6 s beside a range from 8.64 s)."""
    t = est.TimeEstimate("probe", (8.6399, 8.66), 8.6399, None, None, (0.0, 0.0), gpus=0)
    low, high = (h * 3600 for h in t.wall_hours)
    assert low <= t.central_shown <= high and low <= 8.6399 <= high


def test_time_from_flops_is_a_labelled_guess():
    shape = est_tp.ModelShape(params=10**9, active_params=10**9, layers=10, hidden=1000, trainable_params=10**9)
    fpt = est_tp.flops_per_token(shape, 100, "full", gradient_checkpointing=False)
    assert fpt == pytest.approx(6e9 + 2 * 10 * 100 * 1000 * 3)
    assert est_tp.flops_per_token(shape, 100, "full", True) == pytest.approx(8e9 + 2 * 10 * 100 * 1000 * 4)
    lora = est_tp.ModelShape(10**9, 10**9, 10, 1000, trainable_params=0)
    assert est_tp.flops_per_token(lora, 0, "lora", False) == pytest.approx(4e9)
    t = est.time_from_flops(run_shape(tokens=8e9, padding=0.2), 6e9, 100.0, utilisation=(0.25, 0.5), startup=(0, 0))
    computed = 8e9 / 0.8
    assert t.train_seconds == pytest.approx((computed * 6e9 / (2e14 * 0.5), computed * 6e9 / (2e14 * 0.25)))
    assert t.source == "peak-flops" and "GUESS" in t.assumptions[0]


def test_gpu_hours_and_projection():
    assert acc.gpu_hours(3600, 4) == 4.0
    assert acc.gpu_hours(1800, 0) == 0.0  # the CPU bills no GPU
    assert acc.projected_hours(50, 100, 0.01) == pytest.approx(5000 / 3600)
    assert acc.projected_hours(100, 100, 1.0) == 0.0
    assert acc.projected_hours(None, 100, 1.0) is None
    assert acc.projected_hours(5, 100, None) is None


def test_levers_rank_by_effect():
    pad = est_pad.Padding(4, "random", share=0.5, share_packed=0.05, packed_rows=10)
    lv = est.levers(
        train_seconds=900.0,
        total_seconds=1000.0,
        padding=pad,
        packing=False,
        finetuning_type="full",
        gradient_checkpointing=True,
        checkpointing_off_fits=False,
        checkpointing_off_note="predicted 90 GiB vs 70 GiB",
    )
    assert [x.change for x in lv] == [
        "packing: true",
        "finetuning_type: lora",
        "disable_gradient_checkpointing: true",
    ]
    assert lv[0].factor == pytest.approx((100 + 900 * 0.5 / 0.95) / 1000)
    assert lv[1].factor == pytest.approx((100 + 900 * 5 / 7) / 1000)
    assert "does not fit" not in lv[2].effect and "90 GiB" in lv[2].effect
    none = est.levers(
        train_seconds=None,
        total_seconds=None,
        padding=est_pad.Padding(4, "random", 0.0, 0.1, 4),
        packing=True,
        finetuning_type="lora",
        gradient_checkpointing=False,
        checkpointing_off_fits=None,
    )
    assert none == []


def test_build_estimate_json_has_every_promised_key():
    lengths = [20] * 90 + [300] * 10
    s = stats_of(lengths, cutoff=256, raw=[20] * 90 + [300] * 10)
    th = est_tp.Throughput(0.5, 2000.0, 1000.0, 20, 5, 8.0, 1.0)
    e = est.build_estimate(
        s,
        micro_batch=4,
        accumulation=2,
        world_size=1,
        gpus=1,
        values={"num_train_epochs": 2, "finetuning_type": "lora", "save_strategy": "no"},
        probe=th,
    )
    d = e.to_dict()
    for key in (
        "samples",
        "total_tokens",
        "label_tokens",
        "length_percentiles",
        "truncated",
        "padding_share",
        "padding_share_packed",
        "optimizer_steps",
        "tokens_per_second",
        "wall_hours",
        "gpu_hours",
        "assumptions",
        "levers",
    ):
        assert key in d, key
    assert d["truncated"] == 10 and d["optimizer_steps"] == 2 * math.ceil(math.ceil(100 / 4) / 2)
    assert d["tokens_per_second"] == 2000.0 and len(d["wall_hours"]) == 2
    assert d["wall_hours"][0] < d["wall_hours"][1] and d["gpu_hours"] == d["wall_hours"]
    assert d["levers"][0]["change"] == "packing: true" and {"change", "effect"} <= set(d["levers"][0])
    json.dumps(d)  # serialisable as is
    no_probe = est.build_estimate(
        s, micro_batch=4, accumulation=2, world_size=1, gpus=0, values={}, probe=None
    ).to_dict()
    assert no_probe["tokens_per_second"] is None and no_probe["wall_hours"] is None


def test_peak_flops_lookup():
    assert est_tp.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert est_tp.peak_tflops("Tesla T4", "fp32") == 8.1
    assert est_tp.peak_tflops("NVIDIA A100-PCIE-40GB", "fp16") == 312.0  # not the A10
    assert est_tp.peak_tflops("NVIDIA A10", "bf16") == 125.0
    assert est_tp.peak_tflops("Some Accelerator", "bf16") is None


# ---------------------------------------------------------------- configs handed to children


def test_counting_and_probe_configs_never_touch_the_real_output_dir(tmp_path):
    values = {
        "output_dir": "/data/real-run",
        "bf16": True,
        "deepspeed": "/x/ds_z3.json",
        "resume_from_checkpoint": "/data/real-run/checkpoint-5",
        "tokenized_path": str(tmp_path / "missing"),
        "cutoff_len": 512,
        "save_steps": 100,
    }
    c = est_run.counting_config(values, tmp_path)
    assert c["output_dir"] == str(tmp_path / "output") and c["bf16"] is False
    assert "deepspeed" not in c and "resume_from_checkpoint" not in c and "tokenized_path" not in c
    assert c["cutoff_len"] == 512
    p = est_run.probe_config(values, tmp_path / "probe", steps=20, warmup=5)
    assert p["output_dir"] == str(tmp_path / "probe") and p["max_steps"] == 25
    assert p["save_strategy"] == "no" and p["logging_steps"] == 1 and p["report_to"] == "none"
    assert p["include_num_input_tokens_seen"] == "non_padding" and "resume_from_checkpoint" not in p
    (tmp_path / "saved").mkdir()
    assert est_run.counting_config({**values, "tokenized_path": str(tmp_path / "saved")}, tmp_path)["tokenized_path"]


def test_child_env_hides_the_gpu_and_torchrun():
    env = est_run.child_env({"PATH": "/bin", "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "0"})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "FORCE_TORCHRUN" not in env and env["PATH"] == "/bin"


# ---------------------------------------------------------------- run history: attempts, restarts


def test_split_attempts_at_restarts():
    def rec(step, clock):
        return {"current_steps": step, "loss": 1.0 / step, "elapsed_time": f"0:00:{clock:02d}"}

    first = [rec(s, s) for s in range(1, 7)]
    second = [rec(s, s - 4) for s in range(5, 9)]  # resumed from checkpoint-4: steps 5, 6 again
    final = {"current_steps": 8, "elapsed_time": "0:00:05"}
    segs = acc.split_attempts([*first, *second, final])
    assert [[r["current_steps"] for r in s] for s in segs] == [[1, 2, 3, 4, 5, 6], [5, 6, 7, 8]]
    # resumed right after its last logged step: only the clock shows the restart
    segs = acc.split_attempts([rec(1, 10), rec(2, 20), rec(3, 1), rec(4, 2)])
    assert len(segs) == 2
    label, series = acc.rate_series(segs[1])
    assert label == "steps/s" and series[-1] == (4, 1.0)


def test_recent_rates_ignore_tokens_restored_by_a_resume():
    recs, _ = probe_records(steps=10, slow_first=0, sps=0.5, tokens_per_step=100, final=False)
    # attempt 2 resumed from step 6: the trainer restored 600 tokens, its clock restarted
    resumed = []
    for i, step in enumerate(range(7, 13), start=1):
        tok, t = 600 + 100 * i, 0.25 * i
        resumed.append({"current_steps": step, "loss": 1.0, "total_tokens": tok, "throughput": round(tok / t, 2)})
    rates = acc.recent_rates(recs + resumed, window=3)
    assert rates["steps_per_second"] == pytest.approx(4.0, rel=1e-3)
    assert rates["tokens_per_second"] == pytest.approx(400.0, rel=1e-3)
    assert resumed[-1]["throughput"] == pytest.approx(2 * rates["tokens_per_second"])  # what llamafactory logs
    assert acc.recent_rates([]) == {"steps_per_second": None, "tokens_per_second": None}


def test_attempt_spans_and_busy_seconds():
    events = [
        {"t": "2026-01-01T00:00:00+00:00", "event": "created"},
        {"t": "2026-01-01T00:00:00+00:00", "event": "attempt_started", "attempt": 1, "resume_from": None},
        {"t": "2026-01-01T00:10:00+00:00", "event": "exited", "attempt": 1},
        {"t": "2026-01-01T01:00:00+00:00", "event": "attempt_started", "attempt": 2, "resume_from": "checkpoint-40"},
    ]
    end = 1767229200.0 + 300  # 01:05
    spans = acc.attempt_spans(events, now=end)
    assert [s["resume_from"] for s in spans] == [None, 40]
    assert acc.busy_seconds(spans) == pytest.approx(600 + 300)


def test_segments_are_labelled_with_attempts_that_exist():
    def seg(first: int, last: int) -> list[dict]:
        return [{"current_steps": n, "loss": 1.0} for n in range(first, last + 1)]

    # attempt 2 OOMed before logging; attempt 3 resumed from the same checkpoint and logged.
    spans = [
        {"attempt": 1, "resume_from": None},
        {"attempt": 2, "resume_from": 10},
        {"attempt": 3, "resume_from": 10},
        {"attempt": 4, "resume_from": 20},
    ]
    assert acc.segment_attempts([seg(1, 12), seg(11, 22), seg(21, 30)], spans) == [1, 3, 4]
    # A segment the events cannot explain (no events at all, or a foreign restart) is not numbered.
    assert acc.segment_attempts([seg(1, 5), seg(3, 8)], []) == [None, None]
    assert acc.segment_attempts([seg(1, 5), seg(3, 8)], spans[:1]) == [1, None]


def test_a_lost_attempt_counts_until_its_last_sign_of_life():
    # Attempt 1's supervisor was SIGKILLed (no `exited`); attempt 2 was lost too.
    events = [
        {"t": "2026-01-01T00:00:00+00:00", "event": "attempt_started", "attempt": 1},
        {"t": "2026-01-01T00:30:00+00:00", "event": "attempt_started", "attempt": 2, "resume_from": "checkpoint-9"},
    ]
    last_seen = 1767225600.0 + 45 * 60  # 00:45, e.g. train.log's mtime
    spans = acc.attempt_spans(events, now=last_seen)
    assert [(s["attempt"], s["end"] - s["start"]) for s in spans] == [(1, 1800), (2, 900)]
    assert acc.busy_seconds(spans) == pytest.approx(2700)
    assert acc.attempt_spans(events)[-1]["end"] is None  # no end given: the last one stays open


# ---------------------------------------------------------------- the commands (in-process)


def test_commands_have_examples_and_refuse_a_probe_on_another_card():
    assert "Example" in (estimate_cmd.help or "") and "Example" in (plot_cmd.help or "")
    r = CliRunner().invoke(estimate_cmd, ["cfg.yaml", "--gpu", "A100-80GB", "--probe-steps", "10"])
    assert r.exit_code == 2 and said("measures this machine", r.output)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@needs_train_stack
def test_plot_draws_loss_and_throughput_with_restarts(tmp_path, isolated_home):
    from ftlaunch.files import write_json_atomic
    from ftlaunch.run.state import STATE_VERSION
    from ftlaunch.run.store import append_event

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    lines, tok, t = [], 0, 0.0
    for step in list(range(1, 21)) + list(range(13, 31)):  # a restart from checkpoint-12
        if step == 13 and t > 5:
            tok, t = 12 * 150, 0.0
        tok += 150
        t += 0.3
        lines.append({"current_steps": step, "total_steps": 30, "loss": 3.0 / step, "total_tokens": tok,
                      "throughput": round(tok / t, 2), "elapsed_time": f"0:00:{int(t):02d}"})  # fmt: skip
    (out_dir / "trainer_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_dir = isolated_home / "runs" / "20260101-000000-abcd"
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "state.json", {"version": STATE_VERSION, "id": run_dir.name, "name": "demo",
                                               "output_dir": str(out_dir)})  # fmt: skip
    (run_dir / "events.jsonl").write_text("")
    append_event(run_dir, "attempt_started", attempt=1, resume_from=None)
    append_event(run_dir, "exited", attempt=1, code=1)
    append_event(run_dir, "attempt_started", attempt=2, resume_from="checkpoint-12")
    r = CliRunner().invoke(plot_cmd, ["demo"])
    assert r.exit_code == 0, r.output
    png = run_dir / "progress.png"
    w, h = png_size(png)
    assert (w, h) == (1000, 650) and png.stat().st_size > 10_000
    r2 = CliRunner().invoke(plot_cmd, [str(out_dir), "--out", str(tmp_path / "direct.png")])
    assert r2.exit_code == 0 and png_size(tmp_path / "direct.png") == (1000, 650)


def test_importing_the_commands_stays_light():
    code = (
        "import sys, ftlaunch.cli.main, ftlaunch.cli.estimate, ftlaunch.estimate.core, ftlaunch.estimate.probe\n"
        "heavy = [m for m in ('matplotlib', 'torch', 'transformers', 'datasets', 'llamafactory') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
