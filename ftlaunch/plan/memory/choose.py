"""The micro-batch choice built on the memory model: the verdict (fits / tight / does not fit),
the same-numbers ladder it may climb (checkpointing, attention kernel, ZeRO-3 offload), and what
would fit when nothing does, ordered by how much each option changes the training. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ftlaunch.plan.batch import divisors_desc
from ftlaunch.plan.change import Change
from ftlaunch.plan.memory.peak import Estimator, MemoryEstimate, corrected
from ftlaunch.plan.memory.prediction import Alternative, Kind, Verdict
from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.modelspec import ModelSpec
from ftlaunch.plan.offload import ZERO3_OFFLOAD

FITS, TIGHT, DOES_NOT_FIT = Verdict.FITS, Verdict.TIGHT, Verdict.DOES_NOT_FIT
# A tight plan keeps at least this share of the card free: the calibration goal lets the formulas
# under-predict by at most 2% (docs/memory-model.md, "Calibration"), so less than that is a guess.
MIN_HEADROOM = 0.02

SAME_NUMBERS, NUMERICS, METHOD, HARDWARE = Kind.SAME_NUMBERS, Kind.NUMERICS, Kind.METHOD, Kind.HARDWARE


def gib_pair(a: float, b: float) -> tuple[str, str]:
    """Two GiB figures with as many decimals (1 to 3) as it takes to tell them apart, so a refusal
    never reads "13.2 GiB > 13.2 GiB"."""
    x, y = f"{a:.1f}", f"{b:.1f}"
    for d in (1, 2, 3):
        x, y = f"{a:.{d}f}", f"{b:.{d}f}"
        if x != y:
            break
    return x, y


def verdict_of(peak_gib: float, capacity_gib: float, headroom: float) -> Verdict:
    """fits (peak within capacity x (1 - headroom)), tight (within capacity x (1 - MIN_HEADROOM)),
    or does_not_fit."""
    if peak_gib <= capacity_gib * (1 - headroom):
        return FITS
    if peak_gib <= capacity_gib * (1 - min(headroom, MIN_HEADROOM)):
        return TIGHT
    return DOES_NOT_FIT


def scan_micro_batches(est_fn: Estimator, setup: TrainSetup, candidates: list[int], per_device: int, limit: float):
    """The largest candidate micro-batch whose peak is within ``limit``; accumulation follows it."""
    tried: list[tuple[int, float]] = []
    for mb in candidates:
        est = est_fn(replace(setup, micro_batch=mb, accumulation=per_device // mb))
        tried.append((mb, round(est.peak_gib, 2)))
        if est.peak_gib <= limit:
            return mb, est, tuple(tried)
    return None, est_fn(replace(setup, micro_batch=1, accumulation=per_device)), tuple(tried)


@dataclass(frozen=True)
class Choice:
    micro_batch: int | None  # None -> nothing fits
    setup: TrainSetup  # the setup chosen (may have gradient_checkpointing/attn/zero changed)
    estimate: MemoryEstimate
    changes: tuple[Change, ...]  # what the chooser changed in the config (llamafactory keys), in order
    tried: tuple[tuple[int, float], ...]  # (micro_batch, peak_gib) for the final setup
    alternatives: tuple[Alternative, ...]  # filled when nothing fits
    verdict: Verdict = FITS
    capacity_gib: float = 0.0

    @property
    def headroom_gib(self) -> float:
        """What the predicted peak leaves free on the card."""
        return self.capacity_gib - self.estimate.peak_gib

    @property
    def headroom_share(self) -> float:
        return self.headroom_gib / self.capacity_gib if self.capacity_gib else 0.0


def choose_micro_batch(
    spec: ModelSpec,
    setup: TrainSetup,
    *,
    capacity_gib: float,
    per_device_batch: int,
    headroom: float = 0.12,
    host_ram_gib: float | None = None,
    host_ram_note: str | None = None,
    bf16_capable: bool = True,
    can_flash: bool = False,
    correction: float = 1.0,
    max_micro_batch: int | None = None,
    zero3_refused: str | None = None,
    deepspeed_refused: str | None = None,
) -> Choice:
    """Largest divisor of ``per_device_batch`` whose peak fits in capacity*(1-headroom).

    When even micro-batch 1 does not fit, in order: gradient checkpointing on, eager attention ->
    sdpa (fa2 if ``can_flash``), re-trying all batch sizes after each step. If still nothing fits
    with the target headroom, the largest micro-batch within capacity*(1-MIN_HEADROOM) is taken
    with verdict *tight* (it runs at full speed; the recovery ladder covers a misjudgement).
    Only then ZeRO-3 with CPU offload of optimizer and parameters (only if the host RAM is known
    and suffices: it is several times slower). finetuning_type, cutoff_len, learning rate and data
    are never changed; if nothing fits ``micro_batch`` is None, the verdict *does_not_fit*, and
    ``alternatives`` lists what would, ordered by how much each changes the training.
    ``host_ram_note`` says where ``host_ram_gib`` comes from when it is an assumption;
    ``correction`` scales every predicted peak (see :func:`corrected`); ``max_micro_batch`` (what
    worked on this card before) caps the micro-batches tried. ``zero3_refused`` (why the trainer
    refuses ZeRO-3 for this config, :mod:`ftlaunch.plan.rules`) and ``deepspeed_refused`` (why no
    DeepSpeed at all, e.g. not installed) keep the offload step out, and mark the alternatives that
    would need it as not fitting, with that reason.
    """
    if per_device_batch < 1:
        raise ValueError("per_device_batch must be >= 1")
    if capacity_gib <= 0:
        raise ValueError("capacity_gib must be > 0")
    usable = capacity_gib * (1 - headroom)
    tight_limit = capacity_gib * (1 - min(headroom, MIN_HEADROOM))
    host_usable = host_ram_gib * (1 - headroom) if host_ram_gib is not None else None
    cands = [d for d in divisors_desc(per_device_batch) if max_micro_batch is None or d <= max_micro_batch]
    changes: list[Change] = []
    est_fn = corrected(spec, correction)

    def done(mb: int, cur: TrainSetup, est: MemoryEstimate, tried: tuple, verdict: Verdict) -> Choice:
        chosen = replace(cur, micro_batch=mb, accumulation=per_device_batch // mb)
        return Choice(mb, chosen, est, tuple(changes), tried, (), verdict, capacity_gib)

    def over(peak: float) -> str:
        p, u = gib_pair(peak, usable)
        return f"peak {p} GiB > {u} GiB usable ({capacity_gib:g} GiB, {headroom * 100:.0f}% headroom) at micro-batch 1"

    cur = setup
    mb, est, tried = scan_micro_batches(est_fn, cur, cands, per_device_batch, usable)
    if mb is not None:
        return done(mb, cur, est, tried, FITS)

    # Same numbers, cheaper memory: checkpointing, then a kernel that does not store the scores.
    impl = "fa2" if can_flash else "sdpa"
    ladder = (
        (
            not cur.gradient_checkpointing,
            ("disable_gradient_checkpointing", True, False),
            {"gradient_checkpointing": True},
            "gradient checkpointing keeps only each layer's input",
        ),
        (
            cur.attn_impl == "eager",
            ("flash_attn", "disabled", impl),
            {"attn_impl": impl},
            f"{impl} attention does not store the {cur.seq_len}x{cur.seq_len} score matrix per head",
        ),
    )
    for wanted, (key, old, new), fields, why in ladder:
        if not wanted:
            continue
        cur = replace(cur, **fields)
        after = est_fn(replace(cur, micro_batch=1, accumulation=per_device_batch)).peak_gib
        changes.append(Change(key, old, new, f"{over(est.peak_gib)}; {why}: {after:.1f} GiB"))
        mb, est, tried = scan_micro_batches(est_fn, cur, cands, per_device_batch, usable)
        if mb is not None:
            return done(mb, cur, est, tried, FITS)

    base_for_alternatives = cur
    mb, t_est, t_tried = scan_micro_batches(est_fn, cur, cands, per_device_batch, tight_limit)
    if mb is not None:
        return done(mb, cur, t_est, t_tried, TIGHT)

    # ZeRO-3 with CPU offload of optimizer states and parameters
    offload = replace(cur, zero_stage=3, offload_optimizer=True, offload_params=True)
    if offload != cur and not (zero3_refused or deepspeed_refused):
        off_est = est_fn(replace(offload, micro_batch=1, accumulation=per_device_batch))
        if host_usable is not None and off_est.host_gib <= host_usable:
            changes.append(
                Change(
                    "deepspeed",
                    None if cur.zero_stage == 0 else f"zero{cur.zero_stage}",
                    ZERO3_OFFLOAD,
                    f"{over(est.peak_gib)}; ZeRO-3 CPU offload moves parameters and optimizer states "
                    f"to host RAM (needs {off_est.host_gib:.1f} GiB of {host_ram_gib:g} GiB"
                    f"{', ' + host_ram_note if host_ram_note else ''}): {off_est.peak_gib:.1f} GiB",
                )
            )
            cur = offload
            for limit, verdict in ((usable, FITS), (tight_limit, TIGHT)):
                mb, o_est, o_tried = scan_micro_batches(est_fn, cur, cands, per_device_batch, limit)
                if mb is not None:
                    return done(mb, cur, o_est, o_tried, verdict)

    alternatives = _alternatives(
        est_fn,
        replace(base_for_alternatives, accumulation=per_device_batch),
        capacity_gib,
        headroom,
        host_ram_gib,
        host_ram_note,
        bf16_capable,
        zero3_refused,
        deepspeed_refused,
    )
    return Choice(
        None,
        replace(cur, micro_batch=1, accumulation=per_device_batch),
        est,
        tuple(changes),
        tried,
        alternatives,
        DOES_NOT_FIT,
        capacity_gib,
    )


def _host_check(need_gib: float, host_ram_gib: float | None, headroom: float, note: str | None) -> str | None:
    """None when ``need_gib`` of host RAM is available, else why not."""
    if host_ram_gib is None:
        return f"needs {need_gib:.0f} GiB host RAM; host RAM unknown (pass --host-ram)"
    if need_gib > host_ram_gib * (1 - headroom):
        where = f"machine has {host_ram_gib:.0f}" + (f" ({note})" if note else "")
        return f"needs {need_gib:.0f} GiB host RAM, {where}"
    return None


def _alternatives(
    est_fn: Estimator,
    base: TrainSetup,
    capacity_gib: float,
    headroom: float,
    host_ram_gib: float | None,
    host_ram_note: str | None,
    bf16_capable: bool,
    zero3_refused: str | None = None,
    deepspeed_refused: str | None = None,
) -> tuple[Alternative, ...]:
    """What would fit at micro-batch 1, each option changing one thing the chooser may not.

    Rows are ordered by kind: same numbers (DeepSpeed offload on the same GPUs), numerics (8-bit
    optimizer states, pure_bf16), method or data (LoRA, QLoRA, cutoff), then more hardware. Each
    has its predicted GPU peak, host RAM need, a speed word and, when it does not fit, why.
    """
    base = replace(base, micro_batch=1)
    out: list[Alternative] = []

    def add(option: str, kind: Kind, setup: TrainSetup, change: dict, speed: str) -> None:
        est = est_fn(setup)
        verdict = verdict_of(est.peak_gib, capacity_gib, headroom)
        why = None
        if verdict == DOES_NOT_FIT:
            p, c = gib_pair(est.peak_gib, capacity_gib * (1 - min(headroom, MIN_HEADROOM)))
            why = f"peak {p} GiB > {c} GiB"
        elif verdict == TIGHT:
            why = f"tight: {(capacity_gib - est.peak_gib) / capacity_gib:.1%} headroom"
        host_why = _host_check(est.host_gib, host_ram_gib, headroom, host_ram_note) if est.host_gib else None
        if host_why:
            why = host_why if why is None or verdict == TIGHT else f"{why}; {host_why}"
        refused = deepspeed_refused if setup.zero_stage else None
        refused = refused or (zero3_refused if setup.zero_stage == 3 else None)
        fits = verdict != DOES_NOT_FIT and host_why is None and not refused  # refused: never offered as fitting
        row = Alternative(
            option=option,
            kind=kind,
            peak_gib=round(est.peak_gib, 2),
            host_gib=round(est.host_gib, 1),
            fits=fits,
            verdict=verdict if host_why is None and not refused else DOES_NOT_FIT,
            change=change,
            speed=speed,
            why=why,
            offloads=bool(est.host_gib),
            host_ram_gib=host_ram_gib,
            refused=refused,
        )
        out.append(row)

    full_or_freeze = base.finetuning_type in ("full", "freeze")
    # --- same numbers: DeepSpeed on the GPUs at hand, optimizer (and parameters) in host RAM
    if full_or_freeze and base.zero_stage == 0:
        add(
            "ZeRO-2 optimizer offload",
            SAME_NUMBERS,
            replace(base, zero_stage=2, offload_optimizer=True, offload_params=False),
            {"deepspeed": "ds_z2_offload"},
            "slower (optimizer step on the CPU)",
        )
    off = replace(base, zero_stage=3, offload_optimizer=True, offload_params=True)
    if off != base:
        add(
            "ZeRO-3 CPU offload",
            SAME_NUMBERS,
            off,
            {"deepspeed": ZERO3_OFFLOAD},
            "much slower (weights streamed from host RAM)",
        )
    # --- numerics: 8-bit optimizer states, bf16 weights without fp32 masters
    if full_or_freeze and "8bit" not in base.optimizer:
        add(
            "8-bit AdamW",
            NUMERICS,
            replace(base, optimizer="adamw_bnb_8bit"),
            {"optim": "adamw_bnb_8bit"},
            "same",
        )
        add(
            "paged 8-bit AdamW",
            NUMERICS,
            replace(base, optimizer="paged_adamw_8bit"),
            {"optim": "paged_adamw_8bit"},
            "same (pages states to host RAM under pressure)",
        )
    if base.finetuning_type == "full" and not base.pure_bf16 and bf16_capable:
        add(
            "pure_bf16 (no fp32 master weights)",
            NUMERICS,
            replace(base, pure_bf16=True, compute_dtype="bf16"),
            {"pure_bf16": True, "bf16": True},
            "same or faster",
        )
    # --- method or data
    is_lora = base.finetuning_type in ("lora", "oft")
    # LLaMA-Factory refuses LoRA with GaLore, APOLLO or BAdam (finetuning_args.py:595): LoRA rows drop them
    lora_off: dict[str, Any] = {}
    if base.custom is not None and base.custom.kind in ("galore", "apollo", "badam"):
        lora_off = {f"use_{base.custom.kind}": False}
    if not is_lora or base.quantization_bit is not None:
        add(
            "LoRA r=8",
            METHOD,
            replace(
                base,
                finetuning_type="lora",
                lora_rank=8,
                lora_target="all",
                quantization_bit=None,
                pure_bf16=False,
                zero_stage=0,
                offload_optimizer=False,
                offload_params=False,
                custom=None if lora_off else base.custom,
            ),
            {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "quantization_bit": None, **lora_off},
            "faster",
        )
    for bits in (8, 4):
        if base.quantization_bit == bits:
            continue
        ch: dict[str, Any] = {"finetuning_type": "lora", "quantization_bit": bits, **lora_off}
        qs = replace(base, finetuning_type="lora", quantization_bit=bits, pure_bf16=False)
        qs = replace(qs, custom=None) if lora_off else qs
        if not is_lora:
            ch.update({"lora_rank": 8, "lora_target": "all"})
            qs = replace(qs, lora_rank=8, lora_target="all", optimizer=base.optimizer)
        # QLoRA cannot be combined with ZeRO-3 param offload in llamafactory; drop DeepSpeed there
        if qs.zero_stage == 3:
            qs = replace(qs, zero_stage=0, offload_optimizer=False, offload_params=False)
        add(f"QLoRA {bits}-bit", METHOD, qs, ch, "faster than full, slower than LoRA (dequantisation)")
    if base.seq_len >= 2:
        half = base.seq_len // 2
        add(
            f"cutoff_len {half}",
            METHOD,
            replace(base, seq_len=half),
            {"cutoff_len": half},
            "faster (longer samples truncated)",
        )
    # --- more GPUs: ZeRO-3 (no offload) over N GPUs, the smallest N in 2..64 that fits
    chosen = None
    for n in (2, 4, 8, 16, 32, 64):
        if n <= base.world_size:
            continue
        cand = replace(base, world_size=n, zero_stage=3, offload_optimizer=False, offload_params=False)
        chosen = (n, cand)
        if est_fn(cand).peak_gib <= capacity_gib * (1 - headroom):
            break
    if chosen is not None:
        n, cand = chosen
        add(f"ZeRO-3 on {n} GPUs", HARDWARE, cand, {"deepspeed": "ds_z3", "gpus": n}, "faster")
    return tuple(out)
