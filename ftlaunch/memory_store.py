"""What worked before: the micro-batch a config settled on, per config hash and GPU model.

Written by the supervisor when a run succeeded after shrinking its micro-batch; read by `plan`,
which then starts from it (and says so) instead of OOMing again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .runstore import home, now_iso, write_json_atomic

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
    data[key] = {
        "micro_batch": values.get("per_device_train_batch_size"),
        "gradient_accumulation_steps": values.get("gradient_accumulation_steps"),
        "disable_gradient_checkpointing": values.get("disable_gradient_checkpointing"),
        "learned_from": reason,
        "at": now_iso(),
    }
    write_json_atomic(_path(env), data)


def recall(env: Mapping[str, str], key: str) -> dict[str, Any] | None:
    return _load(env).get(key)
