"""A run's state as values: the typed, versioned ``RunState`` that state.json holds, its status and
failure kinds, the retry budget, its typed sub-records (ftlaunch.run.staterecords: progress, stall,
health, environment, disk, the engine's job). Pure: no files here (``ftlaunch.run.store`` reads and
writes; only the journal, ``ftlaunch.run.journal`` and ``ftlaunch.run.transitions``, changes a state).

state.json stays the JSON it always was: ``RunState.from_json`` reads it, ``to_json`` writes it back.
Keys this ftlaunch does not know (written by another minor version) are kept in ``extra`` and written
back unchanged; a state of another ``version`` is refused (StateVersionError), never rewritten.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from ftlaunch.errors import ExitCode, StateError, StateVersionError
from ftlaunch.run.health import OnDiverge
from ftlaunch.run.policy import Budget  # the retry budget: its own module, with the policy it spends
from ftlaunch.run.staterecords import (
    RECORDS,
    DiskRecord,
    EngineJob,
    EnvironmentRecord,
    HealthRecord,
    ProgressRecord,
    Record,
    SlurmAsk,
    StallRecord,
)

STATE_VERSION = 1


class RunStatus(StrEnum):
    QUEUED = "queued"  # a Slurm job waiting for its allocation (first start or requeued)
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"  # the supervisor died without recording an end (reboot, SIGKILL)
    DIVERGED = "diverged"  # numeric health: non-finite or spiking loss, rollbacks spent (ftlaunch.run.health)
    STALLED = "stalled"  # no progress for longer than the stall timeout, stall restarts spent
    NO_PROGRESS = "no_progress"  # the restart brake: attempts without a new checkpoint
    DISK_FULL = "disk_full"  # ENOSPC while saving: every complete checkpoint kept, the partial one removed
    ENV_CHANGED = "env_changed"  # a deciding package changed between attempts; not resumed without consent
    UNREADABLE = "unreadable"  # shown by `runs` for a state.json it cannot read; never written

    def is_terminal(self) -> bool:
        return self is RunStatus.SUCCEEDED or self is RunStatus.STOPPED or self.is_failed()

    def is_failed(self) -> bool:
        return self in {
            RunStatus.FAILED,
            RunStatus.LOST,
            RunStatus.DIVERGED,
            RunStatus.STALLED,
            RunStatus.NO_PROGRESS,
            RunStatus.DISK_FULL,
            RunStatus.ENV_CHANGED,
        }

    def exit_code(self, trainer_rc: int | None = None) -> int:
        """What `status` (and a command that follows a run to its end) exits with for this status: the
        one table, _STATUS_CODES. ``trainer_rc``: the supervisor's own exit, which ends a stop with
        STOPPED_EXIT and a plain failure with the trainer's code when it gave one (> 0)."""
        if trainer_rc is not None and self is RunStatus.STOPPED:
            return STOPPED_EXIT
        if trainer_rc is not None and trainer_rc > 0 and self is RunStatus.FAILED:
            return trainer_rc
        if self is RunStatus.SUCCEEDED:
            return int(ExitCode.OK)
        if self in (RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING, RunStatus.RECOVERING):
            return int(ExitCode.RUNNING)
        return int(_STATUS_CODES.get(self, ExitCode.FAILED))


STOPPED_EXIT = 130  # a supervisor stopped by the user exits as a process ended by SIGINT would
# The statuses with their own exit code; other failures and stops exit ExitCode.FAILED.
_STATUS_CODES = {
    RunStatus.DIVERGED: ExitCode.DIVERGED,
    RunStatus.STALLED: ExitCode.STALLED,
    RunStatus.NO_PROGRESS: ExitCode.NO_PROGRESS,
    RunStatus.DISK_FULL: ExitCode.DISK_FULL,
    RunStatus.ENV_CHANGED: ExitCode.ENV_CHANGED,
}


