"""A run as `status` and `runs` show it, decided from its state and what was seen around it. Pure.

``RunView`` is the value (``to_json``: `status --json` and a row of `runs --json`). ``view_of`` builds
it from a ``RunState`` and a ``Seen`` (what the shell in ftlaunch.run.view observed: liveness, Slurm,
GPU memory, the cost records, a dead supervisor's last word) at a given time: the status that holds
now (a dead supervisor's run is lost, a last word's end wins), the ETA, the message, the stall view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftlaunch.run.procs import Liveness
from ftlaunch.run.recovery import driver_error
from ftlaunch.run.state import FailureKind, ProgressRecord, RunState, RunStatus, StallRecord


@dataclass(frozen=True)
class StallView:
    """The stall watchdog as `status` shows it: seconds since the last progress and the allowance in
    force (with where it comes from) while the run is live; the restart brake's count always."""

    seconds_since_progress: float | None = None
    phase: str | None = None
    timeout_seconds: float | None = None
    timeout_why: str | None = None
    load_seconds: float | None = None
    no_progress_attempts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds_since_progress": self.seconds_since_progress,
            "stall_phase": self.phase,
            "stall_timeout_seconds": self.timeout_seconds,
            "stall_timeout_why": self.timeout_why,
            "load_seconds": self.load_seconds,
            "no_progress_attempts": self.no_progress_attempts,
        }


@dataclass(frozen=True)
class CostView:
    """tokens/s of this attempt and GPU-hours so far / projected, from the run's own records. ``gpus``
    (0: a CPU run, None: not recorded) decides whether `status` speaks of GPU-hours or of time."""

    tokens_per_second: float | None = None
    wall_seconds: float = 0.0
    gpu_hours: float = 0.0
    gpu_hours_projected: float | None = None
    gpus: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)  # the fields are the JSON keys, in order; gpus is for the table only
        del d["gpus"]
        return d


@dataclass(frozen=True)
class RunView:
    """One run as `status` and `runs` show it. ``status`` is the one that holds now (a dead
    supervisor's run is lost; Slurm decides for a Slurm run), not necessarily the recorded one.
    A run whose state cannot be read has status unreadable and only its id, run_dir and why."""

    id: str
    status: RunStatus
    run_dir: str
    name: str | None = None
    attempt: int | None = None
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    throughput: float | None = None
    steps_per_second: float | None = None
    eta_seconds: float | None = None
    micro_batch: int | None = None
    accumulation: int | None = None
    pid: int | None = None
    supervisor_alive: Liveness = Liveness.UNKNOWN
    trainer_pid: int | None = None
    trainer_alive: Liveness = Liveness.UNKNOWN
    output_dir: str | None = None
    created: str | None = None
    exit_code: int | None = None
    failure_kind: FailureKind | None = None
    message: str | None = None
    last_message: str | None = None  # the recorded message, where ``message`` says otherwise (lost)
    last_checkpoint: int | None = None
    # numeric health of the current attempt (finite/spiky/diverged) and the last divergence seen
    health: str | None = None
    diverged: Mapping[str, Any] | None = None
    gpu_memory_gib: float | None = None
    predicted_peak_gib: float | None = None
    observed_peak_gib: float | None = None
    slurm_job_id: str | None = None
    slurm_state: str | None = None
    environment_changed: str | None = None
    stall: StallView = field(default_factory=StallView)
    cost: CostView = field(default_factory=CostView)
    # what a supervisor that could not write its end, or failed, left (ftlaunch.run.journal.LastWord)
    last_word: Mapping[str, Any] | None = None

    @classmethod
    def unreadable(cls, run_dir: Path, message: str) -> RunView:
        return cls(id=run_dir.name, status=RunStatus.UNREADABLE, run_dir=str(run_dir), message=message)

    def to_json(self) -> dict[str, Any]:
        """`status --json`, and one row of `runs --json`."""
        if self.status is RunStatus.UNREADABLE:
            return {"id": self.id, "status": self.status.value, "message": self.message, "run_dir": self.run_dir}
        return {
            "id": self.id,
            "name": self.name,
            "status": self.status.value,
            "attempt": self.attempt,
            "step": self.step,
            "total_steps": self.total_steps,
            "loss": self.loss,
            "lr": self.lr,
            "throughput": self.throughput,
            "steps_per_second": self.steps_per_second,
            "eta_seconds": self.eta_seconds,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "pid": self.pid,
            "supervisor_alive": self.supervisor_alive.value,
            "trainer_pid": self.trainer_pid,
            "trainer_alive": self.trainer_alive.value,
            "output_dir": self.output_dir,
            "run_dir": self.run_dir,
            "created": self.created,
            "exit_code": self.exit_code,
            "failure_kind": self.failure_kind.value if self.failure_kind else None,
            "message": self.message,
            "last_message": self.last_message,
            "last_checkpoint": self.last_checkpoint,
            "health": self.health,
            "diverged": self.diverged,
            "gpu_memory_gib": self.gpu_memory_gib,
            "predicted_peak_gib": self.predicted_peak_gib,
            "observed_peak_gib": self.observed_peak_gib,
            "slurm_job_id": self.slurm_job_id,
            "slurm_state": self.slurm_state,
            "environment_changed": self.environment_changed,
            "supervisor_last_word": self.last_word,
            **self.stall.to_json(),
            **self.cost.to_json(),
        }


