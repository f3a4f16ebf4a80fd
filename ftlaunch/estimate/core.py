"""Estimate a fine-tune before committing hardware: steps, time, GPU-hours, levers.

The pure core of ``ftlaunch estimate``: optimizer steps as the HF Trainer counts them, time and
GPU-hour ranges from a probe or from peak FLOP/s x a stated utilisation, the levers that would
change the time most, and ``build_estimate``, which puts it all together as one ``Estimate``.
(A run's own GPU-hours, attempts and rates are ftlaunch.run.accounting's.)

Its inputs come from ftlaunch.estimate.padding (token counts, padding, packing), ftlaunch.estimate.throughput (probe
rates, FLOPs per token, peak FLOP/s) and the shells in ftlaunch.estimate.probe (the counting child, the
probe run); ftlaunch.estimate.usecase calls it. Method, assumptions and measured figures: docs/estimate.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftlaunch.estimate.padding import Padding, TokenStats, padding_for, sampling_of
from ftlaunch.estimate.throughput import ModelShape, Throughput, flops_per_token
from ftlaunch.plan.batch import epoch_steps
from ftlaunch.run.accounting import gpu_hours

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
    batches, per_epoch = epoch_steps(rows, micro_batch, accumulation, world_size)
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
# Time and GPU-hours
# ============================================================================================

UTILISATION = (0.25, 0.50)  # model FLOPs utilisation assumed without a probe (low, high)
STARTUP_GUESS_SECONDS = (60.0, 600.0)  # model load + preprocessing, without a probe
WRITE_BYTES_PER_SECOND = (0.5e9, 2.0e9)  # checkpoint write speed assumed (low, high)


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
        return _outward(self.wall_seconds[0] / 3600, self.wall_seconds[1] / 3600)

    @property
    def central_shown(self) -> float | None:
        """The central wall time in seconds as printed (0.1 s), never outside the printed range
        (a short run's range can be narrower than the rounding: 8.64 s <= 8.6 s failed once)."""
        if self.central_seconds is None:
            return None
        c = round(self.central_seconds, 1)
        hours = self.wall_hours
        return c if hours is None else min(max(c, hours[0] * 3600), hours[1] * 3600)

    @property
    def gpu_hours(self) -> list[float] | None:
        if self.wall_seconds is None:
            return None
        return _outward(*(gpu_hours(s, self.gpus) for s in self.wall_seconds))


def _outward(low: float, high: float, places: int = 6) -> list[float]:
    """A range rounded outwards: the low end down, the high end up, so it still holds every value
    it held (rounding both to nearest moved a seconds-long range past its own central value)."""
    f = 10**places
    return [math.floor(low * f) / f, math.ceil(high * f) / f]


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
            "wall_seconds_central": self.time.central_shown,
            "train_seconds_central": None if self.time.train_central is None else round(self.time.train_central, 1),
            "run_tokens": round(run_tokens(self.stats, self.steps)),
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