class FailureKind(StrEnum):
    CONFIG = "config_error"  # deterministic: never retried
    SETUP = "setup_error"  # trainer missing, cannot start
    CUDA_OOM = "cuda_oom"
    EVAL_OOM = "eval_oom"
    HOST_OOM = "host_oom"
    CRASH = "crash"
    DIVERGED = "diverged"  # numeric health, see ftlaunch.run.health
    STOPPED = "stopped_by_user"
    BUSY = "busy"  # the output_dir is held by another run: this one never started
    STALLED = "stalled"  # no progress within the stall timeout: stacks dumped, group stopped
    NO_PROGRESS = "no_progress"  # the restart brake ended the run
    DISK_FULL = "disk_full"  # ENOSPC (or the free space check before a save)
    RENDEZVOUS = "rendezvous"  # the nodes of a multi-node job could not reach each other in time
    ENV_CHANGED = "env_changed"  # a deciding package changed since the checkpoint (ftlaunch.run.environment)


@dataclass(frozen=True)
class StartFacts:
    """State fields a new run starts with besides its plan and its supervisor settings: what `train`
    found in the output_dir (ftlaunch.run.outdir), the disk forecast and its warnings
    (ftlaunch.run.disk), the schedule that started it. None: not known, not written."""

    output_dir_moved_to: str | None = None
    adopted_checkpoint: str | None = None
    adopted_because: str | None = None
    disk: Mapping[str, Any] | None = None
    warnings: tuple[str, ...] | None = None
    schedule: str | None = None
    engine: str | None = None  # where its supervisor lives (ftlaunch.run.engines): local, slurm, ...

    def joined(self, other: StartFacts) -> StartFacts:
        """These facts, with the ones ``other`` knows put over them."""
        return replace(self, **other.known())

    def known(self) -> dict[str, Any]:
        """The facts that are known, by state field name (an event records them as such)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _tuple_or_none(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(str(v) for v in value)


def _finite_or_none(value: Any) -> Any:
    """A number the state holds as a time, a rate or a size: NaN, an infinity or a non-number (an old
    run's ``--stall-timeout nan``, a hand edit) reads as absent, never as a number to compute with."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


# Numbers by contract: seconds, epoch times, rates, GiB (the progress's loss may be NaN: that is news).
_FINITE_FIELDS = (
    "pid_start",
    "trainer_start",
    "progress_at",
    "steps_per_second",
    "stall_timeout",
    "predicted_peak_gib",
    "observed_peak_gib",
    "ended",
)


# The state fields that hold one of a fixed set of words.
_KINDS: dict[str, type[StrEnum]] = {
    "status": RunStatus,
    "failure_kind": FailureKind,
    "last_failure": FailureKind,
    "on_diverge": OnDiverge,
}


@dataclass(frozen=True)
class RunState:
    """What state.json holds. A field that is None is not written (readers see it as absent)."""

    id: str
    version: int = STATE_VERSION
    name: str | None = None
    status: RunStatus = RunStatus.LOST  # a state that never said: no supervisor ever recorded one
    created: str | None = None
    updated: str | None = None
    rebuilt: str | None = None  # state.json was lost or corrupt and rebuilt from config.yaml
    # what the run is
    source_config: str | None = None
    overrides: tuple[str, ...] | None = None
    base_dir: str | None = None
    output_dir: str | None = None
    run_dir: str | None = None
    gpu_model: str | None = None
    gpu_count: int | None = None
    world_size: int | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    accumulation: int | None = None
    memory_key: str | None = None
    schedule: str | None = None  # the schedule that started it
    engine: str | None = None  # where its supervisor lives (ftlaunch.run.engines); None: a run of before engines
    # how it is supervised
    recover: bool = True
    on_diverge: OnDiverge | None = None  # numeric health policy (ftlaunch.run.health)
    budget: Budget = field(default_factory=Budget)
    trainer_env: Mapping[str, str] | None = None
    # what `train` found in the output_dir
    output_dir_moved_to: str | None = None
    adopted_checkpoint: str | None = None
    adopted_because: str | None = None
    # the current attempt
    attempt: int = 0
    pid: int | None = None
    pid_start: float | None = None
    trainer_pid: int | None = None
    trainer_start: float | None = None
    resume_from: str | None = None
    progress: ProgressRecord | None = None
    progress_at: float | None = None
    steps_per_second: float | None = None
    last_checkpoint: int | None = None
    health: HealthRecord | None = None  # of this attempt
    diverged: HealthRecord | None = None  # the last divergence seen
    predicted_peak_gib: float | None = None
    observed_peak_gib: float | None = None
    recovered_batch: bool | None = None  # the OOM ladder changed the micro-batch
    last_failure: FailureKind | None = None
    # the unattended guard (issue 20)
    stall_timeout: float | None = None  # --stall-timeout; None: derived from the run itself
    stall: StallRecord | None = None  # the watchdog of this attempt: phase, last progress, timeout
    no_progress_attempts: int = 0  # attempts ended since the last checkpoint advanced (survives requeues)
    best_checkpoint: int | None = None  # the furthest complete checkpoint any attempt saved
    disk: DiskRecord | None = None  # the disk forecast made at start
    environment: EnvironmentRecord | None = None  # the trainer's environment's last record
    allow_env_change: bool | None = None  # resume --allow-env-change: this start may cross such a change
    # how it ended
    ended: float | None = None
    exit_code: int | None = None
    failure_kind: FailureKind | None = None
    message: str | None = None
    # the engine's job, as state.json has always kept it (read typed through ``job``)
    slurm: SlurmAsk | None = None  # what was asked: nodes, GPUs per node, partition, time
    slurm_job_id: str | None = None
    slurm_job: Mapping[str, str] | None = None  # the SLURM_* variables of the batch step
    warnings: tuple[str, ...] | None = None
    # keys of another minor version, written back as they were
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Changes arrive as JSON-ish values too (``update_state(status="running")``): coerce once here.
        for name, kind in _KINDS.items():  # status is required; the other kinds may be absent
            value = getattr(self, name)
            if value is not None or name == "status":
                object.__setattr__(self, name, kind(value))
        coerce = {
            "budget": lambda v: v if isinstance(v, Budget) else Budget.from_json(v or {}),
            "overrides": _tuple_or_none,
            "warnings": _tuple_or_none,
            "slurm_job_id": lambda v: None if v is None else str(v),
            **{name: kind.of for name, kind in RECORDS.items()},
            **{name: _finite_or_none for name in _FINITE_FIELDS},
        }
        for name, fn in coerce.items():
            object.__setattr__(self, name, fn(getattr(self, name)))

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "state.json") -> RunState:
        """Read a state.json object. Refuses (StateVersionError) a version it does not know, and
        (StateError) values it cannot read, such as a status of no known kind."""
        if data.get("version") != STATE_VERSION:
            raise StateVersionError(
                f"{where} has version {data.get('version')!r}, this ftlaunch reads version {STATE_VERSION}; "
                "not touching it",
                hint="use the ftlaunch version that made the run",
            )
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        values.setdefault("id", "")
        for key, kind in _KINDS.items():
            if values.get(key) is not None and values[key] not in {m.value for m in kind}:
                # Most likely written by a newer ftlaunch: refused like another version, never rebuilt.
                raise StateVersionError(
                    f"{where} has {key} {values[key]!r}, which this ftlaunch does not know; not touching it",
                    hint="use the ftlaunch version that made the run",
                )
        try:
            return cls(**values, extra=extra)
        except (TypeError, ValueError) as exc:
            raise StateError(f"{where} holds a value this ftlaunch cannot read ({exc})") from None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or value is None:
                continue
            if isinstance(value, (Budget, Record)):
                value = value.to_json()
            elif isinstance(value, StrEnum):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return {**self.extra, **out}

    def engine_name(self) -> str:
        """The run's engine: the recorded one; a run written before engines were recorded is Slurm's
        when its state has Slurm keys, else local."""
        if self.engine:
            return self.engine
        return "slurm" if self.slurm_job_id or self.slurm or self.slurm_job else "local"

    @property
    def job(self) -> EngineJob:
        """The engine's job, typed, from the keys state.json keeps it under."""
        return EngineJob(self.engine_name(), self.slurm_job_id, self.slurm, self.slurm_job)

    def changed(self, **changes: Any) -> RunState:
        """This state with ``changes`` (field names; an unknown name is a TypeError)."""
        return replace(self, **changes)
