"""How fast training runs: measured by a probe, or guessed from a card's peak FLOP/s.

Pure: the sustained rate (seconds/step, tokens/s) from a probe's trainer_log.jsonl records, warm-up
steps discarded and start-up and teardown split off; the dense peak TFLOP/s of a card (the figures
are the GPU catalog's, ftlaunch.plan.catalog); and training FLOPs per token for a ``ModelShape``.
ftlaunch.estimate.core turns these into time ranges; ftlaunch.estimate.probe runs the probe. Method:
docs/estimate.md, sections 4-5.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftlaunch.run.accounting import trainer_clock

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


def _norm(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def peak_tflops(gpu_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of one GPU for ``precision`` (bf16/fp16/pure_bf16 or fp32); None if unknown.

    The figures are the catalog's (ftlaunch.plan.catalog.CARDS): a card named as NVML names it or by
    its catalog key, else a probed name matched to a card's family, then to its memory."""
    from ftlaunch.plan.catalog import CARDS

    wanted = _norm(gpu_name)
    key = next(
        (k for k, c in CARDS.items() if _norm(k) == wanted or any(_norm(n) == wanted for n in c.nvml_names)), None
    )
    if key is None:  # a probed name that is not in the catalog: match the family, then the memory
        found = [k for k in CARDS if _norm(k.split("-")[0]) in wanted]
        longest = max((len(k.split("-")[0]) for k in found), default=0)
        found = [k for k in found if len(k.split("-")[0]) == longest]
        exact = [k for k in found if "-" in k and _norm(k.split("-")[1]) in wanted]
        found = exact or found
        figures = {(CARDS[k].tflops_16bit, CARDS[k].tflops_fp32) for k in found}
        key = found[0] if found and len(figures) == 1 else None
    return None if key is None else CARDS[key].peak_tflops(precision)


@dataclass(frozen=True)
class ModelShape:
    """What FLOP counting needs of a model (from ftlaunch.plan.modelspec.ModelSpec)."""

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


def model_shape(spec: Any, trainable: int) -> ModelShape:
    """ModelShape from a ftlaunch.plan.modelspec.ModelSpec (MoE: only the routed experts a token visits)."""
    active = spec.params
    if spec.num_experts and spec.experts_per_token and spec.moe_intermediate_size:
        idle = spec.num_experts - spec.experts_per_token
        active -= idle * 3 * spec.hidden_size * spec.moe_intermediate_size * spec.num_moe_layers
    return ModelShape(spec.params, int(active), spec.num_layers, spec.hidden_size, int(trainable))