@dataclass(frozen=True)
class Seen:
    """What the shell saw around a run's state: the status after liveness or Slurm decided (and
    Slurm's own word for the job), both liveness verdicts, the trainer's GPU memory, the cost from
    the run's records, and the last word a dead supervisor left (None when not read)."""

    status: RunStatus
    slurm_state: str | None = None
    supervisor_alive: Liveness = Liveness.UNKNOWN
    trainer_alive: Liveness = Liveness.UNKNOWN
    gpu_memory_gib: float | None = None
    cost: CostView = field(default_factory=CostView)
    last_word: Mapping[str, Any] | None = None


def local_status(state: RunState, supervisor: Liveness) -> RunStatus:
    """A local run's status now: the recorded one, but lost when its supervisor is dead before a
    terminal status (UNKNOWN is not dead: it fails closed). A Slurm run's is Slurm's to say."""
    if not state.status.is_terminal() and supervisor is Liveness.DEAD:
        return RunStatus.LOST
    return state.status


def wants_last_word(state: RunState, status: RunStatus) -> bool:
    """Whether to read the last word of a supervisor that died: a local run found lost now."""
    return status is RunStatus.LOST and state.status is not RunStatus.LOST and not state.job.submitted


def is_live(status: RunStatus) -> bool:
    return status in (RunStatus.RUNNING, RunStatus.RECOVERING, RunStatus.STARTING)


def view_of(state: RunState, run_dir: Path, seen: Seen, now: float | None, clock: float) -> RunView:
    """The run as `status` shows it. ``now``: the time asked for (None: ``clock``, the time now)."""
    status = seen.status
    p = state.progress or ProgressRecord()
    step, total = p.step, p.total_steps
    rate = state.steps_per_second
    eta = None
    if status in (RunStatus.RUNNING, RunStatus.RECOVERING) and rate and step is not None and total:
        since = (now or clock) - float(state.progress_at or clock)
        eta = max(0.0, (total - step) / rate - since)
    message = state.message
    exit_code, failure_kind, last_word = state.exit_code, state.failure_kind, seen.last_word
    if last_word is not None and last_word.get("status") in {s.value for s in RunStatus if s.is_terminal()}:
        status = RunStatus(last_word["status"])  # the end state.json could not take
        message, exit_code = str(last_word.get("message") or ""), last_word.get("exit_code")
        failure_kind = _failure_kind(last_word.get("failure_kind"))
    elif status is RunStatus.LOST and state.status is not RunStatus.LOST:
        # The recorded message is the dead supervisor's last word ("retrying..."): it no longer holds.
        message = lost_message(state, run_dir.name, seen.trainer_alive, died=last_word)
    return RunView(
        id=state.id or run_dir.name,
        name=state.name,
        status=status,
        attempt=state.attempt,
        step=step,
        total_steps=total,
        loss=p.get("loss"),  # as recorded: NaN is news
        lr=p.get("lr"),
        throughput=p.throughput,
        steps_per_second=rate,
        eta_seconds=None if eta is None else round(eta, 1),
        micro_batch=state.micro_batch,
        accumulation=state.accumulation,
        pid=state.pid,
        supervisor_alive=seen.supervisor_alive,
        trainer_pid=state.trainer_pid,
        trainer_alive=seen.trainer_alive,
        output_dir=state.output_dir,
        run_dir=str(run_dir),
        created=state.created,
        exit_code=exit_code,
        failure_kind=failure_kind,
        message=message,
        last_message=state.message if message != state.message else None,
        last_checkpoint=state.last_checkpoint,
        health=state.health.health if state.health else None,
        diverged=state.diverged.to_json() if state.diverged else None,
        gpu_memory_gib=seen.gpu_memory_gib,
        predicted_peak_gib=state.predicted_peak_gib,
        observed_peak_gib=state.observed_peak_gib,
        slurm_job_id=state.job.id,
        slurm_state=seen.slurm_state,
        environment_changed=env_changed_line(state),
        stall=stall_view(state, now if now is not None else clock, is_live(status)),
        cost=seen.cost,
        last_word=_word_view(last_word),
    )


