"""Estimate a fine-tune before committing hardware: tokens, lengths, padding, steps, time, GPU-hours.

A pure core and two thin shells:

- pure: padding share at a micro-batch (random, sequential or length-grouped batching), llamafactory's
  packing (its greedy knapsack, per preprocessing batch), percentiles, optimizer steps as the HF
  Trainer counts them, sustained throughput from trainer_log.jsonl records, time and GPU-hour ranges
  from a probe or from peak FLOP/s x a stated utilisation, and the levers that would change it most;
- ``count_tokens``: runs llamafactory's own preprocessing (``get_train_args`` -> ``load_tokenizer``
  -> ``get_template_and_fix_tokenizer`` -> ``get_dataset``, the calls ``run_sft`` makes) in a child
  Python and reads per-sequence lengths back as JSON;
- ``probe_throughput``: a short real ``llamafactory-cli train`` in a scratch output_dir.

ftlaunch never imports torch, transformers, datasets or llamafactory in its own process: the child
does. Method, assumptions and measured figures: docs/estimate.md.
"""

from __future__ import annotations

import bisect
import json
import math
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

IGNORE_INDEX = -100  # llamafactory extras/constants.py: label of a token that is not trained on
PAD_TO_MULTIPLE_OF = 8  # llamafactory train/*/workflow.py: the training collator pads to a multiple of 8
PREPROCESSING_BATCH_SIZE = 1000  # llamafactory DataArguments default; packing happens per map batch
DEFAULT_CUTOFF_LEN = 2048  # llamafactory DataArguments default
RAW_CUTOFF = 1_000_000_000  # "no cutoff": the length of every sample before truncation
SAMPLINGS = ("random", "sequential", "group_by_length")


