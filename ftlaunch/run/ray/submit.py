"""Submitting a Ray run's attempts and acting on its job: the job's entrypoint and runtime env, one
submission id per attempt, the follower beside it, stop and status through the Jobs API.

The entrypoint is ftlaunch's own supervisor for the run (``python -m ftlaunch.run.supervisor
RUN_DIR``); a later attempt is ``ftlaunch resume RUN --foreground``, which restarts from the last
complete checkpoint after ending this run's orphaned trainer. The job's env carries PATH with this
Python's bin folder first (LLaMA-Factory's launcher runs `torchrun` by name), FTLAUNCH_HOME, the
plan's launch variables, the variables a trainer reads (HF_*, TRANSFORMERS_*, NCCL_*, ...) but never
a secret (the runtime env is shown by the dashboard), and FTLAUNCH_RAY_SUBMISSION: the attempt's id,
by which `resume` inside the job knows it runs there.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from ftlaunch.errors import BusyError
from ftlaunch.files import home
from ftlaunch.run import progress as prog
from ftlaunch.run import secrecy
from ftlaunch.run import transitions as journal
from ftlaunch.run.events import Event
from ftlaunch.run.procs import Liveness, liveness, python_module, spawn_detached
from ftlaunch.run.ray import jobs
from ftlaunch.run.ray.record import RayRecord, Submission, read_record, write_record
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import RunFolder, keep_notify_secrets, read_events, read_secrets, read_state

SUBMISSION_ENV = "FTLAUNCH_RAY_SUBMISSION"
# What a trainer (or ftlaunch on the node) reads from its environment, carried into the job.
CARRIED_PREFIXES = (
    "FTLAUNCH_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TOKENIZERS_", "NCCL_", "GLOO_",
    "TORCH_", "OMP_", "MKL_", "WANDB_", "LLAMAFACTORY_",
)  # fmt: skip
CARRIED_NAMES = ("PYTHONPATH", "MPLCONFIGDIR", "XDG_CACHE_HOME", "TMPDIR", "LANG", "LC_ALL", "DISABLE_VERSION_CHECK")
# Never carried though their names are carried ones: ftlaunch's own switches for this process.
_NEVER = frozenset({SUBMISSION_ENV, "FTLAUNCH_DEBUG"})


def job_env(
    env: Mapping[str, str], plan_env: Mapping[str, str], python: str, secrets: Iterable[str] = ()
) -> dict[str, str]:
    """The job's env_vars (pure): PATH with ``python``'s bin folder first, FTLAUNCH_HOME made
    absolute, the carried variables of ``env`` and the plan's launch variables. The dashboard shows
    them to anyone who reaches it: no secret name, no notification setting, no value that holds a
    secret of ``env`` or of ``secrets`` (the run's secrets.json), as ``secrecy.job_env`` decides."""
    named = {k: v for k, v in env.items() if (k.startswith(CARRIED_PREFIXES) or k in CARRIED_NAMES) and k not in _NEVER}
    known = [*secrecy.env_secret_values(env), *secrets]
    carried = secrecy.job_env(named, known)
    launch = secrecy.job_env(plan_env, known)
    bindir = str(Path(python).parent)
    path = [bindir, *[p for p in env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep) if p != bindir]]
    return {**carried, **launch, "FTLAUNCH_HOME": str(home(env).absolute()), "PATH": os.pathsep.join(path)}


def entrypoint(run_dir: Path, python: str, first: bool) -> str:
    """The supervisor for a run that never started; else a foreground resume (from the last complete
    checkpoint, this run's orphaned trainer ended first)."""
    # exec: the job's driver (the entrypoint's process) is ftlaunch itself, not a shell above it. -P
    # (python_module): the job's working folder is Ray's choice, and a folder there named ftlaunch
    # must not stand in for the package (issue 40).
    if first:
        return "exec " + shlex.join(python_module(python, "ftlaunch.run.supervisor", str(run_dir)))
    resume = python_module(python, "ftlaunch", "resume", run_dir.name, "--foreground", "--no-follow")
    return "exec " + shlex.join(resume)


def driver_resources(state: RunState) -> tuple[float, float | None]:
    """What the job's driver asks of its node, so Ray places it where the plan's devices are:
    (CPUs, GPUs): the plan's GPUs (the trainer gets them: Ray sets CUDA_VISIBLE_DEVICES), else one
    CPU per trainer process."""
    gpus = int(state.gpu_count or 0)
    if gpus:
        return 1.0, float(gpus)
    return float(max(1, int(state.world_size or 1))), None


