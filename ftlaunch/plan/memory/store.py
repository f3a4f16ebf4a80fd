"""What worked before, per config hash and GPU model: the micro-batch a config settled on, and the
GPU memory a run of it was observed to use.

Written by the supervisor: ``remember`` when a run succeeded after shrinking its micro-batch,
``remember_observed`` with the peak it sampled (NVML) beside the peak the plan predicted. Read by
`plan`: it starts from the remembered micro-batch (and says so) instead of OOMing again, and
scales its predictions by ``correction_from`` the observation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftlaunch.files import home, now_iso, write_json_atomic

# Keys that the planner itself decides: leaving them out makes the hash stable across plans.
_PLANNED = {
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "overwrite_output_dir",
    "bf16",
    "fp16",
    "pure_bf16",
    "deepspeed",
    "disable_gradient_checkpointing",
    "flash_attn",
}


def config_key(values: Mapping[str, Any], gpu_model: str, global_batch: int) -> str:
    stable = {k: v for k, v in sorted(values.items()) if k not in _PLANNED}
    stable["__global_batch__"] = global_batch
    digest = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{digest}:{gpu_model}"


def _path(env: Mapping[str, str]) -> Path:
    return home(env) / "learned.json"


def _load(env: Mapping[str, str]) -> dict[str, Any]:
    try:
        data = json.loads(_path(env).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def remember(env: Mapping[str, str], key: str, values: Mapping[str, Any], reason: str) -> None:
    data = _load(env)
    observed = (data.get(key) or {}).get("observed")
    data[key] = {
        "micro_batch": values.get("per_device_train_batch_size"),
        "gradient_accumulation_steps": values.get("gradient_accumulation_steps"),
        "disable_gradient_checkpointing": values.get("disable_gradient_checkpointing"),
        "learned_from": reason,
        "at": now_iso(),
    }
    if observed:
        data[key]["observed"] = observed
    write_json_atomic(_path(env), data)


def remember_observed(
    env: Mapping[str, str], key: str, *, observed_peak_gib: float, predicted_peak_gib: float, micro_batch: int
) -> None:
    """Record the GPU memory a run was seen to use (the largest NVML sample of its processes) beside
    what its plan predicted, for later plans of the same config on the same card. Keeps the
    largest observation for a micro-batch: a short run may not have met its longest batch."""
    data = _load(env)
    entry = data.setdefault(key, {})
    old = entry.get("observed") or {}
    if old.get("micro_batch") == micro_batch and float(old.get("observed_peak_gib", 0)) >= observed_peak_gib:
        return
    entry["observed"] = {
        "observed_peak_gib": round(observed_peak_gib, 3),
        "predicted_peak_gib": round(predicted_peak_gib, 3),
        "micro_batch": micro_batch,
        "at": now_iso(),
    }
    write_json_atomic(_path(env), data)


def correction_from(observed: Mapping[str, Any] | None) -> tuple[float, str | None]:
    """(factor for every predicted peak, why) from a ``remember_observed`` record. Pure.

    Only upward: a run that used less than predicted may simply not have met its longest batch,
    while one that used more shows the formulas are short for this config on this card.
    """
    if not observed:
        return 1.0, None
    try:
        seen, predicted = float(observed["observed_peak_gib"]), float(observed["predicted_peak_gib"])
    except (KeyError, TypeError, ValueError):
        return 1.0, None
    if predicted <= 0 or seen <= predicted:
        return 1.0, None
    factor = seen / predicted
    return factor, (
        f"a run of this config on this card used {seen:.2f} GiB where {predicted:.2f} was predicted "
        f"(micro-batch {observed.get('micro_batch')}): predictions scaled by {factor:.3f}"
    )


def recall(env: Mapping[str, str], key: str) -> dict[str, Any] | None:
    return _load(env).get(key)
