"""A run as `status` and `runs` show it: liveness decides running vs lost (failing closed), Slurm
decides for a Slurm run, plus progress, ETA, GPU memory in use and cost from the run's own records.
``RunView`` is that value; ``to_json`` is `status --json` and a row of `runs --json`. ``find_run``
turns a RUN argument (an id, a unique id prefix, a name; the latest run by default) into its folder,
here and not in the store because a name several runs share is refused with a list of them and the
status each has now (a view of each).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftlaunch.errors import FtlaunchError, RunNotFoundError, StateError
from ftlaunch.probe.usage import gpu_memory_of
from ftlaunch.run import progress as prog
from ftlaunch.run.journal import read_last_word
from ftlaunch.run.procs import Liveness, liveness
from ftlaunch.run.state import FailureKind, RunState, RunStatus
from ftlaunch.run.store import RunFolder, list_runs, read_events, read_state, run_name, runs_root


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
    """tokens/s of this attempt and GPU-hours so far / projected, from the run's own records."""

    tokens_per_second: float | None = None
    wall_seconds: float = 0.0
    gpu_hours: float = 0.0
    gpu_hours_projected: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # the fields are the JSON keys, in order


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


def run_view(run_dir: Path, now: float | None = None, env: Mapping[str, str] | None = None) -> RunView:
    """One run as `status --json` shows it. Liveness decides running vs lost (fails closed); for a
    Slurm run, Slurm decides (its supervisor runs on another host: queued, starting, or the state)."""
    state = read_state(run_dir)
    status = state.status
    live = liveness(state.pid, state.pid_start)
    trainer_live = liveness(state.trainer_pid, state.trainer_start)
    slurm_state = None
    if state.slurm_job_id:
        status, slurm_state = _slurm_status(state.slurm_job_id, status, os.environ if env is None else env)
    elif not status.is_terminal() and live is Liveness.DEAD:
        status = RunStatus.LOST
    p = state.progress or {}
    step, total = p.get("step"), p.get("total_steps")
    gpu_gib = None
    if trainer_live is Liveness.ALIVE and state.gpu_count and state.trainer_pid:
        gpu_gib = gpu_memory_of(_process_tree(state.trainer_pid))
    rate = state.steps_per_second
    eta = None
    if status in (RunStatus.RUNNING, RunStatus.RECOVERING) and rate and step is not None and total:
        since = (now or time.time()) - float(state.progress_at or time.time())
        eta = max(0.0, (total - step) / rate - since)
    cost = _cost(run_dir, state, status, step, total, rate, now)
    message = state.message
    exit_code, failure_kind, last_word = state.exit_code, state.failure_kind, None
    if status is RunStatus.LOST and state.status is not RunStatus.LOST and not state.slurm_job_id:
        # A supervisor that could not write its end, or died of an error of its own, left a last word.
        last_word = read_last_word(run_dir, state.output_dir, state.pid, state.pid_start)
    if last_word is not None and last_word.get("status") in {s.value for s in RunStatus if s.is_terminal()}:
        status = RunStatus(last_word["status"])  # the end state.json could not take
        message, exit_code = str(last_word.get("message") or ""), last_word.get("exit_code")
        failure_kind = _failure_kind(last_word.get("failure_kind"))
    elif status is RunStatus.LOST and state.status is not RunStatus.LOST:
        # The recorded message is the dead supervisor's last word ("retrying..."): it no longer holds.
        message = lost_message(state, run_dir.name, trainer_live, died=last_word)
    live_run = status in (RunStatus.RUNNING, RunStatus.RECOVERING, RunStatus.STARTING)
    return RunView(
        id=state.id or run_dir.name,
        name=state.name,
        status=status,
        attempt=state.attempt,
        step=step,
        total_steps=total,
        loss=p.get("loss"),
        lr=p.get("lr"),
        throughput=p.get("throughput"),
        steps_per_second=rate,
        eta_seconds=None if eta is None else round(eta, 1),
        micro_batch=state.micro_batch,
        accumulation=state.accumulation,
        pid=state.pid,
        supervisor_alive=live,
        trainer_pid=state.trainer_pid,
        trainer_alive=trainer_live,
        output_dir=state.output_dir,
        run_dir=str(run_dir),
        created=state.created,
        exit_code=exit_code,
        failure_kind=failure_kind,
        message=message,
        last_message=state.message if message != state.message else None,
        last_checkpoint=state.last_checkpoint,
        health=(state.health or {}).get("health"),
        diverged=state.diverged,
        gpu_memory_gib=gpu_gib,
        predicted_peak_gib=state.predicted_peak_gib,
        observed_peak_gib=state.observed_peak_gib,
        slurm_job_id=state.slurm_job_id,
        slurm_state=slurm_state,
        environment_changed=env_changed_line(state),
        stall=stall_view(state, now if now is not None else time.time(), live_run),
        cost=cost,
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
    if state.slurm_job_id:
        what = f"lost: Slurm job {state.slurm_job_id} no longer runs and its supervisor wrote no final status"
    elif died is not None and died.get("cause"):
        what = f"lost: its supervisor (pid {state.pid}) failed: {died['cause']} (in {died.get('where')})"
        if died.get("trainer_exit_code") is not None:
            what += f"; its trainer ran on to its end, exit code {died['trainer_exit_code']}"
    else:
        what = f"lost: its supervisor (pid {state.pid}) is gone without writing a final status"
        what += " (a reboot, a kill or the OOM killer)"
    if trainer_live is Liveness.ALIVE and state.trainer_pid and not state.slurm_job_id:
        what += f"; its trainer (pid {state.trainer_pid}) still runs unsupervised, and resume stops it first"
    where = (
        f"its last complete checkpoint (checkpoint-{state.last_checkpoint} when last seen)"
        if state.last_checkpoint
        else "the start (it recorded no complete checkpoint)"
    )
    return f"{what}; `ftlaunch resume {run_id}` continues it from {where}"


def env_changed_line(state: RunState) -> str | None:
    """`environment changed at attempt 3 (transformers 4.49.0 -> 4.55.0)`, from the record the
    supervisor keeps in the state (ftlaunch.run.environment); None when no deciding package changed."""
    changed = (state.environment or {}).get("changed")
    if not changed:
        return None
    since = f" since run {changed['since_run']}" if changed.get("since_run") else ""
    how = "" if changed.get("accepted") else "; not resumed (resume --allow-env-change)"
    return f"environment changed at attempt {changed.get('attempt')}{since} ({changed.get('changes')}){how}"


def stall_view(state: RunState, now: float, live: bool) -> StallView:
    """The stall watchdog's record in the state as `status` shows it (``live``: the run is live)."""
    stall = state.stall or {}
    at = stall.get("last_progress_at")
    idle = round(max(0.0, now - float(at)), 1) if live and at is not None else None
    return StallView(
        seconds_since_progress=idle,
        phase=stall.get("phase") if live else None,
        timeout_seconds=stall.get("allowance_s") if live else None,
        timeout_why=stall.get("why") if live else None,
        load_seconds=stall.get("load_s"),
        no_progress_attempts=state.no_progress_attempts,
    )


def _slurm_status(job_id: str, recorded: RunStatus, env: Mapping[str, str]) -> tuple[RunStatus, str | None]:
    """A Slurm run: queued/starting while Slurm holds the job and no supervisor has taken over; the
    supervisor's own status while the job runs; lost when Slurm no longer runs the job and no final
    status was written. From squeue and scontrol, so it works without accounting (sacct); when no
    Slurm command answers, the recorded status stands (it may be alive: fail closed). The local pid
    says nothing here: the supervisor runs on the job's first node."""
    from ftlaunch.run.slurm import sbatch as slurm

    info = slurm.query_job(job_id, env)
    job_state = info.state
    if not info.known:
        return recorded, None
    if job_state in slurm.ACTIVE_STATES:
        if recorded in (RunStatus.RUNNING, RunStatus.RECOVERING) and job_state not in slurm.QUEUED_STATES:
            return recorded, job_state
        return RunStatus(slurm.status_of(job_state) or recorded.value), job_state
    if recorded.is_terminal():
        return recorded, job_state
    return RunStatus.LOST, job_state


def _cost(run_dir: Path, state: RunState, status: RunStatus, step, total, rate, now) -> CostView:
    """tokens/s of this attempt and GPU-hours so far / projected, from the run's own records."""
    from ftlaunch.run import accounting as acc

    gpus = int(state.gpu_count or 0)
    live = status in (RunStatus.RUNNING, RunStatus.RECOVERING, RunStatus.STARTING)
    # A lost run's last attempt ended at its last sign of life, not at 0 s (nor now).
    end = (now or time.time()) if live else _last_sign_of_life(run_dir, state)
    spans = acc.attempt_spans(read_events(run_dir), now=end)
    busy = acc.busy_seconds(spans)
    so_far = acc.gpu_hours(busy, gpus)
    left = acc.projected_hours(step, total, rate) if live else 0.0
    tokens_per_second = None
    out_dir = Path(state.output_dir or "")
    if live and (out_dir / "trainer_log.jsonl").exists():
        records = prog.parse_trainer_log((out_dir / "trainer_log.jsonl").read_text(errors="replace"))
        tokens_per_second = acc.recent_rates(records).get("tokens_per_second")
    return CostView(
        tokens_per_second=tokens_per_second,
        wall_seconds=round(busy, 1),
        gpu_hours=round(so_far, 4),
        gpu_hours_projected=None if left is None else round(so_far + left * gpus, 4),
    )


def _last_sign_of_life(run_dir: Path, state: RunState) -> float | None:
    """When a run last wrote anything: its log, events, state, or the trainer's log."""
    folder = RunFolder(run_dir)
    paths = [folder.train_log, folder.events, folder.state]
    if state.output_dir:
        paths.append(Path(state.output_dir) / "trainer_log.jsonl")
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=None)


