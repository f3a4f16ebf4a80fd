"""The one ZeRO-3 CPU-offload rule, shared by the memory chooser (planning) and the OOM ladder (recovery),
and what a plan does to a user's own DeepSpeed JSON.

Both decide "offload" as the placeholder value ``ZERO3_OFFLOAD`` for the ``deepspeed`` key; ``materialize``
turns it into what the trainer needs: the bundled DeepSpeed config and a torchrun launch for the
planned world size (DeepSpeed refuses to start without FORCE_TORCHRUN, even on one GPU; the env comes
from ``rules.launch_env``, the one place a world size becomes variables). ``refusal`` says when the
trainer would refuse ZeRO-3 for a config (``rules.zero3_refusals``).

A user's DeepSpeed JSON may fix the batch (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` as numbers): ``source_batch`` reads them for the source global batch;
transformers refuses numbers that differ from the TrainingArguments (integrations/deepspeed.py
``trainer_config_process``: "Please correct the following DeepSpeed config values that mismatch"),
so when the plan's differ, ``with_auto_batch`` makes the adapted copy the plan carries (inline in the
adapted config), with "auto" there. When offload replaces the user's JSON, ``carry_over`` keeps its
other settings (buckets, ``sub_group_size``, optimizer, precision sections) and lists what it drops.
Pure but for the path of a package file (its content is read by the shell: ``memory.adapt.offload_config``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

from ftlaunch.plan import rules

ZERO3_OFFLOAD = "ds_z3_offload"  # placeholder value, mapped to ftlaunch/data/ds_z3_offload_config.json


def offload_config_path() -> str:
    return str(resources.files("ftlaunch").joinpath("data/ds_z3_offload_config.json"))


def materialize(value: Any, world_size: int = 1) -> tuple[Any, dict[str, str]]:
    """(config value, launch env) for a decided value: the placeholder becomes the bundled config,
    launched as ``world_size`` processes (never fewer than the plan's: NPROC_PER_NODE is the world)."""
    if value == ZERO3_OFFLOAD:
        return offload_config_path(), rules.launch_env(world_size, gpus=world_size, deepspeed=True)
    return value, {}


def refusal(values: Mapping[str, Any], ptq: str | None = None) -> str | None:
    """Why ZeRO-3 offload may not be put into ``values`` (the trainer's own words), or None."""
    found = rules.zero3_refusals(values, ptq)
    return "; ".join(str(r) for r in found) or None


# ------------------------------------------------------------------ a user's own DeepSpeed JSON

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def fixed_batch(ds: Mapping[str, Any] | None) -> dict[str, int]:
    """The batch numbers a DeepSpeed JSON fixes (not "auto", not absent), by key."""
    out: dict[str, int] = {}
    for key in BATCH_KEYS:
        v = (ds or {}).get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 or v != int(v):
            continue
        out[key] = int(v)
    return out


def source_batch(ds: Mapping[str, Any] | None, micro: int, accum: int, source_world: int) -> tuple[int, str] | None:
    """(source global batch, why) from the numbers a DeepSpeed JSON fixes, or None when it fixes none.

    ``train_batch_size`` is the global batch itself (DeepSpeed: micro x accumulation x world size);
    otherwise its micro-batch and accumulation stand in for the YAML's (``micro``, ``accum``)."""
    fixed = fixed_batch(ds)
    if "train_batch_size" in fixed:
        return fixed["train_batch_size"], f"train_batch_size {fixed['train_batch_size']} in the DeepSpeed JSON"
    if not fixed:
        return None
    m = fixed.get("train_micro_batch_size_per_gpu", micro)
    a = fixed.get("gradient_accumulation_steps", accum)
    said = ", ".join(f"{k} {v}" for k, v in fixed.items())
    return m * a * source_world, f"{m} x {a} x {source_world} GPU(s), {said} in the DeepSpeed JSON"


def batch_mismatch(ds: Mapping[str, Any] | None, micro: int, accum: int, world: int) -> list[str]:
    """The batch numbers of ``ds`` that differ from a plan's micro-batch x accumulation x world size."""
    planned = {
        "train_batch_size": micro * accum * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
    }
    return [f"{k} {v} (the plan: {planned[k]})" for k, v in fixed_batch(ds).items() if v != planned[k]]


def with_auto_batch(ds: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``ds`` whose batch numbers are "auto": transformers fills them from the plan."""
    out = copy.deepcopy(dict(ds))
    for key in fixed_batch(ds):
        out[key] = "auto"
    return out


_REPLACED_ZERO_KEYS = ("stage", "offload_optimizer", "offload_param")


def carry_over(user: Mapping[str, Any], offload: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``offload`` (the ZeRO-3 CPU-offload JSON) with every other setting of the user's JSON carried over,
    and what was dropped: the user's ZeRO stage and offload targets (offload replaces them) and fixed
    batch numbers (the plan's, through "auto")."""
    merged = copy.deepcopy(dict(offload))
    dropped: list[str] = [f"{k} {v}" for k, v in fixed_batch(user).items()]
    for key, value in user.items():
        if key in BATCH_KEYS:
            continue
        if key == "zero_optimization" and isinstance(value, Mapping):
            zero = dict(merged.get("zero_optimization") or {})
            for zk, zv in value.items():
                if zk in _REPLACED_ZERO_KEYS:
                    if zv != zero.get(zk):
                        dropped.append(f"zero_optimization.{zk} {json.dumps(zv)}")
                    continue
                zero[zk] = copy.deepcopy(zv)
            merged["zero_optimization"] = zero
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **copy.deepcopy(dict(value))}
        else:
            merged[key] = copy.deepcopy(value)
    return merged, dropped