def submit_attempt(run_dir: Path, env: Mapping[str, str], why: str) -> str:
    """Submit the run's next attempt as a new job (a new submission id); return the id."""
    record = read_record(run_dir)
    state = read_state(run_dir)
    sid = record.next_id(run_dir.name)
    first = not any(e.get("event") == Event.ATTEMPT_STARTED for e in read_events(run_dir))
    python = os.path.abspath(sys.executable)
    last = prog.last_complete_checkpoint(Path(state.output_dir or "."))
    resume_from = None if first or last is None else last[1].name
    env_vars = {**secrecy.job_env(record.env_vars), SUBMISSION_ENV: sid}  # a ray.json of before may hold one
    # Recorded before the call: a submission that reached the head is never left unknown.
    write_record(run_dir, record.with_submission(Submission(sid, time.time(), resume_from, why)))
    jobs.submit(
        record.address,
        sid,
        entrypoint(run_dir, python, first),
        env_vars,
        num_cpus=record.cpus,
        num_gpus=record.gpus,
        metadata={"ftlaunch_run": run_dir.name, "attempt_of": why},
    )
    journal.note(
        run_dir, Event.RAY_SUBMITTED, submission_id=sid, address=record.address, why=why, resume_from=resume_from
    )
    return sid


def first_submission(run_dir: Path, env: Mapping[str, str], address: str, plan_env: Mapping[str, str]) -> str:
    """Write ray.json and submit the run's first attempt (status queued until its supervisor runs).
    FTLAUNCH_NOTIFY stays here: its destinations go to the run's secrets.json, where the job's
    supervisor reads them (0600, never in the job's env, which the dashboard shows)."""
    state = read_state(run_dir)
    cpus, gpus = driver_resources(state)
    keep_notify_secrets(run_dir, env)
    secrets = secrecy.secret_values(read_secrets(run_dir), env)
    env_vars = job_env(env, plan_env, os.path.abspath(sys.executable), secrets)
    write_record(run_dir, RayRecord(address=address, cpus=cpus, gpus=gpus, env_vars=env_vars))
    RunFolder(run_dir).train_log.touch()  # `logs -f` works while the job is pending
    journal.queued(run_dir, f"submitted to the Ray cluster at {address}")
    return submit_attempt(run_dir, env, "start")


def refuse_beside_active(run_dir: Path, env: Mapping[str, str], output_dir: str) -> None:
    """BusyError (exit 7) when another Ray run into ``output_dir`` is not over: its supervisor takes the
    output_dir lock only once its job runs on a node, so the lock alone cannot tell (two `train` of one
    output_dir would both be submitted, the second failing `busy` later). Call it holding the output_dir
    lock. Fails closed: a run whose head does not answer counts as active."""
    from ftlaunch.run.orphans import runs_of_output_dir
    from ftlaunch.run.ray.record import is_ray_run

    for other, state in runs_of_output_dir(env, output_dir):
        if other.name == run_dir.name or state.engine_name() != "ray" or state.status.is_terminal():
            continue
        said = "being submitted"  # created, ray.json not written yet: its `train` let go of the lock
        if is_ray_run(other):
            status, word = job_status(other)
            if status.is_terminal():
                continue
            job = read_record(other).current
            said = status.value + (f", Ray job {job.id} {word.lower()}" if job and word else "")
        raise BusyError(
            f"output_dir {output_dir} is in use by run {other.name} ({said})",
            hint=f"wait for it, stop it (`ftlaunch stop {other.name}`), or set another output_dir",
        )


def start_follower(run_dir: Path, env: Mapping[str, str]) -> int:
    """The follower, detached (a new session): it outlives the shell that started the run."""
    cmd = python_module(os.path.abspath(sys.executable), "ftlaunch.run.ray.follow", str(run_dir))
    proc = spawn_detached(cmd, env, run_dir / "follower.log", cwd=run_dir)
    return proc.pid


def follower_alive(record: RayRecord) -> bool:
    """Fails closed: a follower whose liveness is UNKNOWN counts as alive."""
    return liveness(record.follower_pid, record.follower_start) is not Liveness.DEAD


def job_status(run_dir: Path) -> tuple[RunStatus, str | None]:
    """(the status to show, the job's word): the recorded status, with the Jobs API's status of the
    current submission, "engine unreachable" when the head does not answer (never failed)."""
    state = read_state(run_dir)
    record = read_record(run_dir)
    sub = record.current
    if sub is None:
        return state.status, None
    try:
        info = jobs.job(record.address, sub.id)
    except jobs.EngineUnreachable:
        return state.status, "engine unreachable"
    except jobs.JobNotFound:
        return state.status, "unknown to the head"  # a new head: `ftlaunch resume` submits the run there
    if info.terminal and not state.status.is_terminal() and not follower_alive(record):
        # Nobody will act on it: the job ended and the supervisor recorded no end (resume continues).
        return RunStatus.LOST, info.status
    return state.status, info.status


