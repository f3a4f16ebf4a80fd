"""The host-RAM verdict of a plan without a GPU: training on the CPU, where RAM is the limit.

The same three-way verdict as on a card (``choose.verdict_of``: fits within the headroom, tight
within the RAM less 2%, else does not fit), against the host's RAM: the tensors of a step as the GPU
model counts them for fp32 training (weights, gradients, optimizer states, activations, logits:
``peak.estimate`` with ``compute_dtype`` fp32, which is all a CPU plan trains in) plus what the
trainer's process holds before any tensor (the Python interpreter with torch, transformers, datasets
and llamafactory imported, the tokenizer and the tokenized dataset), or, when larger, the loading
peak: the checkpoint's pages mapped from disk (safetensors) while the fp32 copy is made. The
constants are measured against real CPU runs with ``scripts/bench_host_memory.py`` (figures beside
them). It picks
the largest micro-batch that divides the per-device batch and fits, as on a card; when none does it
lists what would (LoRA, a shorter cutoff, a GPU from the catalog). Pure.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from ftlaunch.plan.batch import divisors_desc
from ftlaunch.plan.hardware import CATALOG
from ftlaunch.plan.memory.choose import (
    DOES_NOT_FIT,
    FITS,
    HARDWARE,
    METHOD,
    MIN_HEADROOM,
    TIGHT,
    Choice,
    scan_micro_batches,
    verdict_of,
)
from ftlaunch.plan.memory.peak import GIB, MemoryEstimate, estimate
from ftlaunch.plan.memory.prediction import Alternative, Kind
from ftlaunch.plan.memory.setup import TrainSetup
from ftlaunch.plan.modelspec import ModelSpec

# Resident set of llamafactory-cli train (the whole process tree) beside the model's tensors:
# measured peak RSS 1.284 GiB (full) and 1.138 GiB (LoRA) for the ~170k-parameter tiny model, whose
# tensors are a few MiB (10 steps each, scripts/bench_host_memory.py): their mean. Interpreter, torch,
# transformers, datasets, llamafactory, the tokenizer and the tokenized dataset.
# Held out (measured after the constants were set, cutoff 256): tiny full 1.272 GiB (-4.0%), tiny LoRA
# 1.270 (-3.9%), 86M full 2.514 (+2.6%), 86M LoRA 1.655 (+2.2%); the 86M runs at cutoff 128 before them:
# full 2.504 (+1.2%), LoRA 1.736 (-2.6%).
HOST_BASE_GIB = 1.21
# How far that base moves between machines (library builds, thread pools, page sizes): 1.14-1.28 GiB
# here, 1.36 GiB for the same 4-step tiny run on the CI's machine. The verdict's headroom (12% of RAM)
# covers it; a prediction is held to 10% of the peak or this, whichever is larger.
HOST_BASE_SPREAD_GIB = 0.2
# What the tensor peak adds in RSS beyond the tensors themselves (allocator slack): none was seen on
# the ~86M-parameter model's full fine-tuning (1.33 GiB of tensors, 2.50 GiB peak RSS).
HOST_SLACK = 0.0
# Loading: the checkpoint's pages mapped from disk stay resident while each tensor is copied to fp32;
# hub checkpoints are 16-bit (2 bytes a parameter) and the copy 4 bytes.
CHECKPOINT_BYTES = 2

# GPUs offered when nothing fits in RAM, smallest first (plan/hardware.py CATALOG names)
GPU_OPTIONS = ("T4", "A10G", "A100-40GB", "A100-80GB", "H200")


def host_estimate(spec: ModelSpec, setup: TrainSetup, processes: int = 1) -> MemoryEstimate:
    """Peak resident memory (GiB) of one CPU training step of ``setup`` (trained in fp32), over all
    ``processes`` trainer processes: each (``--gpu nonexN``) holds its own interpreter, model, gradients
    and optimizer states, so the host holds ``processes`` times one."""
    cpu = replace(setup, compute_dtype="fp32", pure_bf16=False, world_size=1, zero_stage=0)
    cpu = replace(cpu, offload_optimizer=False, offload_params=False, attn_impl=_cpu_attn(cpu.attn_impl))
    est = estimate(spec, cpu)
    tensors = est.tensors_gib
    loading = spec.params * (CHECKPOINT_BYTES + 4) / GIB
    peak = (max(tensors * (1 + HOST_SLACK), loading) + HOST_BASE_GIB) * max(1, processes)
    tensors *= max(1, processes)
    return replace(est, tensors_gib=tensors, peak_gib=peak, overhead_gib=peak - tensors, host_gib=0.0)


def _cpu_attn(impl: str) -> str:
    """FlashAttention-2 has no CPU kernel; the trainer falls back to torch SDPA."""
    return "sdpa" if impl == "fa2" else impl


def choose_on_host(
    spec: ModelSpec,
    setup: TrainSetup,
    *,
    host_ram_gib: float,
    per_device_batch: int,
    headroom: float = 0.12,
    max_micro_batch: int | None = None,
    processes: int = 1,
) -> Choice:
    """The largest micro-batch dividing ``per_device_batch`` whose host peak (``processes`` trainer
    processes) fits the RAM with ``headroom`` (verdict fits), else within the RAM less MIN_HEADROOM
    (tight), else none (does not fit, with the alternatives). Nothing about the training changes."""
    usable = host_ram_gib * (1 - headroom)
    tight = host_ram_gib * (1 - min(headroom, MIN_HEADROOM))
    cands = [d for d in divisors_desc(per_device_batch) if max_micro_batch is None or d <= max_micro_batch]
    est_fn = partial(host_estimate, spec, processes=processes)
    for limit, verdict in ((usable, FITS), (tight, TIGHT)):
        mb, est, tried = scan_micro_batches(est_fn, setup, cands, per_device_batch, limit)
        if mb is not None:
            chosen = replace(setup, micro_batch=mb, accumulation=per_device_batch // mb)
            return Choice(mb, chosen, est, (), tried, (), verdict, host_ram_gib)
    one = replace(setup, micro_batch=1, accumulation=per_device_batch)
    alts = host_alternatives(spec, one, host_ram_gib, headroom)
    return Choice(None, one, est, (), tried, alts, DOES_NOT_FIT, host_ram_gib)


def host_alternatives(
    spec: ModelSpec, base: TrainSetup, host_ram_gib: float, headroom: float
) -> tuple[Alternative, ...]:
    """What would fit when a CPU plan does not, at micro-batch 1: LoRA and a shorter cutoff in this
    RAM, then the smallest catalog GPU where the config as written fits (a card's verdict)."""
    out: list[Alternative] = []

    def row(option: str, kind: Kind, est: MemoryEstimate, capacity: float, change: dict[str, Any], speed: str) -> None:
        verdict = verdict_of(est.peak_gib, capacity, headroom)
        where = "host RAM" if kind is METHOD else "the card"
        why = None
        if verdict is DOES_NOT_FIT:
            why = f"peak {est.peak_gib:.1f} GiB > {capacity * (1 - min(headroom, MIN_HEADROOM)):.1f} GiB of {where}"
        elif verdict is TIGHT:
            why = f"tight: {(capacity - est.peak_gib) / capacity:.1%} of {where} free"
        out.append(
            Alternative(
                option=option,
                kind=kind,
                peak_gib=round(est.peak_gib, 2),
                host_gib=0.0,
                fits=verdict is not DOES_NOT_FIT,
                verdict=verdict,
                change=change,
                speed=speed,
                why=why,
            )
        )

    if base.finetuning_type not in ("lora", "oft"):
        lora = replace(base, finetuning_type="lora", lora_rank=8, lora_target="all", custom=None)
        change: dict[str, Any] = {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all"}
        if base.custom is not None and base.custom.kind in ("galore", "apollo", "badam"):
            change[f"use_{base.custom.kind}"] = False  # LLaMA-Factory refuses LoRA with them
        row("LoRA r=8", METHOD, host_estimate(spec, lora), host_ram_gib, change, "faster")
    if base.seq_len >= 2:
        half = base.seq_len // 2
        row(
            f"cutoff_len {half}",
            METHOD,
            host_estimate(spec, replace(base, seq_len=half)),
            host_ram_gib,
            {"cutoff_len": half},
            "faster (longer samples truncated)",
        )
    for card in GPU_OPTIONS:
        _, mib, cc = CATALOG[card]
        capacity = mib / 1024
        on_gpu = replace(base, compute_dtype="bf16" if cc >= (8, 0) else "fp16", world_size=1)
        est = estimate(spec, on_gpu)
        if verdict_of(est.peak_gib, capacity, headroom) is FITS:
            row(f"a GPU: {card}", HARDWARE, est, capacity, {"gpu": card}, "much faster")
            return tuple(out)
    # no single card: ZeRO-3 over the fewest A100-80GBs that hold it
    _, mib, _ = CATALOG["A100-80GB"]
    for n in (2, 4, 8, 16, 32, 64):
        sharded = replace(base, compute_dtype="bf16", world_size=n, zero_stage=3)
        est = estimate(spec, sharded)
        if verdict_of(est.peak_gib, mib / 1024, headroom) is FITS or n == 64:
            change = {"gpu": f"A100-80GBx{n}", "deepspeed": "ds_z3"}
            row(f"GPUs: A100-80GBx{n}, ZeRO-3", HARDWARE, est, mib / 1024, change, "much faster")
            break
    return tuple(out)


def host_verdict_line(choice: Choice, host_ram_gib: float, note: str | None) -> str:
    """How a refusal or a tight plan says the host figures."""
    where = f"{host_ram_gib:g} GiB of host RAM" + (f" ({note})" if note else "")
    return f"predicted peak {choice.estimate.peak_gib:.2f} GiB of {where}"


__all__ = [
    "GPU_OPTIONS",
    "HOST_BASE_GIB",
    "HOST_BASE_SPREAD_GIB",
    "HOST_SLACK",
    "CHECKPOINT_BYTES",
    "choose_on_host",
    "host_alternatives",
    "host_estimate",
    "host_verdict_line",
]
