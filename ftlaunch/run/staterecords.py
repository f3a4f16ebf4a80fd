"""The typed sub-records of a run's state (``RunState.progress``, ``.stall``, ``.health``,
``.diverged``, ``.environment``, ``.disk``, ``.slurm``) and the engine's job (``RunState.job``). Pure.

A sub-record is the JSON object state.json has always held under its key, typed: its properties read
the keys ftlaunch uses, as the types they hold. It keeps the object it was read from whole (every key,
a null included), so ``to_json`` writes back exactly what was read (tests/run/test_staterecords.py
pins it against a state written by main before this module) and a record of a newer version loses
nothing. It also reads as that object (``record["step"]``, ``record.get``, ``==`` a dict), as the plain
mapping it replaces did.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self


@dataclass(frozen=True, eq=False)
class Record(Mapping[str, Any]):
    """One sub-record: its JSON object (``data``), typed by the properties of its class."""

    data: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, value: Any) -> Self | None:
        """A record from what a state field is given: None, a record, or its JSON object."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls(dict(value.items()))
        raise TypeError(f"{cls.__name__} must be a JSON object, not {type(value).__name__}")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return cls(dict(data))

    def to_json(self) -> dict[str, Any]:
        return dict(self.data)

    def with_(self, **changes: Any) -> Self:
        """This record with ``changes`` put over its keys (a None value is written as null)."""
        return type(self)({**self.data, **changes})

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.data)!r})"

    def _int(self, key: str) -> int | None:
        value = self.data.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _num(self, key: str) -> float | None:
        """A number as written (an int stays one: `status --json` shows what was recorded)."""
        value = self.data.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def _str(self, key: str) -> str | None:
        value = self.data.get(key)
        return value if isinstance(value, str) else None

    def _object(self, key: str) -> Mapping[str, Any] | None:
        value = self.data.get(key)
        return value if isinstance(value, Mapping) else None


class ProgressRecord(Record):
    """``state.progress``: the trainer's last step as the supervisor saw it (ftlaunch.run.progress
    ``Progress.to_dict()``), and the recent tokens/s the progress watch measured over the last step
    records (``tokens_per_second``; absent in a state of before)."""

    @property
    def step(self) -> int | None:
        return self._int("step")

    @property
    def total_steps(self) -> int | None:
        return self._int("total_steps")

    @property
    def throughput(self) -> float | None:
        """tokens/s as llamafactory logs it (when it counts tokens)."""
        return self._num("throughput")

    @property
    def tokens_per_second(self) -> float | None:
        return self._num("tokens_per_second")


class StallRecord(Record):
    """``state.stall``: the stall watchdog's view of the current attempt (ftlaunch.run.stall
    ``Watchdog.to_dict``); the next attempt starts from it. A non-finite number reads as absent (an
    old run's ``--stall-timeout nan``, a hand edit), never as a number to compute with."""

    @classmethod
    def of(cls, value: Any) -> Self | None:
        if isinstance(value, Mapping):
            value = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in value.items()}
        return super().of(value)

    @property
    def phase(self) -> str | None:
        return self._str("phase")

    @property
    def last_progress_at(self) -> float | None:
        return self._num("last_progress_at")

    @property
    def allowance_s(self) -> float | None:
        return self._num("allowance_s")

    @property
    def why(self) -> str | None:
        return self._str("why")

    @property
    def load_s(self) -> float | None:
        return self._num("load_s")


class HealthRecord(Record):
    """``state.health`` (this attempt's) and ``state.diverged`` (the last divergence): numeric health's
    ``Verdict.to_dict()`` (ftlaunch.run.health): health, first_bad, last_good_step."""

    @property
    def health(self) -> str | None:
        return self._str("health")

    @property
    def first_bad(self) -> Mapping[str, Any] | None:
        return self._object("first_bad")

    @property
    def last_good_step(self) -> int | None:
        return self._int("last_good_step")


class EnvironmentRecord(Record):
    """``state.environment``: the hash and attempt of the trainer's last environment record
    (ftlaunch.run.environment), and ``changed`` ({attempt, changes, accepted, since_run}) when a
    deciding package changed."""

    @property
    def hash(self) -> str | None:
        return self._str("hash")

    @property
    def attempt(self) -> int | None:
        return self._int("attempt")

    @property
    def changed(self) -> Mapping[str, Any] | None:
        return self._object("changed") or None


class DiskRecord(Record):
    """``state.disk``: the disk forecast made at start (ftlaunch.plan.disk ``DiskForecast.to_dict()``)
    with the verdict and the filesystem then (ftlaunch.run.disk ``Preflight.state``)."""

    @property
    def checkpoint_bytes(self) -> int | None:
        return self._int("checkpoint_bytes")

    @property
    def verdict(self) -> Mapping[str, Any]:
        return self._object("verdict") or {}

    @property
    def filesystem(self) -> str | None:
        return self._str("filesystem")


class SlurmAsk(Record):
    """``state.slurm``: what a Slurm run asked for (nodes, gpus_per_node, partition, time, master_addr)."""

    @property
    def nodes(self) -> int | None:
        return self._int("nodes")

    @property
    def gpus_per_node(self) -> int | None:
        return self._int("gpus_per_node")

    @property
    def partition(self) -> str | None:
        return self._str("partition")


@dataclass(frozen=True)
class EngineJob:
    """The engine's job of a run, typed (``RunState.job``). state.json keeps it under the keys it always
    had: a Slurm run's ``slurm`` (asked), ``slurm_job_id`` (the job), ``slurm_job`` (the batch step's
    SLURM_* variables), so a state of any earlier version reads the same. A Ray run keeps its
    submissions in its own ray.json (ftlaunch.run.ray.record): its state holds no job id."""

    engine: str
    id: str | None = None  # the job the engine runs the run's supervisor in now (Slurm's job id)
    asked: SlurmAsk | None = None  # what was asked of the engine
    env: Mapping[str, str] | None = None  # what the engine told the job (SLURM_JOB_ID, SLURM_JOB_NODELIST, ...)

    @property
    def submitted(self) -> bool:
        """Whether the run has a job to ask its engine about."""
        return bool(self.id)


# The state fields that hold a sub-record, and its type.
RECORDS: dict[str, type[Record]] = {
    "progress": ProgressRecord,
    "health": HealthRecord,
    "diverged": HealthRecord,
    "stall": StallRecord,
    "disk": DiskRecord,
    "environment": EnvironmentRecord,
    "slurm": SlurmAsk,
}