def stop_job(run_dir: Path, grace: float = 30.0, poll: float = 0.2) -> str:
    """`ftlaunch stop` of a Ray run: a `stop_requested` event (the follower then never retries the
    job), Ray's stop, then the end recorded: the supervisor's own, else stopped here."""
    state = read_state(run_dir)
    record = read_record(run_dir)
    sub = record.current
    if state.status.is_terminal():
        return f"run {run_dir.name} already {state.status.value}"
    if sub is None:
        journal.stopped(run_dir, "stopped by the user")
        return f"run {run_dir.name} stopped (never submitted)"
    journal.note(run_dir, Event.STOP_REQUESTED, submission_id=sub.id)
    try:
        jobs.stop(record.address, sub.id)
        deadline = time.monotonic() + grace
        info = jobs.job(record.address, sub.id)
        while not info.terminal and time.monotonic() < deadline:
            time.sleep(poll)
            info = jobs.job(record.address, sub.id)
    except (jobs.EngineUnreachable, jobs.JobNotFound) as exc:
        return _stop_without_head(run_dir, record, sub, grace, exc)
    if not read_state(run_dir).status.is_terminal():
        journal.stopped(run_dir, f"stopped by the user (job {sub.id})")
    journal.note(run_dir, Event.STOPPED, submission_id=sub.id, job_status=info.status)
    return f"run {run_dir.name} stopped (Ray job {sub.id} {info.status.lower()})"


def _stop_without_head(run_dir: Path, record: RayRecord, sub: Submission, grace: float, exc: Exception) -> str:
    """`stop` when the head does not answer (or knows no such job: a new head): the job cannot be asked
    to stop, and nothing but this stop will end the run's record (its follower gives up on a head gone
    for good). The driver, when it lives on this machine, is stopped as a local run's supervisor (it
    records its own end); then the run is recorded stopped, saying that Ray never confirmed it."""
    journal.note(run_dir, Event.ENGINE_UNREACHABLE, submission_id=sub.id, address=record.address, during="stop")
    state = read_state(run_dir)
    if liveness(state.pid, state.pid_start) is Liveness.ALIVE and state.pid:
        os.kill(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 10
        while liveness(state.pid, state.pid_start) is Liveness.ALIVE and time.monotonic() < deadline:
            time.sleep(0.1)
    why = "did not answer" if isinstance(exc, jobs.EngineUnreachable) else f"knows no job {sub.id}"
    if not read_state(run_dir).status.is_terminal():
        message = f"stopped by the user while the Ray head at {record.address} {why}: Ray never confirmed the job's end"
        journal.stopped(run_dir, message, submission_id=sub.id, job_status=None)
    return (
        f"run {run_dir.name} recorded stopped; the Ray head at {record.address} {why} (engine unreachable), so "
        f"Ray could not stop job {sub.id}: if that head comes back with it, stop it there (`ray job stop {sub.id}`)"
    )


def resubmit_by_hand(
    run_dir: Path, env: Mapping[str, str], edit: Callable[[], None] = lambda: None, changes: bool = False
) -> str | None:
    """`ftlaunch resume` of a Ray run from any shell: nothing while its job runs (a follower is
    started again if none lives; ``changes`` to its config are refused); else ``edit()`` applies the
    config edits and the next attempt is submitted (a fresh budget) and followed. None: the job is
    alive. Raises EngineUnreachable when the head does not answer: nothing is submitted then."""
    record = read_record(run_dir)
    sub = record.current
    try:
        info = jobs.job(record.address, sub.id) if sub else None
    except jobs.JobNotFound:
        info = None  # a new head: the old one took the job with it
    if info is not None and not info.terminal:
        if changes:
            raise BusyError(
                f"run {run_dir.name} is Ray job {sub.id} ({info.status}): its config cannot change under it",
                hint=f"stop it first (`ftlaunch stop {run_dir.name}`), then resume with the change",
            )
        if not follower_alive(record):
            start_follower(run_dir, env)
        return None
    before = read_state(run_dir)
    edit()
    state = read_state(run_dir)
    write_record(run_dir, replanned(read_record(run_dir), before, state))
    journal.resubmitting(run_dir, state)
    sid = submit_attempt(run_dir, env, "resume")
    journal.note(run_dir, Event.RESUMED, previous=state.status.value, submission_id=sid)
    if not follower_alive(read_record(run_dir)):
        start_follower(run_dir, env)
    return sid


def replanned(record: RayRecord, before: RunState, after: RunState) -> RayRecord:
    """The record for the next job after the run's config was edited (``resume --gpu``: a re-plan): the
    driver's resources from the state's figures now, and the job's env without the launch variables
    the plan no longer sets, with the new values of those it still sets (the supervisor lays the state's
    trainer_env over the job's env: a variable left behind, NPROC_PER_NODE=2, would reach the trainer). Pure."""
    cpus, gpus = driver_resources(after)
    old, new = dict(before.trainer_env or {}), dict(after.trainer_env or {})
    if old == new and (cpus, gpus) == (record.cpus, record.gpus):
        return record
    env_vars = {k: new.get(k, v) if k in old else v for k, v in record.env_vars.items() if k not in old or k in new}
    env_vars = {k: v for k, v in env_vars.items() if v != "***"}
    return replace(record, cpus=cpus, gpus=gpus, env_vars=env_vars)


def address_for_record(record: RayRecord, address: str | None) -> RayRecord:
    """A run resumed against another head (the old one gone): its new address."""
    return record if not address or address == record.address else replace(record, address=address)
