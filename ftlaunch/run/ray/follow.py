"""The follower beside a Ray run: ``python -m ftlaunch.run.ray.follow RUN_DIR``, detached on the
machine that submitted it (`train --engine ray`, `resume`).

Ray Jobs never retries a driver that died, and a submission id cannot be used twice. The run's own
supervisor (the job's driver) recovers what it sees (OOM, crash, stall, divergence...); what it
cannot see is its own end: a driver killed, a node lost, a head restarted. The follower reads the
job's status and decides with the pure ``next_step``:

- running or pending: wait;
- succeeded, or failed after the supervisor recorded an end (failed, no_progress, diverged...): done,
  as the supervisor recorded it;
- stopped (`ftlaunch stop`, or `ray job stop`): stopped, never retried;
- failed while the run's state still says it runs (the driver died from outside): the next attempt
  is submitted with a new submission id and resumes from the last complete checkpoint, under the
  restart brake (NO_PROGRESS_LIMIT attempts in a row without a new checkpoint end it no_progress);
- the head cannot be reached: "engine unreachable", never failed; it keeps asking for
  ``unreachable_for`` seconds, then leaves the run as recorded (`ftlaunch resume` continues it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from ftlaunch.errors import FtlaunchError
from ftlaunch.run import progress as prog
from ftlaunch.run import transitions as journal
from ftlaunch.run.events import Event
from ftlaunch.run.procs import start_time
from ftlaunch.run.ray import jobs
from ftlaunch.run.ray.record import RayRecord, Submission, read_record, write_record
from ftlaunch.run.recovery import NO_PROGRESS_LIMIT, Retry, driver_error, policy_of
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import read_events, read_state


class Step(StrEnum):
    WAIT = "wait"
    DONE = "done"
    RESUBMIT = "resubmit"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Next:
    """What to do now; ``status``/``message``: what to record (None: leave the state as it is)."""

    step: Step
    status: RunStatus | None = None
    message: str | None = None
    no_progress: int | None = None


def stop_was_requested(events: list[dict], submission_id: str | None) -> bool:
    return any(e.get("event") == Event.STOP_REQUESTED and e.get("submission_id") == submission_id for e in events)


def next_step(
    job: jobs.JobInfo | None,
    recorded: RunStatus,
    *,
    submission_id: str,
    stop_requested: bool,
    progressed: bool,
    no_progress: int,
    limit: int = NO_PROGRESS_LIMIT,
) -> Next:
    """Pure: what the follower does after reading a job (None: the head did not answer)."""
    if job is None:
        return Next(Step.UNREACHABLE, message="engine unreachable: the Ray head did not answer; the job may run on")
    if not job.terminal:
        return Next(Step.WAIT)
    if job.status == "STOPPED" or stop_requested:
        if recorded.is_terminal() and recorded is not RunStatus.STOPPED:
            return Next(Step.DONE)  # it ended on its own before the stop landed
        if stop_requested:
            return Next(Step.DONE, RunStatus.STOPPED, f"stopped by `ftlaunch stop` (job {submission_id}); not retried")
        who = "from outside the run, by Ray (`ray job stop` or the dashboard), not by `ftlaunch stop`"
        return Next(Step.DONE, RunStatus.STOPPED, f"stopped {who} (job {submission_id}); not retried")
    if job.status == "SUCCEEDED" or recorded.is_terminal():
        if recorded.is_terminal():
            return Next(Step.DONE)  # the supervisor's own last word
        return Next(Step.DONE, RunStatus.LOST, f"job {submission_id} ended without the supervisor recording an end")
    # FAILED while the run still runs: the driver died from outside (kill -9, a lost node, OOM killer).
    count = 0 if progressed else no_progress + 1
    # Ray's message: "Job entrypoint command failed with exit code -9, last available logs ...": its head.
    why = (job.message or f"driver exit code {job.driver_exit_code}").split(", last available logs")[0]
    why = why.strip().splitlines()[0][:200] if why.strip() else f"driver exit code {job.driver_exit_code}"
    # What a driver that exited (not one killed by a signal) printed last says more than its exit code
    # (issue 40): an import that failed fails at every start, so it ends the run, never resubmitted.
    exited = (job.driver_exit_code or 0) >= 0
    error = driver_error((job.message or "").partition(", last available logs")[2]) if exited else None
    if error is not None and policy_of(error.kind).retry is Retry.NEVER:
        note = policy_of(error.kind).note
        return Next(Step.DONE, RunStatus.FAILED, f"job {submission_id}'s driver died: {error.message} ({note})")
    why += f": {error.message}" if error is not None else ""
    if count >= limit:
        return Next(
            Step.DONE,
            RunStatus.NO_PROGRESS,
            f"job {submission_id} failed from outside ({why}), {count} attempts in a row without a new "
            "checkpoint (the restart brake); fix the cause, then `ftlaunch resume`",
            count,
        )
    return Next(
        Step.RESUBMIT,
        RunStatus.RECOVERING,
        f"job {submission_id} failed from outside ({why}); submitting the next attempt "
        f"[restart brake {count}/{limit}: attempts in a row without a new checkpoint]",
        count,
    )


def _checkpoint_step(name: str | None) -> int:
    return int(name.rsplit("-", 1)[1]) if name and name.rsplit("-", 1)[-1].isdigit() else -1


def follow(
    run_dir: Path,
    env: Mapping[str, str],
    *,
    poll: float = 1.0,
    unreachable_for: float = 600.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    resubmit: Callable[[Path, Mapping[str, str], str], str] | None = None,
) -> RunStatus:
    """Follow the run's job until the run ends (its status), or until the head has not answered for
    ``unreachable_for`` seconds (the recorded status, untouched). ``resubmit(run_dir, env, why)``
    submits the next attempt (``engines.ray.submit_attempt``)."""
    if resubmit is None:
        from ftlaunch.run.ray.submit import submit_attempt as resubmit
    unreachable_since: float | None = None
    while True:
        record = read_record(run_dir)
        sub = record.current
        state = read_state(run_dir)
        if sub is None or state.status.is_terminal():
            # Ended as recorded (the supervisor's own end, a stop): nothing is left to submit, and a head
            # torn down right after must not keep a follower asking it for ten minutes.
            if sub is not None and state.status is RunStatus.STOPPED:
                _name_who_stopped(run_dir, record, sub, sleep=sleep, clock=clock)
            return read_state(run_dir).status
        n, info = _next_of(run_dir, record, sub, state)
        if n.step is Step.UNREACHABLE:
            if unreachable_since is None:
                unreachable_since = clock()
                journal.note(run_dir, Event.ENGINE_UNREACHABLE, submission_id=sub.id, address=record.address)
            elif clock() - unreachable_since > unreachable_for:
                journal.note(run_dir, Event.FOLLOWER_GAVE_UP, submission_id=sub.id, waited_s=round(unreachable_for))
                return read_state(run_dir).status
            sleep(poll)
            continue
        if unreachable_since is not None:
            unreachable_since = None
            journal.note(run_dir, Event.ENGINE_REACHABLE, submission_id=sub.id)
        if n.step is Step.WAIT:
            sleep(poll)
            continue
        if n.status is not None:
            _record_end(run_dir, sub, n, n.status, info)
        if n.step is Step.DONE:
            return read_state(run_dir).status
        failed = _resubmit(run_dir, env, resubmit)
        if failed is not None:
            return failed


def _next_of(run_dir: Path, record: RayRecord, sub: Submission, state: RunState) -> tuple[Next, jobs.JobInfo | None]:
    """Ask the head about the current job and decide the next step: (the step, the job's info or None)."""
    try:
        info = jobs.job(record.address, sub.id)
    except (jobs.EngineUnreachable, jobs.JobNotFound):
        info = None  # a head that knows no such job is a new head: the job's fate is unknown
    out = Path(state.output_dir or ".")
    last = prog.last_complete_checkpoint(out)
    progressed = last is not None and last[0] > _checkpoint_step(sub.resume_from)
    n = next_step(
        info,
        state.status,
        submission_id=sub.id,
        stop_requested=stop_was_requested(read_events(run_dir), sub.id),
        progressed=progressed,
        no_progress=state.no_progress_attempts,
    )
    return n, info


def _name_who_stopped(
    run_dir: Path,
    record: RayRecord,
    sub: Submission,
    *,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    wait: float = 60.0,
) -> None:
    """A supervisor stopped by a SIGTERM records "stopped by the user": it cannot tell who sent it. When
    no `ftlaunch stop` asked for this job and Ray reports it STOPPED, it was `ray job stop` or the
    dashboard, from outside the run: recorded as that (Ray marks the job once its driver is gone:
    waited for up to ``wait`` seconds)."""
    if stop_was_requested(read_events(run_dir), sub.id):
        return
    deadline = clock() + wait
    while True:
        try:
            info = jobs.job(record.address, sub.id)
        except (jobs.EngineUnreachable, jobs.JobNotFound):
            return
        if info.terminal or clock() > deadline:
            break
        sleep(0.5)
    if info.status != "STOPPED":
        return  # a SIGTERM from elsewhere (a signal to the driver): not Ray's stop
    n = next_step(info, RunStatus.STOPPED, submission_id=sub.id, stop_requested=False, progressed=False, no_progress=0)
    _record_end(run_dir, sub, n, RunStatus.STOPPED, info)


def _record_end(run_dir: Path, sub: Submission, n: Next, status: RunStatus, info: jobs.JobInfo | None) -> None:
    """The attempt's end in the run's state and events."""
    said = {
        "submission_id": sub.id,
        "job_status": info.status if info else None,
        "driver_exit_code": info.driver_exit_code if info else None,
        "status": status.value,
        "message": n.message,
    }
    journal.job_ended(run_dir, Event.RAY_JOB_ENDED, said, status=status, message=n.message, no_progress=n.no_progress)


def _resubmit(
    run_dir: Path, env: Mapping[str, str], resubmit: Callable[[Path, Mapping[str, str], str], str]
) -> RunStatus | None:
    """Submit the next attempt; FAILED (recorded) when it cannot be submitted, else None."""
    try:
        resubmit(run_dir, env, "driver died")
    except FtlaunchError as exc:
        message = f"the next attempt could not be submitted: {exc.message}"
        said = {"message": message}
        journal.job_ended(run_dir, Event.RAY_RESUBMIT_FAILED, said, status=RunStatus.FAILED, message=message)
        return RunStatus.FAILED
    return None


def register(run_dir: Path, pid: int) -> None:
    """Record the follower's pid (with its start time: liveness) in ray.json."""
    record = read_record(run_dir)
    write_record(run_dir, replace(record, follower_pid=pid, follower_start=start_time(pid)))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ftlaunch.run.ray.follow RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    register(run_dir, os.getpid())
    status = follow(run_dir, os.environ)
    print(f"ftlaunch ray follower: run {run_dir.name} {status.value}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