def _failure_kind(value: Any) -> FailureKind | None:
    try:
        return FailureKind(value) if value else None
    except ValueError:
        return None


def _word_view(word: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A supervisor's last word as `status --json` shows it (``supervisor_last_word``)."""
    if word is None:
        return None
    keys = ("cause", "status", "exit_code", "trainer_pid", "trainer_exit_code", "t", "where")
    return {k: word[k] for k in keys if word.get(k) is not None}


def lost_message(state: RunState, run_id: str, trainer_live: Liveness, died: Mapping[str, Any] | None = None) -> str:
    """What a lost run's status says: what happened (its supervisor, or its Slurm job, is gone without
    writing a final status; ``died``: the cause it left, ftlaunch.run.journal.LastWord) and what to do
    (resume, from where). Pure."""
    if state.job.submitted:
        what = f"lost: Slurm job {state.job.id} no longer runs and its supervisor wrote no final status"
        if died is not None and died.get("cause"):
            what += f"; its batch step died: {died['cause']}"
    elif died is not None and died.get("cause"):
        what = f"lost: its supervisor (pid {state.pid}) failed: {died['cause']} (in {died.get('where')})"
        if died.get("trainer_exit_code") is not None:
            what += f"; its trainer ran on to its end, exit code {died['trainer_exit_code']}"
    else:
        what = f"lost: its supervisor (pid {state.pid}) is gone without writing a final status"
        what += " (a reboot, a kill or the OOM killer)"
    if trainer_live is Liveness.ALIVE and state.trainer_pid and not state.job.submitted:
        what += f"; its trainer (pid {state.trainer_pid}) still runs unsupervised, and resume stops it first"
    where = (
        f"its last complete checkpoint (checkpoint-{state.last_checkpoint} when last seen)"
        if state.last_checkpoint
        else "the start (it recorded no complete checkpoint)"
    )
    return f"{what}; `ftlaunch resume {run_id}` continues it from {where}"


def batch_step_death(output_tail: str) -> dict[str, str] | None:
    """What a Slurm run found lost says of its batch step's death, from the end of its output (the job's
    train.log): only a package it could not import, in its last lines (issue 40: the step, or the
    `resume` of a requeued start, died at import and Slurm showed only a failed job). A traceback
    further up may be an attempt's the supervisor retried, or a trainer's warning: it says nothing of
    how the job ended."""
    ex = driver_error("\n".join([ln for ln in output_tail.splitlines() if ln.strip()][-3:]))
    if ex is None or ex.kind is not FailureKind.SETUP:
        return None
    return {"cause": ex.message, "where": "the batch step's output (train.log)"}


def env_changed_line(state: RunState) -> str | None:
    """`environment changed at attempt 3 (transformers 4.49.0 -> 4.55.0)`, from the record the
    supervisor keeps in the state (ftlaunch.run.environment); None when no deciding package changed."""
    changed = state.environment.changed if state.environment else None
    if not changed:
        return None
    since = f" since run {changed['since_run']}" if changed.get("since_run") else ""
    how = "" if changed.get("accepted") else "; not resumed (resume --allow-env-change)"
    return f"environment changed at attempt {changed.get('attempt')}{since} ({changed.get('changes')}){how}"


def stall_view(state: RunState, now: float, live: bool) -> StallView:
    """The stall watchdog's record in the state as `status` shows it (``live``: the run is live)."""
    stall = state.stall or StallRecord()
    at = stall.last_progress_at
    idle = round(max(0.0, now - float(at)), 1) if live and at is not None else None
    return StallView(
        seconds_since_progress=idle,
        phase=stall.phase if live else None,
        timeout_seconds=stall.allowance_s if live else None,
        timeout_why=stall.why if live else None,
        load_seconds=stall.load_s,
        no_progress_attempts=state.no_progress_attempts,
    )
