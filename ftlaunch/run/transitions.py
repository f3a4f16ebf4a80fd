"""The journal's named transitions: every change of a run's state.json and every line of its
events.jsonl written outside the supervisor's loop (`stop`, `resume`, the engines, the Slurm batch step,
the Ray follower, the environment check, numeric health, the notifier). The supervisor's own records
are ``ftlaunch.run.journal.RunJournal``'s; together the two are the only writers of a run's state and
events (tests/run/test_one_writer.py reads every other module of ftlaunch and fails one that calls
the store's writers).

A transition is named for what happened (``stopped``, ``resumed``, ``requeued``, ``resubmitted``,
``rebuilt``, ``job_submitted``...) and writes the state fields and the event that say it, in the
order a reader relies on (an event a concurrent reader acts on comes after the state it reads).
``note`` is an event that changes no state; its name is an ``Event``, never a free string. These
raise what the store raises (OSError, StateError): the callers are commands, whose user sees it; the
supervisor's journal is the one that must never fail.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftlaunch.files import now_iso
from ftlaunch.run.events import Event
from ftlaunch.run.state import FailureKind, RunState, RunStatus
from ftlaunch.run.store import append_event, set_aside_state, update_state, write_state


def note(run_dir: Path, event: Event, /, **fields: Any) -> dict[str, Any]:
    """An event that changes no state (``Event(event)`` refuses a name the enum does not know)."""
    return append_event(run_dir, Event(event).value, **fields)


# ---------------------------------------------------------------- a run's life, by command


def rebuilt(run_dir: Path, state: RunState) -> RunState:
    """state.json was lost or corrupt: the damaged one is set aside and ``state`` (rebuilt from
    config.yaml) takes its place."""
    set_aside_state(run_dir)
    state = state.changed(rebuilt=now_iso())
    write_state(run_dir, state)
    note(run_dir, Event.STATE_REBUILT)
    return state


def stopped(run_dir: Path, message: str, /, **event: Any) -> RunState:
    """The run is stopped (by the user) and nothing else will record it; ``event``: the fields of a
    ``stopped`` event, written when given."""
    state = update_state(run_dir, status=RunStatus.STOPPED, ended=time.time(), message=message)
    if event:
        note(run_dir, Event.STOPPED, **event)
    return state


def resumed(run_dir: Path, before: RunState, *, allow_env_change: bool, from_checkpoint: str | None) -> RunState:
    """`resume` restarts the run on this machine: a fresh budget (the user changed something, or wants
    another go), no supervisor or trainer yet, and the last end's message forgotten (a restarted run
    said "stopped by the user" in `status` while it trained)."""
    state = update_state(
        run_dir,
        status=RunStatus.STARTING,
        budget=before.budget.refilled(),
        pid=None,
        trainer_pid=None,
        message=None,
        allow_env_change=allow_env_change or None,
    )
    note(run_dir, Event.RESUMED, previous=before.status.value, from_checkpoint=from_checkpoint)
    return state


def resubmitting(run_dir: Path, before: RunState) -> RunState:
    """`resume` hands the run to its engine again (Ray: the next submission follows): queued, a fresh
    budget, the last end forgotten. The ``resumed`` event follows once the submission has its id."""
    return update_state(
        run_dir,
        status=RunStatus.QUEUED,
        budget=before.budget.refilled(),
        no_progress_attempts=0,
        failure_kind=None,
        exit_code=None,
        ended=None,
        message=None,
    )


def replanned(run_dir: Path, figures: Mapping[str, Any], /, **event: Any) -> RunState:
    """`resume --gpu/--hardware`: the re-planned launch figures, then the ``replanned`` event."""
    state = update_state(run_dir, **figures)
    note(run_dir, Event.REPLANNED, **event)
    return state


def config_edited(run_dir: Path, figures: Mapping[str, Any], /, **event: Any) -> None:
    """`resume KEY=VALUE`: the ``config_edited`` event, then the batch figures the edit changed."""
    note(run_dir, Event.CONFIG_EDITED, **event)
    if figures:
        update_state(run_dir, **figures)


# ---------------------------------------------------------------- the engine's job


def queued(run_dir: Path, message: str) -> RunState:
    """Handed to the engine, waiting for it to run the supervisor."""
    return update_state(run_dir, status=RunStatus.QUEUED, message=message)


def submitting(run_dir: Path, asked: Mapping[str, Any], warnings: tuple[str, ...]) -> RunState:
    """A Slurm run about to be submitted: queued, with what it asks of Slurm (``state.job.asked``)."""
    return update_state(run_dir, status=RunStatus.QUEUED, slurm=dict(asked), warnings=warnings or None)


def job_submitted(run_dir: Path, job_id: str, /, **event: Any) -> RunState:
    """The engine took the job: its id (``state.job.id``), then the ``submitted`` event."""
    state = update_state(run_dir, slurm_job_id=job_id)
    note(run_dir, Event.SUBMITTED, job_id=job_id, **event)
    return state


def resubmitted(
    run_dir: Path,
    before: RunState,
    job_id: str,
    /,
    *,
    previous_job: str,
    allow_env_change: bool,
    message: str,
    **event: Any,
) -> RunState:
    """`resume` of a Slurm run whose job is over: submitted again as ``job_id``, a fresh budget, the
    last end forgotten; the job's supervisor compares the environment on its node."""
    state = update_state(
        run_dir,
        status=RunStatus.QUEUED,
        slurm_job_id=job_id,
        budget=before.budget.refilled(),
        pid=None,
        trainer_pid=None,
        failure_kind=None,
        exit_code=None,
        ended=None,
        allow_env_change=allow_env_change or None,
        message=message,
    )
    note(run_dir, Event.RESUBMITTED, job_id=job_id, previous_job=previous_job, previous=before.status.value, **event)
    return state


