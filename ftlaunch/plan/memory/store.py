"""What worked before, per config hash and GPU model: the micro-batch a config settled on, and the
GPU memory a run of it was observed to use.

Written by the supervisor: ``remember`` when a run succeeded after shrinking its micro-batch,
``remember_observed`` with the peak it sampled (NVML) beside the peak the plan predicted. Read by
`plan`: it starts from the remembered micro-batch (and says so) instead of OOMing again, and
scales its predictions by ``correction_from`` the observation.

``$FTLAUNCH_HOME/learned.json`` is state like the others: versioned (``Learned``: a file of another
version is refused, StateVersionError, and never overwritten; keys this version does not know are
written back as they were), replaced atomically, and each read-modify-write holds an flock
(``locks.held``), so that runs finishing together lose no entry. A file without a version is the
layout ftlaunch wrote before: read, and versioned at the next write.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlaunch.errors import StateError, StateVersionError
from ftlaunch.files import JSON_LIMIT, home, now_iso, read_user_bytes, write_json_atomic
from ftlaunch.locks import held

LEARNED_VERSION = 1

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


@dataclass(frozen=True)
class Learned:
    """learned.json as a value: what worked, per config key, and the top-level keys of another
    minor version (``extra``), kept as they were."""

    entries: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, where: str = "learned.json") -> Learned:
        """Refuses (StateVersionError) a version it does not know; a file without one is the layout
        of before (entries at the top level)."""
        if not isinstance(data, dict):
            raise StateError(f"{where} does not hold an object", hint=_HINT)
        if "version" not in data:
            entries = {k: v for k, v in data.items() if isinstance(v, dict)}
            return cls(entries, {k: v for k, v in data.items() if k not in entries})
        if data["version"] != LEARNED_VERSION:
            raise StateVersionError(
                f"{where} has version {data['version']!r}, this ftlaunch reads version {LEARNED_VERSION}",
                hint=f"use the ftlaunch version that wrote it; or {_HINT}",
            )
        entries = data.get("entries", {})
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            raise StateError(f"{where}: 'entries' is not an object of objects", hint=_HINT)
        return cls(entries, {k: v for k, v in data.items() if k not in ("version", "entries")})

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "version": LEARNED_VERSION, "entries": dict(self.entries)}

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self.entries.get(key)
        return None if entry is None else dict(entry)

    def with_entry(self, key: str, entry: Mapping[str, Any]) -> Learned:
        return Learned({**self.entries, key: dict(entry)}, self.extra)


_HINT = "move it aside: it only holds what worked before, and plans start afresh without it"


def remembered(old: Mapping[str, Any] | None, values: Mapping[str, Any], reason: str, at: str) -> dict[str, Any]:
    """Pure: an entry once a run settled on these values (its observation and unknown keys kept)."""
    return {
        **(old or {}),
        "micro_batch": values.get("per_device_train_batch_size"),
        "gradient_accumulation_steps": values.get("gradient_accumulation_steps"),
        "disable_gradient_checkpointing": values.get("disable_gradient_checkpointing"),
        "learned_from": reason,
        "at": at,
    }


def with_observation(
    old: Mapping[str, Any] | None, observed_peak_gib: float, predicted_peak_gib: float, micro_batch: int, at: str
) -> dict[str, Any] | None:
    """Pure: the entry with this observation, or None when it already holds a larger one for this
    micro-batch (a short run may not have met its longest batch)."""
    prev = (old or {}).get("observed") or {}
    if prev.get("micro_batch") == micro_batch and float(prev.get("observed_peak_gib", 0)) >= observed_peak_gib:
        return None
    return {
        **(old or {}),
        "observed": {
            "observed_peak_gib": round(observed_peak_gib, 3),
            "predicted_peak_gib": round(predicted_peak_gib, 3),
            "micro_batch": micro_batch,
            "at": at,
        },
    }


# ---------------------------------------------------------------- the file


def _path(env: Mapping[str, str]) -> Path:
    return home(env) / "learned.json"


def _lock(env: Mapping[str, str]) -> Path:
    return home(env) / "locks" / "learned.json.lock"


def load(env: Mapping[str, str]) -> Learned:
    """learned.json as it is (empty when there is none). Raises StateError when it is unreadable,
    StateVersionError when it is of another version."""
    path = _path(env)
    try:
        raw = read_user_bytes(path, limit=JSON_LIMIT, what=str(path), error=StateError, hint=_HINT)
    except (FileNotFoundError, NotADirectoryError):
        return Learned()  # nothing learned yet (an unusable FTLAUNCH_HOME is for its own check to say)
    except OSError as exc:
        raise StateError(f"{path} is unreadable ({exc.strerror or exc})", hint=_HINT) from None
    try:
        data = json.loads(raw)
    except ValueError as exc:  # a bad byte is a UnicodeDecodeError, a ValueError too
        raise StateError(f"{path} is not JSON ({exc})", hint=_HINT) from None
    return Learned.from_json(data, where=str(path))


def _update(env: Mapping[str, str], key: str, change: Callable[[dict[str, Any] | None], dict[str, Any] | None]) -> None:
    """One read-modify-write of one entry under the flock; ``change`` returns None for no write."""
    lock = _lock(env)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with held(lock):
        learned = load(env)  # refused before anything is written
        entry = change(learned.get(key))
        if entry is not None:
            write_json_atomic(_path(env), learned.with_entry(key, entry).to_json())


def remember(env: Mapping[str, str], key: str, values: Mapping[str, Any], reason: str) -> None:
    _update(env, key, lambda old: remembered(old, values, reason, now_iso()))


def remember_observed(
    env: Mapping[str, str], key: str, *, observed_peak_gib: float, predicted_peak_gib: float, micro_batch: int
) -> None:
    """Record the GPU memory a run was seen to use (the largest NVML sample of its processes) beside
    what its plan predicted, for later plans of the same config on the same card. Keeps the
    largest observation for a micro-batch: a short run may not have met its longest batch."""
    _update(env, key, lambda old: with_observation(old, observed_peak_gib, predicted_peak_gib, micro_batch, now_iso()))


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
    """What worked for this key. No lock: the file is replaced atomically, so a reader sees it whole.
    Raises StateError (exit 12) for a file it cannot read or of another version."""
    return load(env).get(key)
