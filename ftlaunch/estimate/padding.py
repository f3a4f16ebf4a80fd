"""Lengths, padding and packing: what llamafactory's tokenized data costs per micro-batch.

Pure, over lists of sequence lengths: nearest-rank percentiles; the tokens computed at a micro-batch
with padding (random, sequential or length-grouped batches; the collator pads to a multiple of 8);
llamafactory's packing (its greedy knapsack, per preprocessing batch and worker shard); and
``TokenStats``, the tokenized training data as the trainer will see it, built from what the counting
child in ftlaunch.estimate.probe writes. Method: docs/estimate.md, sections 1-2.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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
    """Build TokenStats from what the counting child wrote (ftlaunch/estimate/count_child.py)."""
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