def job_started(run_dir: Path, job_env: Mapping[str, str]) -> RunState:
    """The batch step runs: the ``slurm_job_started`` event, then what Slurm told it (``state.job.env``)."""
    note(run_dir, Event.SLURM_JOB_STARTED, **{k.lower(): v for k, v in job_env.items()})
    return update_state(run_dir, slurm_job=dict(job_env))


def requeued(run_dir: Path, job_id: str) -> RunState:
    """The batch step requeued its own job before the time limit: it resumes when it runs again."""
    note(run_dir, Event.REQUEUED, job_id=job_id)
    return update_state(
        run_dir, status=RunStatus.QUEUED, message="requeued before the time limit; resumes when it runs"
    )


def job_ended(
    run_dir: Path,
    event: Event,
    fields: Mapping[str, Any],
    *,
    status: RunStatus,
    message: str | None,
    failure_kind: FailureKind | None = None,
    no_progress: int | None = None,
) -> RunState:
    """The engine's word on an attempt that ended outside the supervisor's loop (a batch step that
    failed before its trainer, Slurm's requeue or preemption, a Ray job's end): ``status`` (``ended``
    stamped when it is terminal), then ``event`` with ``fields``."""
    changes: dict[str, Any] = {"status": status, "message": message}
    changes["ended"] = time.time() if status.is_terminal() else None
    if failure_kind is not None:
        changes["failure_kind"] = failure_kind
    if no_progress is not None:
        changes["no_progress_attempts"] = no_progress
    state = update_state(run_dir, **changes)
    note(run_dir, event, **fields)
    return state


# ---------------------------------------------------------------- what a check found


def environment_kept(run_dir: Path, record: Mapping[str, Any]) -> RunState:
    """The trainer's environment as last recorded (``state.environment``)."""
    return update_state(run_dir, environment=dict(record))


def health_judged(run_dir: Path, verdict: Mapping[str, Any]) -> RunState:
    """Numeric health of the current attempt changed (``state.health``)."""
    return update_state(run_dir, health=dict(verdict))


def divergence_handled(run_dir: Path, verdict: Mapping[str, Any], last_checkpoint: int | None) -> RunState:
    """A diverged attempt was dealt with: its verdict is the last divergence, and the last checkpoint
    is the one the next attempt resumes from (None: the diverged ones were set aside)."""
    return update_state(run_dir, health=dict(verdict), diverged=dict(verdict), last_checkpoint=last_checkpoint)