# ============================================================================================
# Lengths: percentiles, padding, packing
# ============================================================================================


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of already sorted values (0 for none): the smallest value with at
    least q% of the values at or below it."""
    if not sorted_values:
        return 0
    k = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return int(sorted_values[min(k, len(sorted_values)) - 1])


def length_percentiles(lengths: Iterable[int]) -> dict[str, int]:
    s = sorted(lengths)
    return {"p50": percentile(s, 50), "p90": percentile(s, 90), "p99": percentile(s, 99), "max": s[-1] if s else 0}


def expected_batch_max(lengths: Sequence[int], batch: int, multiple: int = 1) -> float:
    """E[round_up(max of ``batch`` lengths drawn without replacement)], exactly.

    With lengths sorted ascending, the i-th smallest (1-based) is the maximum of a random batch with
    probability C(i-1, batch-1) / C(n, batch); computed with lgamma so a million samples are fine.
    """
    n = len(lengths)
    if n == 0:
        return 0.0
    b = max(1, min(batch, n))
    s = sorted(round_up(int(x), multiple) for x in lengths)
    log_total = math.lgamma(n + 1) - math.lgamma(b + 1) - math.lgamma(n - b + 1)
    acc = weights = 0.0
    for i in range(b, n + 1):
        w = math.exp(math.lgamma(i) - math.lgamma(b) - math.lgamma(i - b + 1) - log_total)
        acc += s[i - 1] * w
        weights += w
    return acc / weights  # the weights sum to 1; dividing removes their rounding


def padded_tokens_in_order(lengths: Sequence[int], batch: int, multiple: int = 1) -> int:
    """Tokens the model computes when consecutive ``batch`` samples form a micro-batch, each padded
    to round_up(its longest sample) (the last micro-batch may be smaller)."""
    b = max(1, batch)
    total = 0
    for i in range(0, len(lengths), b):
        chunk = lengths[i : i + b]
        total += len(chunk) * round_up(max(chunk), multiple)
    return total


def padded_tokens(
    lengths: Sequence[int], micro_batch: int, multiple: int = PAD_TO_MULTIPLE_OF, sampling: str = "random"
) -> float:
    """Tokens computed in one epoch without packing, padding included.

    random: the HF Trainer's RandomSampler, in expectation: n x E[padded batch maximum] (the one
    short last batch is treated like the others). sequential (``disable_shuffling``): exact, over
    dataset order. group_by_length: the lengths sorted then batched, a lower bound of HF's
    LengthGroupedSampler (which sorts within mega-batches).
    """
    if not lengths:
        return 0.0
    if sampling == "sequential":
        return float(padded_tokens_in_order(lengths, micro_batch, multiple))
    if sampling == "group_by_length":
        return float(padded_tokens_in_order(sorted(lengths), micro_batch, multiple))
    if sampling == "random":
        return expected_batch_max(lengths, micro_batch, multiple) * len(lengths)
    raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")


def padding_share(
    lengths: Sequence[int], micro_batch: int, multiple: int = PAD_TO_MULTIPLE_OF, sampling: str = "random"
) -> float:
    """Share of the computed tokens that are padding, without packing (see padded_tokens)."""
    padded = padded_tokens(lengths, micro_batch, multiple, sampling)
    return max(0.0, 1.0 - sum(lengths) / padded) if padded else 0.0


def greedy_knapsack(lengths: Iterable[int], capacity: int) -> list[list[int]]:
    """llamafactory data/processor/processor_utils.py::greedy_knapsack, same result: repeatedly
    fill a knapsack with the largest length that still fits. Lengths above capacity are skipped
    (llamafactory drops them before packing)."""
    numbers = sorted(x for x in lengths if 0 < x <= capacity)
    knapsacks = []
    while numbers:
        current, remaining = [], capacity
        while True:
            index = bisect.bisect(numbers, remaining)
            if index == 0:
                break
            remaining -= numbers[index - 1]
            current.append(numbers.pop(index - 1))
        knapsacks.append(current)
    return knapsacks


def map_batches(n: int, batch_size: int = PREPROCESSING_BATCH_SIZE, num_proc: int = 1) -> list[range]:
    """The slices ``datasets.map(batched=True, num_proc=...)`` hands the processor: ``num_proc``
    contiguous shards (datasets' ``shard(contiguous=True)``), then ``batch_size`` rows each."""
    shards = max(1, min(num_proc, n)) if n else 1
    div, mod = divmod(n, shards)
    out: list[range] = []
    for k in range(shards):
        start = div * k + min(k, mod)
        end = start + div + (1 if k < mod else 0)
        out += [range(i, min(i + batch_size, end)) for i in range(start, end, max(1, batch_size))]
    return out


def packed_rows(
    lengths: Sequence[int], cutoff_len: int, batch_size: int = PREPROCESSING_BATCH_SIZE, num_proc: int = 1
) -> int:
    """Rows llamafactory's packing makes of these samples (in dataset order).

    With ``packing`` llamafactory lowers its cutoff by one (DataArguments.__post_init__), truncates
    each sample to it, packs each map batch separately with greedy_knapsack and pads every row to
    ``cutoff_len`` tokens. ``lengths`` are per-sample lengths; longer ones are clipped to the cutoff.
    """
    cap = max(1, cutoff_len - 1)
    rows = 0
    for part in map_batches(len(lengths), batch_size, num_proc):
        rows += len(greedy_knapsack((min(lengths[i], cap) for i in part), cap))
    return rows


def packed_tokens(
    lengths: Sequence[int],
    cutoff_len: int,
    multiple: int = PAD_TO_MULTIPLE_OF,
    batch_size: int = PREPROCESSING_BATCH_SIZE,
    num_proc: int = 1,
) -> tuple[int, int, int]:
    """(rows, real tokens, computed tokens) per epoch with ``packing: true``: every packed row is
    ``cutoff_len`` tokens, then padded to the collator's multiple."""
    rows = packed_rows(lengths, cutoff_len, batch_size, num_proc)
    real = sum(min(x, max(1, cutoff_len - 1)) for x in lengths)
    return rows, real, rows * round_up(cutoff_len, multiple)


def padding_share_packed(
    lengths: Sequence[int],
    cutoff_len: int,
    multiple: int = PAD_TO_MULTIPLE_OF,
    batch_size: int = PREPROCESSING_BATCH_SIZE,
    num_proc: int = 1,
) -> float:
    """Share of computed tokens that are padding with ``packing: true`` (see packed_tokens)."""
    _, real, padded = packed_tokens(lengths, cutoff_len, multiple, batch_size, num_proc)
    return max(0.0, 1.0 - real / padded) if padded else 0.0


# ============================================================================================
# What llamafactory tokenized: TokenStats
# ============================================================================================


@dataclass(frozen=True)
class TokenStats:
    """llamafactory's tokenized training data, as its trainer will see it.

    ``lengths``: one entry per sequence the model processes (two per pair for rm/dpo), after the
    cutoff, in dataset order, padding excluded (with packing: the samples inside the packed rows).
    ``raw_lengths``: the same sequences with no cutoff (sft), else equal to ``lengths``.
    """

    stage: str
    cutoff_len: int  # as configured
    packing: bool
    rows: int  # what the dataloader iterates: samples, or packed rows with packing
    samples: int
    lengths: tuple[int, ...]
    raw_lengths: tuple[int, ...]
    label_tokens: int  # labels != IGNORE_INDEX, what the loss is computed on
    eval_rows: int = 0
    eval_tokens: int = 0
    sequences_per_row: int = 1
    truncation_at: int | None = None  # llamafactory's effective cutoff (cutoff_len - 1 with packing)
    batch_size: int = PREPROCESSING_BATCH_SIZE
    num_proc: int = 1
    notes: tuple[str, ...] = ()

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def truncated(self) -> int | None:
        """Samples the cutoff shortens (with packing also shortened, llamafactory truncates first)."""
        if self.truncation_at is None:
            return None
        return sum(1 for x in self.raw_lengths if x > self.truncation_at)

    def summary(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "samples": self.samples,
            "rows": self.rows,
            "total_tokens": self.total_tokens,
            "label_tokens": self.label_tokens,
            "length_percentiles": length_percentiles(self.raw_lengths),
            "truncated": self.truncated,
            "cutoff_len": self.cutoff_len,
            "packing": self.packing,
            "eval_rows": self.eval_rows,
            "eval_tokens": self.eval_tokens,
        }


def token_stats_from_child(data: Mapping[str, Any], cutoff_len: int) -> TokenStats:
    """Build TokenStats from what the counting child wrote (see _COUNT_CHILD)."""
    train = data["train"]
    packing = bool(data.get("packing"))
    samples = data.get("samples") or train
    lengths = tuple(int(x) for x in samples["lengths"])
    raw = data.get("raw")
    raw_lengths = tuple(int(x) for x in raw["lengths"]) if raw else lengths
    per_row = int(train.get("sequences_per_row", 1))
    truncation_at = data.get("truncation_at")
    ev = data.get("eval") or {}
    return TokenStats(
        stage=str(data.get("stage", "sft")),
        cutoff_len=int(cutoff_len),
        packing=packing,
        rows=int(train["rows"]),
        samples=len(lengths) // per_row,
        lengths=lengths,
        raw_lengths=raw_lengths,
        label_tokens=int(train["label_tokens"]),
        eval_rows=int(ev.get("rows", 0)),
        eval_tokens=int(ev.get("tokens", 0)),
        sequences_per_row=per_row,
        truncation_at=None if truncation_at is None else int(truncation_at),
        batch_size=int(data.get("preprocessing_batch_size") or PREPROCESSING_BATCH_SIZE),
        num_proc=int(data.get("preprocessing_num_workers") or 1),
        notes=tuple(data.get("notes") or ()),
    )


def sampling_of(values: Mapping[str, Any]) -> str:
    """Which sampler the HF Trainer will use for this llamafactory config."""
    if values.get("disable_shuffling") is True or values.get("train_sampling_strategy") == "sequential":
        return "sequential"
    if values.get("train_sampling_strategy") == "group_by_length" or values.get("group_by_length") is True:
        return "group_by_length"
    return "random"


@dataclass(frozen=True)
class Padding:
    micro_batch: int
    sampling: str
    share: float  # without packing
    share_packed: float  # with packing
    packed_rows: int  # rows packing makes (as llamafactory would)
    padded_tokens: float = 0.0  # computed per epoch without packing (expected, for random sampling)
    padded_tokens_packed: float = 0.0  # computed per epoch with packing


def padding_for(stats: TokenStats, micro_batch: int, sampling: str = "random") -> Padding:
    """Padding with and without packing at ``micro_batch`` for these samples."""
    seqs = micro_batch * stats.sequences_per_row
    lengths = list(stats.lengths)
    if stats.stage != "sft":  # pt packs by concatenation, pairwise/kto do not pack: nothing to compare
        padded = padded_tokens(lengths, seqs, PAD_TO_MULTIPLE_OF, sampling)
        share = max(0.0, 1.0 - sum(lengths) / padded) if padded else 0.0
        return Padding(micro_batch, sampling, share, share, stats.rows, padded, padded)
    padded = padded_tokens(lengths, seqs, PAD_TO_MULTIPLE_OF, sampling)
    share = max(0.0, 1.0 - sum(lengths) / padded) if padded else 0.0
    rows, real, padded_packed = packed_tokens(
        lengths, stats.cutoff_len, PAD_TO_MULTIPLE_OF, stats.batch_size, stats.num_proc
    )
    share_packed = max(0.0, 1.0 - real / padded_packed) if padded_packed else 0.0
    return Padding(micro_batch, sampling, share, share_packed, rows, padded, padded_packed)


# ============================================================================================
# Steps
# ============================================================================================


@dataclass(frozen=True)
class Steps:
    per_epoch: int
    total: int
    epochs: float  # epochs the run covers (max_steps / per_epoch when max_steps is set)
    global_batch: int  # rows per optimizer step
    batches_per_epoch: int  # micro-batches per device per epoch


def optimizer_steps(
    rows: int,
    micro_batch: int,
    accumulation: int,
    world_size: int,
    epochs: float = 3.0,
    max_steps: int | None = None,
) -> Steps:
    """Optimizer steps as transformers' Trainer.set_initial_training_values counts them.

    Micro-batches per device = ceil(rows / (micro_batch x world)) (no drop_last); steps per epoch =
    ceil(that / accumulation), at least 1 (the last step of an epoch accumulates fewer);
    total = max_steps when > 0, else ceil(epochs x steps per epoch). ``epochs`` default is
    llamafactory's/HF's num_train_epochs default, 3.0.
    """
    if micro_batch < 1 or accumulation < 1 or world_size < 1:
        raise ValueError("micro_batch, accumulation and world_size must be >= 1")
    batches = math.ceil(rows / (micro_batch * world_size)) if rows else 0
    per_epoch = max(math.ceil(batches / accumulation), 1)
    if max_steps is not None and max_steps > 0:
        total = int(max_steps)
        covered = total / per_epoch
    else:
        total = math.ceil(epochs * per_epoch)
        covered = float(epochs)
    return Steps(per_epoch, total, covered, micro_batch * accumulation * world_size, batches)


def run_tokens(stats: TokenStats, steps: Steps) -> float:
    """Non-padding tokens the whole run trains on: tokens per epoch x epochs covered."""
    return stats.total_tokens * steps.total / steps.per_epoch


def count_events(strategy: Any, every: Any, total_steps: int, epochs: float) -> int:
    """How many evaluations or checkpoint saves an ``*_strategy``/``*_steps`` pair makes."""
    s = str(strategy or "no").lower()
    if s in ("no", "none", "false"):
        return 0
    if s == "epoch":
        return max(1, math.floor(epochs + 1e-9))
    if s == "best":
        s = "steps"
    try:
        n = float(every) if every is not None else 500.0
    except (TypeError, ValueError):
        n = 500.0
    if 0 < n < 1:  # a ratio of the total steps
        n = max(1.0, math.ceil(n * total_steps))
    return int(total_steps // max(1.0, n))


# ============================================================================================
# Throughput: a probe's trainer_log.jsonl -> sustained rate
# ============================================================================================


@dataclass(frozen=True)
class Throughput:
    seconds_per_step: float
    tokens_per_second: float | None  # non-padding tokens/s
    tokens_per_step: float | None
    steps_measured: int
    warmup_steps: int
    startup_seconds: float = 0.0  # process start -> training begins (load, preprocessing)
    teardown_seconds: float = 0.0  # last step -> process exit (final save, metrics)
    clock: str = "trainer"  # "trainer": times from total_tokens / throughput; "observed": file polls

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def trainer_clock(records: Sequence[Mapping[str, Any]]) -> list[tuple[int, float, int | None]]:
    """(step, seconds since training began, tokens seen) per logged step, from the trainer's own
    clock: llamafactory writes throughput = tokens / (now - start), so now - start = tokens / it,
    to ~1e-5 relative (elapsed_time itself is whole seconds). Steps without those fields are left
    out; the final summary record (no loss) too."""
    out = []
    for r in records:
        if r.get("loss") is None or not r.get("throughput") or not r.get("total_tokens"):
            continue
        out.append((int(r["current_steps"]), float(r["total_tokens"]) / float(r["throughput"]), int(r["total_tokens"])))
    return out


def sustained(points: Sequence[tuple[int, float, int | None]], warmup: int) -> tuple[float, float | None, int]:
    """(seconds/step, tokens/s or None, steps measured) between the first point at or after step
    ``warmup`` and the last point: warm-up steps (allocator, kernels, caches) are discarded."""
    pts = sorted(points)
    if len(pts) < 2:
        raise ValueError("need at least two logged steps to measure a rate")
    start = next((p for p in pts if p[0] >= warmup), None)
    if start is None or start[0] >= pts[-1][0]:
        start = pts[0] if len(pts) < 3 else pts[len(pts) // 2 - 1]  # too few steps after warm-up
    end = pts[-1]
    steps = end[0] - start[0]
    dt = end[1] - start[1]
    if steps <= 0 or dt <= 0:
        raise ValueError("the logged steps do not advance in time")
    tps = None
    if start[2] is not None and end[2] is not None and end[2] > start[2]:
        tps = (end[2] - start[2]) / dt
    return dt / steps, tps, steps


def throughput_from_probe(
    records: Sequence[Mapping[str, Any]],
    observed: Mapping[int, float],
    wall_seconds: float,
    warmup: int,
) -> Throughput:
    """Throughput from a probe: trainer_log records, when each step was first seen (seconds since
    the process started) and the process's wall time."""
    points = trainer_clock(records)
    clock = "trainer"
    if len(points) < 2:
        points = [(s, t, None) for s, t in sorted(observed.items())]
        clock = "observed"
    sps, tps, n = sustained(points, warmup)
    # Training began at (observed time of a step) - (trainer time of that step); polling only ever
    # sees a line late, so the smallest difference is the closest.
    if clock == "trainer":
        diffs = [observed[s] - t for s, t, _ in points if s in observed]
        startup = max(0.0, min(diffs)) if diffs else 0.0
        last_t = points[-1][1]
    else:
        first_step, first_seen = min(observed.items())
        startup = max(0.0, first_seen - first_step * sps)
        last_t = max(observed.values()) - startup
    teardown = max(0.0, wall_seconds - startup - last_t)
    per_step_tokens = tps * sps if tps else None
    return Throughput(sps, tps, per_step_tokens, n, warmup, startup, teardown, clock)


# ============================================================================================
# Compute: FLOPs per token, peak FLOP/s per card
# ============================================================================================

# Dense peak TFLOP/s per GPU from the vendors' data sheets (no sparsity): (16-bit tensor cores with
# fp32 accumulate, fp32). Keys match ftlaunch.hardware.CATALOG.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "P100-16GB": (18.7, 9.3),
    "V100-16GB": (125.0, 15.7),
    "V100-32GB": (125.0, 15.7),
    "T4": (65.0, 8.1),
    "RTX2080TI": (53.8, 13.4),
    "A10": (125.0, 31.2),
    "A10G": (70.0, 31.2),  # not published by NVIDIA; the commonly measured figure
    "L4": (121.0, 30.3),
    "L40S": (362.0, 91.6),
    "RTX3090": (71.0, 35.6),
    "RTX4090": (165.2, 82.6),
    "A6000": (154.8, 38.7),
    "A100-40GB": (312.0, 19.5),
    "A100-80GB": (312.0, 19.5),
    "H100-80GB": (989.0, 67.0),
    "H200": (989.0, 67.0),
}
UTILISATION = (0.25, 0.50)  # model FLOPs utilisation assumed without a probe (low, high)
STARTUP_GUESS_SECONDS = (60.0, 600.0)  # model load + preprocessing, without a probe
WRITE_BYTES_PER_SECOND = (0.5e9, 2.0e9)  # checkpoint write speed assumed (low, high)


def _norm(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def peak_tflops(gpu_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of one GPU for ``precision`` (bf16/fp16/pure_bf16 or fp32); None if unknown."""
    from .hardware import CATALOG

    key = next((k for k, v in CATALOG.items() if _norm(v[0]) == _norm(gpu_name) or _norm(k) == _norm(gpu_name)), None)
    if key is None:  # a probed name that is not in the catalog: match the family, then the memory
        name = _norm(gpu_name)
        found = [k for k in PEAK_TFLOPS if _norm(k.split("-")[0]) in name]
        longest = max((len(k.split("-")[0]) for k in found), default=0)
        found = [k for k in found if len(k.split("-")[0]) == longest]
        exact = [k for k in found if "-" in k and _norm(k.split("-")[1]) in name]
        found = exact or found
        key = found[0] if found and len({PEAK_TFLOPS[k] for k in found}) == 1 else None
    if key is None or key not in PEAK_TFLOPS:
        return None
    half, single = PEAK_TFLOPS[key]
    return single if precision == "fp32" else half


@dataclass(frozen=True)
class ModelShape:
    """What FLOP counting needs of a model (from ftlaunch.modelspec.ModelSpec)."""

    params: int  # total
    active_params: int  # per token (MoE: the routed experts a token visits)
    layers: int
    hidden: int
    trainable_params: int


def flops_per_token(shape: ModelShape, seq_len: float, finetuning_type: str, gradient_checkpointing: bool) -> float:
    """Training FLOPs per token processed (padding included by the caller's token count).

    Linear layers: forward 2N; backward 2N for activation gradients + 2N for weight gradients of
    trainable weights (full: all, LoRA/freeze: the trainable share); + forward again with
    gradient checkpointing. Attention scores: forward 2·L·s·h per token (QK^T and AV, causal half),
    backward twice that, + forward again with checkpointing.
    """
    n = float(shape.active_params)
    trainable_share = 1.0 if finetuning_type == "full" else min(1.0, shape.trainable_params / max(1, shape.params))
    linear = 2 * n * (1 + 1 + trainable_share + (1 if gradient_checkpointing else 0))
    attn_fwd = 2.0 * shape.layers * seq_len * shape.hidden
    attn = attn_fwd * (3 + (1 if gradient_checkpointing else 0))
    return linear + attn


# ============================================================================================
# Time and GPU-hours
# ============================================================================================


@dataclass(frozen=True)
class Lever:
    change: str
    effect: str
    factor: float  # predicted wall time after / before (central)

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.change, "effect": self.effect, "factor": round(self.factor, 3)}


@dataclass(frozen=True)
class TimeEstimate:
    source: str  # "probe" | "peak-flops" | "none"
    wall_seconds: tuple[float, float] | None
    central_seconds: float | None
    train_seconds: tuple[float, float] | None
    train_central: float | None
    overhead_seconds: tuple[float, float]  # startup + teardown + evaluation + checkpoint saves
    gpus: int
    assumptions: tuple[str, ...] = ()

    @property
    def wall_hours(self) -> list[float] | None:
        if self.wall_seconds is None:
            return None
        return [round(self.wall_seconds[0] / 3600, 4), round(self.wall_seconds[1] / 3600, 4)]

    @property
    def gpu_hours(self) -> list[float] | None:
        if self.wall_seconds is None:
            return None
        return [round(gpu_hours(s, self.gpus), 4) for s in self.wall_seconds]


@dataclass(frozen=True)
class RunShape:
    """Everything about the run the time estimate needs, all plain numbers."""

    steps: Steps
    tokens: float  # non-padding tokens the whole run trains on
    padding: float  # padding share of computed tokens in this run's setup
    gpus: int  # GPUs billed (0 on the CPU)
    world_size: int
    evals: int = 0
    eval_tokens: int = 0
    saves: int = 0
    checkpoint_bytes: float = 0.0
    final_save_bytes: float = 0.0


def time_from_probe(run: RunShape, probe: Throughput, margin: float = 0.15) -> TimeEstimate:
    """Wall time from a probe: training by steps x s/step and by tokens / tokens/s (the range spans
    both, widened by ``margin``), plus the probe's measured start-up and teardown, evaluation at the
    probe's rate (forward only, a third of a training step), and checkpoint writes."""
    by_steps = run.steps.total * probe.seconds_per_step
    by_tokens = run.tokens / probe.tokens_per_second if probe.tokens_per_second else by_steps
    central_train = by_tokens
    train = (min(by_steps, by_tokens) * (1 - margin), max(by_steps, by_tokens) * (1 + margin))
    # evaluation is forward only: about a third of a training step's compute per token
    eval_s = run.evals * run.eval_tokens / probe.tokens_per_second / 3 if probe.tokens_per_second else 0.0
    saves = tuple(run.saves * run.checkpoint_bytes / bw for bw in reversed(WRITE_BYTES_PER_SECOND))
    fixed = probe.startup_seconds + probe.teardown_seconds + eval_s
    overhead = (fixed + saves[0], fixed + saves[1])
    central = fixed + central_train + (saves[0] + saves[1]) / 2
    notes = [
        f"probe: {probe.steps_measured} steps measured after {probe.warmup_steps} warm-up steps: "
        f"{probe.seconds_per_step:.4g} s/step"
        + (f", {probe.tokens_per_second:,.0f} tokens/s (non-padding)" if probe.tokens_per_second else ""),
        f"training = {run.steps.total} steps x s/step .. {run.tokens:,.0f} tokens / tokens/s, "
        f"widened by {margin:.0%} each way for step-to-step variation",
        f"start-up {probe.startup_seconds:.0f} s and teardown (final save) {probe.teardown_seconds:.0f} s "
        "as measured by the probe (the dataset cache may make the real start-up shorter)",
    ]
    notes += _common_assumptions(run, eval_s, saves)
    return TimeEstimate(
        "probe",
        (overhead[0] + train[0], overhead[1] + train[1]),
        central,
        train,
        central_train,
        overhead,
        run.gpus,
        tuple(notes),
    )


def time_from_flops(
    run: RunShape,
    flops_token: float,
    peak_tflops_per_gpu: float,
    utilisation: tuple[float, float] = UTILISATION,
    startup: tuple[float, float] = STARTUP_GUESS_SECONDS,
) -> TimeEstimate:
    """A guess without a probe: computed tokens (padding included) x FLOPs/token over the cards'
    peak x an assumed utilisation range."""
    computed = run.tokens / max(1e-9, 1.0 - run.padding)
    peak = peak_tflops_per_gpu * 1e12 * max(1, run.world_size)
    train = (computed * flops_token / (peak * utilisation[1]), computed * flops_token / (peak * utilisation[0]))
    eval_tokens = run.evals * run.eval_tokens / max(1e-9, 1.0 - run.padding)
    eval_s = tuple(eval_tokens * flops_token / 3 / (peak * u) for u in reversed(utilisation))
    saves = tuple(
        (run.saves * run.checkpoint_bytes + run.final_save_bytes) / bw for bw in reversed(WRITE_BYTES_PER_SECOND)
    )
    overhead = (startup[0] + eval_s[0] + saves[0], startup[1] + eval_s[1] + saves[1])
    wall = (overhead[0] + train[0], overhead[1] + train[1])
    central = math.sqrt(wall[0] * wall[1])
    train_central = math.sqrt(train[0] * train[1])
    notes = [
        "GUESS (no probe): peak FLOP/s x utilisation, not a measurement; `--probe-steps N` measures it",
        f"{peak_tflops_per_gpu:g} TFLOP/s peak per GPU (data sheet, dense) x {max(1, run.world_size)} GPU(s), "
        f"utilisation {utilisation[0]:.0%}-{utilisation[1]:.0%}",
        f"{flops_token / 1e9:,.2f} GFLOP per token computed; {computed:,.0f} tokens computed "
        f"({run.padding:.0%} of them padding)",
        f"start-up (model load, preprocessing) guessed at {startup[0] / 60:.0f}-{startup[1] / 60:.0f} min",
    ]
    notes += _common_assumptions(run, eval_s[1], saves)
    return TimeEstimate("peak-flops", wall, central, train, train_central, overhead, run.gpus, tuple(notes))


def no_time(run: RunShape, why: str) -> TimeEstimate:
    return TimeEstimate("none", None, None, None, None, (0.0, 0.0), run.gpus, (why,))


def _common_assumptions(run: RunShape, eval_s: float, saves: Sequence[float]) -> list[str]:
    out = []
    if run.evals:
        out.append(f"evaluation: {run.evals} x {run.eval_tokens:,} tokens, ~{eval_s:.0f} s in all (forward only)")
    else:
        out.append("evaluation: none configured")
    if run.saves:
        out.append(
            f"checkpoints: {run.saves} x {run.checkpoint_bytes / 1e9:.2f} GB (12 bytes per trainable "
            f"parameter: fp32 weights + Adam moments) written at "
            f"{WRITE_BYTES_PER_SECOND[0] / 1e9:g}-{WRITE_BYTES_PER_SECOND[1] / 1e9:g} GB/s "
            f"({saves[0]:.0f}-{saves[1]:.0f} s)"
        )
    else:
        out.append("checkpoints: none during training")
    out.append(
        "restarts: none included; each OOM or crash restart costs a start-up plus the steps since the "
        "last checkpoint again"
    )
    if run.gpus == 0:
        out.append("no GPU: GPU-hours are 0; the wall time is what this costs")
    return out


def gpu_hours(elapsed_seconds: float, gpus: int) -> float:
    """GPU-hours for ``elapsed_seconds`` of wall time on ``gpus`` GPUs."""
    return max(0.0, elapsed_seconds) * max(0, gpus) / 3600.0


def projected_hours(step: int | None, total: int | None, steps_per_second: float | None) -> float | None:
    """Wall hours still to go: from ``step`` to ``total`` at ``steps_per_second`` (this attempt's
    own rate). None when any is unknown. Projected GPU-hours of a run = gpu_hours(elapsed so far,
    gpus) + projected_hours(...) x gpus."""
    if step is None or not total or not steps_per_second or steps_per_second <= 0:
        return None
    return max(0, total - step) / steps_per_second / 3600.0


# ============================================================================================
# Levers: what would change the time most
# ============================================================================================


def levers(
    *,
    train_seconds: float | None,
    total_seconds: float | None,
    padding: Padding,
    packing: bool,
    finetuning_type: str,
    gradient_checkpointing: bool,
    checkpointing_off_fits: bool | None,
    checkpointing_off_note: str = "",
) -> list[Lever]:
    """Changes that would shorten the run, each with its estimated effect (compute-bound model:
    time proportional to FLOPs computed, padding included), largest effect first."""
    out: list[Lever] = []
    ckpt = 1 if gradient_checkpointing else 0

    def effect(factor: float, why: str) -> tuple[str, float]:
        if train_seconds is None or total_seconds is None or total_seconds <= 0:
            return f"training compute x{factor:.2f} ({why})", factor
        after = total_seconds - train_seconds + train_seconds * factor
        wall_factor = after / total_seconds
        return f"{wall_factor - 1:+.0%} wall time, {factor - 1:+.0%} training time ({why})", wall_factor

    if not packing and padding.share > padding.share_packed:
        f = (1 - padding.share) / max(1e-9, 1 - padding.share_packed)
        text, wf = effect(
            f,
            f"padding {padding.share:.0%} -> {padding.share_packed:.0%} of computed tokens; "
            f"{padding.packed_rows} packed rows; set neat_packing to keep samples from attending to each other",
        )
        out.append(Lever("packing: true", text, wf))
    if finetuning_type == "full":
        f = (4 + ckpt) / (6 + ckpt)
        text, wf = effect(f, "no weight gradients for the base weights; also frees memory for a larger micro-batch")
        out.append(Lever("finetuning_type: lora", text, wf))
    if gradient_checkpointing:
        lin = 6 if finetuning_type == "full" else 4
        f = lin / (lin + 2)
        if checkpointing_off_fits is False:
            why = "no forward recomputation, but " + (checkpointing_off_note or "it does not fit in memory")
        elif checkpointing_off_fits is None:
            why = "no forward recomputation; memory not modelled here" + (
                f" ({checkpointing_off_note})" if checkpointing_off_note else ""
            )
        else:
            why = "no forward recomputation; fits in memory" + (
                f" ({checkpointing_off_note})" if checkpointing_off_note else ""
            )
        text, wf = effect(f, why)
        out.append(Lever("disable_gradient_checkpointing: true", text, wf))
    return sorted(out, key=lambda lv: lv.factor)


# ============================================================================================
# Runs over time: attempts, restarts (for `plot` and GPU-hours so far)
# ============================================================================================


def _clock_seconds(text: Any) -> float | None:
    """llamafactory's elapsed_time "H:MM:SS" (or "N days, H:MM:SS") -> seconds."""
    if not isinstance(text, str):
        return None
    days = 0
    if "day" in text:
        d, _, text = text.partition(",")
        days = int(d.split()[0])
    try:
        h, m, s = (float(x) for x in text.strip().split(":"))
    except ValueError:
        return None
    return days * 86400 + h * 3600 + m * 60 + s


def split_attempts(records: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Split trainer_log.jsonl records into attempts: a restart shows as a step that does not
    advance or a clock that goes back (the file is appended to, never trimmed)."""
    segments: list[list[Mapping[str, Any]]] = []
    prev_step: int | None = None
    prev_clock: float | None = None
    for r in records:
        if r.get("loss") is None:
            continue  # the final summary record repeats the last step
        step = int(r["current_steps"])
        clock = _clock_seconds(r.get("elapsed_time"))
        restarted = prev_step is not None and (
            step <= prev_step or (clock is not None and prev_clock is not None and clock < prev_clock)
        )
        if not segments or restarted:
            segments.append([])
        segments[-1].append(r)
        prev_step, prev_clock = step, clock
    return segments


def rate_series(segment: Sequence[Mapping[str, Any]], window: int | None = None) -> tuple[str, list[tuple[int, float]]]:
    """("tokens/s" or "steps/s", [(step, rate)]) over a sliding window of logged steps."""
    pts = trainer_clock(segment)
    if len(pts) >= 2:
        w = window or max(1, len(pts) // 30)
        return "tokens/s", [
            (pts[i][0], (pts[i][2] - pts[i - w][2]) / (pts[i][1] - pts[i - w][1]))
            for i in range(w, len(pts))
            if pts[i][1] > pts[i - w][1]
        ]
    first = int(segment[0]["current_steps"]) - 1 if segment else 0
    out = []
    for r in segment:
        c = _clock_seconds(r.get("elapsed_time"))
        if c:
            out.append((int(r["current_steps"]), (int(r["current_steps"]) - first) / c))
    return "steps/s", out


def recent_rates(records: Sequence[Mapping[str, Any]], window: int = 20) -> dict[str, float | None]:
    """{steps_per_second, tokens_per_second} over the last ``window`` logged steps of the current
    attempt, from the trainer clock. For `status`: llamafactory's own ``throughput`` field divides
    the token count restored from a checkpoint by this attempt's time, so it is too high after a
    resume; differences within one attempt are not."""
    segments = split_attempts(records)
    pts = trainer_clock(segments[-1]) if segments else []
    if len(pts) < 2:
        return {"steps_per_second": None, "tokens_per_second": None}
    a, b = pts[max(0, len(pts) - 1 - window)], pts[-1]
    dt = b[1] - a[1]
    if dt <= 0:
        return {"steps_per_second": None, "tokens_per_second": None}
    tokens = (b[2] - a[2]) / dt if a[2] is not None and b[2] is not None else None
    return {"steps_per_second": (b[0] - a[0]) / dt, "tokens_per_second": tokens}


def _parse_t(value: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def attempt_spans(events: Sequence[Mapping[str, Any]], now: float | None = None) -> list[dict[str, Any]]:
    """Each attempt of a run from its events.jsonl: attempt, start, end (None while running),
    resume_from (step of the checkpoint it resumed from)."""
    spans: list[dict[str, Any]] = []
    for e in events:
        t = _parse_t(e.get("t"))
        if e.get("event") == "attempt_started":
            rf = e.get("resume_from")
            step = int(str(rf).rsplit("-", 1)[-1]) if rf and str(rf).rsplit("-", 1)[-1].isdigit() else None
            spans.append({"attempt": e.get("attempt"), "start": t, "end": None, "resume_from": step})
        elif e.get("event") == "exited" and spans and spans[-1]["end"] is None:
            spans[-1]["end"] = t
    if now is not None:
        for s in spans:
            if s["end"] is None:
                s["end"] = now
    return spans


def busy_seconds(spans: Sequence[Mapping[str, Any]]) -> float:
    """Wall seconds the run held its GPUs: the sum of its attempts (gaps between them excluded)."""
    return sum(max(0.0, s["end"] - s["start"]) for s in spans if s.get("start") is not None and s.get("end"))


# ============================================================================================
# Shell 1: count tokens with llamafactory's own preprocessing, in a child process
# ============================================================================================

# Keys that depend on the machine, not the data: llamafactory's argument checks would fail on a
# machine without the card the plan is for (bf16 on a CPU), or need packages irrelevant to counting.
_MACHINE_KEYS = (
    "deepspeed",
    "fsdp",
    "fsdp_config",
    "quantization_bit",
    "quantization_method",
    "quantization_type",
    "double_quantization",
    "use_unsloth",
    "use_unsloth_gc",
    "enable_liger_kernel",
    "use_kt",
    "resume_from_checkpoint",
    "logging_dir",
    "run_name",
)


def counting_config(values: Mapping[str, Any], scratch: Path) -> dict[str, Any]:
    """The config the counting child parses: the data-relevant keys as the trainer sees them."""
    cfg = {k: v for k, v in values.items() if k not in _MACHINE_KEYS}
    for key in ("bf16", "fp16", "pure_bf16", "push_to_hub", "load_best_model_at_end"):
        if key in cfg:
            cfg[key] = False
    cfg.update(
        {
            "output_dir": str(scratch / "output"),
            "overwrite_output_dir": True,
            "report_to": "none",
            "do_train": True,
        }
    )
    tp = cfg.get("tokenized_path")
    if tp and not Path(str(tp)).is_dir():
        del cfg["tokenized_path"]  # it would save there; only a saved one is read
    return cfg


_COUNT_CHILD = r'''
"""ftlaunch's token counter: llamafactory's own preprocessing, lengths written as JSON.

argv: SPEC_JSON OUT_JSON. SPEC = {"config": {...}}. Runs the calls run_sft/run_pt/... make
(get_train_args, load_tokenizer, get_template_and_fix_tokenizer, get_dataset), up to three times:
  train    the config as given: what the dataloader iterates (rows, label tokens)
  samples  packing only: the same with packing off at llamafactory's packing cutoff (cutoff - 1)
  raw      sft only, when some sample reaches the cutoff: no cutoff, to count truncation
"""
import json
import sys


def main():
    spec = json.load(open(sys.argv[1]))
    cfg = spec["config"]
    raw_cutoff, ignore_index = spec["raw_cutoff"], spec["ignore_index"]
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    def load(overrides):
        merged = dict(cfg)
        merged.update(overrides)
        if overrides:
            merged.pop("tokenized_path", None)
        model_args, data_args, training_args, finetuning_args, _ = get_train_args(merged)
        if data_args.streaming:
            raise ValueError("streaming datasets have no length to count; estimate with streaming: false")
        tm = load_tokenizer(model_args)
        template = get_template_and_fix_tokenizer(tm["tokenizer"], data_args)
        stage = finetuning_args.stage
        ds_stage = {"dpo": "rm"}.get(stage, stage)
        dm = get_dataset(template, model_args, data_args, training_args, stage=ds_stage, **tm)
        return data_args, stage, dm

    def measure(ds):
        import pyarrow.compute as pc

        cols = ds.column_names
        if "chosen_input_ids" in cols:
            pairs = [("chosen_input_ids", "chosen_labels"), ("rejected_input_ids", "rejected_labels")]
        else:
            pairs = [("input_ids", "labels" if "labels" in cols else None)]
        lengths = [[] for _ in pairs]
        labels = 0
        for batch in ds.with_format("arrow").iter(batch_size=10000):
            for k, (ic, lc) in enumerate(pairs):
                lens = pc.list_value_length(batch.column(ic)).to_pylist()
                lengths[k].extend(lens)
                if lc is None:
                    labels += sum(lens)
                else:
                    flat = pc.list_flatten(batch.column(lc))
                    labels += int(pc.sum(pc.not_equal(flat, ignore_index)).as_py() or 0)
        joined = [x for part in lengths for x in part]
        return {"rows": len(lengths[0]), "lengths": joined, "label_tokens": labels, "sequences_per_row": len(pairs)}

    def eval_part(dm):
        ev = dm.get("eval_dataset")
        if ev is None:
            return None
        parts = list(ev.values()) if isinstance(ev, dict) else [ev]
        rows = tokens = 0
        for d in parts:
            m = measure(d)
            rows += m["rows"]
            tokens += sum(m["lengths"])
        return {"rows": rows, "tokens": tokens}

    data_args, stage, dm = load({})
    out = {
        "stage": stage,
        "packing": bool(data_args.packing),
        "neat_packing": bool(data_args.neat_packing),
        "truncation_at": data_args.cutoff_len,
        "preprocessing_batch_size": data_args.preprocessing_batch_size,
        "preprocessing_num_workers": data_args.preprocessing_num_workers or 1,
        "train": measure(dm["train_dataset"]),
        "eval": eval_part(dm),
        "samples": None,
        "raw": None,
        "notes": [],
    }
    used_saved = bool(cfg.get("tokenized_path"))
    if used_saved:
        out["notes"].append("read the saved tokenized_path; the cutoff's effect on it is unknown")
        out["truncation_at"] = None
    per_sample = out["train"]
    if stage == "sft" and data_args.packing and not used_saved:
        _, _, dm2 = load({"packing": False, "neat_packing": False, "cutoff_len": data_args.cutoff_len})
        out["samples"] = per_sample = measure(dm2["train_dataset"])
    if stage == "sft" and not used_saved and per_sample["lengths"]:
        if max(per_sample["lengths"]) >= data_args.cutoff_len - 2:
            _, _, dm3 = load({"packing": False, "neat_packing": False, "cutoff_len": raw_cutoff})
            out["raw"] = {"lengths": measure(dm3["train_dataset"])["lengths"]}
    elif stage != "sft":
        out["truncation_at"] = None
        out["notes"].append(f"stage {stage}: truncation is not counted")
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


main()
'''


def trainer_python(env: Mapping[str, str]) -> str:
    """The Python llamafactory-cli runs under (its shebang), so the child imports the same
    llamafactory the trainer will; else this Python."""
    import sys

    from .errors import TrainerError
    from .launch import find_trainer

    try:
        exe = find_trainer(env)[0]
        first = Path(exe).read_bytes()[:256].split(b"\n", 1)[0].decode(errors="replace")
    except (TrainerError, OSError):
        return sys.executable
    if first.startswith("#!"):
        interp = first[2:].strip().split()[0] if first[2:].strip() else ""
        if "python" in Path(interp).name and Path(interp).is_file():
            return interp
    return sys.executable


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """The counting child's environment: the caller's, without a GPU (tokenizing needs none and
    must not take one from a run) and without torchrun."""
    out = {k: v for k, v in env.items() if k not in ("FORCE_TORCHRUN", "NPROC_PER_NODE")}
    out["CUDA_VISIBLE_DEVICES"] = ""
    out.setdefault("PYTHONUNBUFFERED", "1")
    return out


def _last_error(log: str) -> str:
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Exception" in line) and ":" in line and not line.startswith("File "):
            return line
    return lines[-1] if lines else "no output"


def count_tokens(
    config_values: Mapping[str, Any],
    env: Mapping[str, str],
    workdir: str | Path,
    *,
    python: str | None = None,
    timeout: float | None = None,
) -> TokenStats:
    """Run llamafactory's preprocessing on ``config_values`` (the adapted config) in a child
    process under ``workdir`` and return its exact token counts."""
    from .errors import ConfigError, TrainerError

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = {"config": counting_config(config_values, work), "raw_cutoff": RAW_CUTOFF, "ignore_index": IGNORE_INDEX}
    spec_path, out_path, script, log_path = (
        work / "count_spec.json",
        work / "count_out.json",
        work / "count_child.py",
        work / "count.log",
    )
    spec_path.write_text(json.dumps(spec, default=str))
    script.write_text(_COUNT_CHILD)
    out_path.unlink(missing_ok=True)
    cmd = [python or trainer_python(env), str(script), str(spec_path), str(out_path)]
    try:
        with open(log_path, "wb") as log:
            rc = subprocess.run(
                cmd, env=child_env(env), stdout=log, stderr=subprocess.STDOUT, cwd=work, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        raise TrainerError(f"counting tokens took longer than {timeout:.0f} s", hint=f"its log: {log_path}") from None
    except OSError as exc:
        raise TrainerError(f"cannot run {cmd[0]}: {exc}", hint="install the train extra") from None
    text = log_path.read_text(errors="replace")
    if rc != 0 or not out_path.is_file():
        err = _last_error(text)
        if "No module named 'llamafactory'" in text:
            raise TrainerError(f"llamafactory is not importable by {cmd[0]}", hint="pip install 'ftlaunch[train]'")
        raise ConfigError(f"llamafactory's preprocessing failed: {err}", hint=f"its full log: {log_path}")
    data = json.loads(out_path.read_text())
    cutoff = int(config_values.get("cutoff_len") or DEFAULT_CUTOFF_LEN)
    return token_stats_from_child(data, cutoff)


# ============================================================================================
# Shell 2: probe throughput with a short real run
# ============================================================================================


def probe_config(values: Mapping[str, Any], output_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
    """The probe's config: the real one, but a scratch output_dir, warmup + steps optimizer steps,
    every step logged with tokens counted, and no saving, evaluation or reporting."""
    cfg = {k: v for k, v in values.items() if k not in ("resume_from_checkpoint", "logging_dir", "run_name")}
    cfg.update(
        {
            "output_dir": str(output_dir),
            "overwrite_output_dir": True,
            "max_steps": int(warmup + steps),
            "logging_steps": 1,
            "save_strategy": "no",
            "eval_strategy": "no",
            "do_eval": False,
            "do_predict": False,
            "load_best_model_at_end": False,
            "report_to": "none",
            "plot_loss": False,
            "push_to_hub": False,
            "include_num_input_tokens_seen": "non_padding",
        }
    )
    tp = cfg.get("tokenized_path")
    if tp and not Path(str(tp)).is_dir():
        del cfg["tokenized_path"]
    return cfg


def probe_throughput(
    config_values: Mapping[str, Any],
    env: Mapping[str, str],
    steps: int = 20,
    warmup: int = 5,
    *,
    plan_env: Mapping[str, str] | None = None,
    workdir: str | Path | None = None,
    timeout: float | None = None,
    poll: float = 0.02,
    clock: Callable[[], float] = time.monotonic,
    keep: bool = False,
) -> Throughput:
    """Run ``llamafactory-cli train`` for warmup + steps optimizer steps in a scratch output_dir
    (deleted afterwards unless it failed or ``keep``) and measure the sustained rate."""
    from .config import dump_yaml
    from .errors import FtlaunchError
    from .launch import find_trainer, trainer_env
    from .procs import terminate_group
    from .progress import parse_trainer_log
    from .runstore import home

    if steps < 2:
        raise ValueError("probe steps must be >= 2")
    base = Path(workdir) if workdir else home(env) / "scratch"
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="probe-", dir=base))
    out_dir = scratch / "output"
    cfg_path = scratch / "probe.yaml"
    cfg_path.write_text(dump_yaml(probe_config(config_values, out_dir, steps, warmup)))
    log_path = scratch / "probe.log"
    cmd = [*find_trainer(env), "train", str(cfg_path)]
    tlog = out_dir / "trainer_log.jsonl"
    observed: dict[int, float] = {}
    t0 = clock()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=trainer_env(env, plan_env or {}),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=scratch,
            start_new_session=True,
        )
    offset = 0
    try:
        while True:
            rc = proc.poll()
            if tlog.exists():
                with open(tlog) as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                offset += len(complete.encode())
                now = clock() - t0
                for rec in parse_trainer_log(complete):
                    if rec.get("loss") is not None:
                        observed.setdefault(int(rec["current_steps"]), now)
            if rc is not None:
                break
            if timeout is not None and clock() - t0 > timeout:
                terminate_group(proc.pid, grace=10)
                raise FtlaunchError(
                    f"the probe did not finish within {timeout:.0f} s", hint=f"its log and config: {scratch}"
                )
            time.sleep(poll)
    except BaseException:
        if proc.poll() is None:
            terminate_group(proc.pid, grace=10)
        raise
    wall = clock() - t0
    records = parse_trainer_log(tlog.read_text()) if tlog.exists() else []
    if rc != 0 or len([r for r in records if r.get("loss") is not None]) < 2:
        text = log_path.read_text(errors="replace")
        raise FtlaunchError(
            f"the probe run failed (exit {rc}): {_last_error(text)}",
            hint=f"its log and config: {scratch}; `ftlaunch plan` shows what the config needs",
        )
    result = throughput_from_probe(records, observed, wall, warmup)
    if not keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return result


# ============================================================================================
# Putting it together (pure): the estimate's numbers as one value
# ============================================================================================


@dataclass(frozen=True)
class Estimate:
    stats: TokenStats
    padding: Padding
    steps: Steps
    time: TimeEstimate
    levers: tuple[Lever, ...]
    probe: Throughput | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        s = self.stats.summary()
        return {
            **s,
            "padding_share": round(self.padding.share, 4),
            "padding_share_packed": round(self.padding.share_packed, 4),
            "packed_rows": self.padding.packed_rows,
            "padded_tokens": round(self.padding.padded_tokens, 2),
            "padded_tokens_packed": round(self.padding.padded_tokens_packed, 2),
            "micro_batch": self.padding.micro_batch,
            "sampling": self.padding.sampling,
            "steps_per_epoch": self.steps.per_epoch,
            "optimizer_steps": self.steps.total,
            "epochs": round(self.steps.epochs, 4),
            "global_batch": self.steps.global_batch,
            "tokens_per_second": None if self.probe is None else _r(self.probe.tokens_per_second),
            "seconds_per_step": None if self.probe is None else _r(self.probe.seconds_per_step),
            "probe": None if self.probe is None else {k: _r(v) for k, v in self.probe.to_dict().items()},
            "time_source": self.time.source,
            "wall_hours": self.time.wall_hours,
            "wall_seconds_central": None if self.time.central_seconds is None else round(self.time.central_seconds, 1),
            "gpu_hours": self.time.gpu_hours,
            "gpus": self.time.gpus,
            "assumptions": list(self.time.assumptions) + list(self.stats.notes),
            "levers": [lv.to_dict() for lv in self.levers],
            **dict(self.extra),
        }


def _r(v: Any) -> Any:
    return round(v, 6) if isinstance(v, float) else v


def build_estimate(
    stats: TokenStats,
    *,
    micro_batch: int,
    accumulation: int,
    world_size: int,
    gpus: int,
    values: Mapping[str, Any],
    probe: Throughput | None = None,
    shape: ModelShape | None = None,
    peak_tflops_per_gpu: float | None = None,
    checkpointing_off_fits: bool | None = None,
    checkpointing_off_note: str = "",
    extra: Mapping[str, Any] | None = None,
) -> Estimate:
    """All of the estimate from data: the counted tokens, the planned batch, the adapted config
    ``values``, and a probe or a card's peak."""
    sampling = sampling_of(values)
    padding = padding_for(stats, micro_batch, sampling)
    epochs = float(values.get("num_train_epochs", 3.0) or 3.0)
    max_steps = values.get("max_steps")
    steps = optimizer_steps(
        stats.rows, micro_batch, accumulation, world_size, epochs, int(max_steps) if max_steps else None
    )
    total_steps = steps.total
    eval_strategy = values.get("eval_strategy", "no")
    evals = count_events(
        eval_strategy, values.get("eval_steps") or values.get("logging_steps"), total_steps, steps.epochs
    )
    saves = count_events(values.get("save_strategy", "steps"), values.get("save_steps", 500), total_steps, steps.epochs)
    ft = str(values.get("finetuning_type") or "lora")
    ckpt = not bool(values.get("disable_gradient_checkpointing"))
    ckpt_bytes = final_bytes = 0.0
    if shape is not None:
        trainable = shape.params if ft == "full" else shape.trainable_params
        ckpt_bytes = 12.0 * trainable  # fp32 weights (or adapter) + Adam's two fp32 moments
        final_bytes = 4.0 * trainable
    share = padding.share_packed if stats.packing else padding.share
    run = RunShape(
        steps=steps,
        tokens=run_tokens(stats, steps),
        padding=share,
        gpus=gpus,
        world_size=world_size,
        evals=evals,
        eval_tokens=stats.eval_tokens,
        saves=saves,
        checkpoint_bytes=ckpt_bytes,
        final_save_bytes=final_bytes,
    )
    if probe is not None:
        t = time_from_probe(run, probe)
    elif shape is not None and peak_tflops_per_gpu:
        # attention spans the sample (the whole packed row without neat_packing)
        seq = stats.cutoff_len if stats.packing else stats.total_tokens / max(1, len(stats.lengths))
        fpt = flops_per_token(shape, seq, ft, ckpt)
        t = time_from_flops(run, fpt, peak_tflops_per_gpu)
    else:
        why = (
            "no time estimate: the device has no peak FLOP/s figure (CPU or an unknown card) "
            "and no probe ran; `--probe-steps N` measures this machine"
            if shape is not None
            else "no time estimate: the model's size is unknown and no probe ran; `--probe-steps N` measures it"
        )
        t = no_time(run, why)
    lv = levers(
        train_seconds=t.train_central,
        total_seconds=t.central_seconds,
        padding=padding,
        packing=stats.packing,
        finetuning_type=ft,
        gradient_checkpointing=ckpt,
        checkpointing_off_fits=checkpointing_off_fits,
        checkpointing_off_note=checkpointing_off_note,
    )
    return Estimate(stats, padding, steps, t, tuple(lv), probe, dict(extra or {}))


def model_shape(spec: Any, trainable: int) -> ModelShape:
    """ModelShape from a ftlaunch.modelspec.ModelSpec (MoE: only the routed experts a token visits)."""
    active = spec.params
    if spec.num_experts and spec.experts_per_token and spec.moe_intermediate_size:
        idle = spec.num_experts - spec.experts_per_token
        active -= idle * 3 * spec.hidden_size * spec.moe_intermediate_size * spec.num_moe_layers
    return ModelShape(spec.params, int(active), spec.num_layers, spec.hidden_size, int(trainable))