def _process_tree(pid: int) -> set[int]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.Error:
        return {pid}


def all_runs(env: Mapping[str, str]) -> list[RunView]:
    """Every run; one whose state cannot be read says so (status unreadable)."""
    out: list[RunView] = []
    for run_dir in list_runs(env):
        try:
            out.append(run_view(run_dir))
        except StateError as exc:
            out.append(RunView.unreadable(run_dir, exc.message))
    return out


def find_run(env: Mapping[str, str], ref: str | None) -> Path:
    """RUN is an id, a unique id prefix or a name; None means the latest run."""
    runs = list_runs(env)
    if not runs:
        raise RunNotFoundError(f"no runs under {runs_root(env)}", hint="start one with `ftlaunch train CONFIG.yaml`")
    if ref is None:
        return runs[-1]
    exact = [p for p in runs if p.name == ref]
    if exact:
        return exact[0]
    prefix = [p for p in runs if p.name.startswith(ref)]
    if len(prefix) == 1:
        return prefix[0]
    named = [p for p in runs if run_name(p) == ref]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:  # a name may be reused (every `train` of one config): never guess which
        raise RunNotFoundError(
            f"run name {ref!r} matches {len(named)} runs, oldest first:\n{_started_list(named)}",
            hint=f"name one by its id (or a unique prefix of it), e.g. {named[-1].name} for the latest",
        )
    if len(prefix) > 1:
        raise RunNotFoundError(
            f"run {ref!r} is ambiguous: {', '.join(p.name for p in prefix)}",
            hint="give more characters of the id",
        )
    raise RunNotFoundError(f"no run {ref!r}", hint="`ftlaunch runs` lists them")


def _started_list(run_dirs: list[Path]) -> str:
    """One line per run, oldest first: id, status, start time and output_dir, enough to tell runs of
    one name apart. The status is the one `ftlaunch runs` shows (a dead supervisor's run is lost)."""
    out = []
    for p in run_dirs:
        try:
            v = run_view(p)
        except FtlaunchError:
            out.append(f"  - {p.name}  state unreadable")
            continue
        started = (v.created or "?")[:19].replace("T", " ")
        out.append(f"  - {p.name}  {v.status.value}, started {started} UTC, output_dir {v.output_dir}")
    return "\n".join(out)
