"""The batch step of a Slurm run (`python -m ftlaunch.run.slurm.job RUN_DIR`, from job.sbatch).

Runs on the first node of the allocation. Chooses MASTER_ADDR there (--master-addr, else the node's
NodeAddr from `scontrol show node`, resolved on this node; no address: the run fails at once with
the reason, `rendezvous`), then runs the supervisor as a child, exactly as on one machine (first
start: the supervisor; a requeued or resubmitted job: `ftlaunch resume RUN --foreground`, which
restarts from the last complete checkpoint).

Signals (handlers only record; the loop acts):
- USR1 (`--signal=B:USR1@N`, the time limit nears): the trainer is stopped gracefully through the
  supervisor (SIGUSR2: journaled as Slurm's stop) and the job requeued by us;
- SIGTERM: `ftlaunch stop` (it writes a `stop_requested` event before its scancel): forwarded as
  SIGTERM, stopped. Anything else is Slurm's doing, forwarded as SIGUSR2 (the supervisor journals
  "stopped by Slurm", never "by the user") and then recorded as what it was: a requeue (scontrol requeue,
  preemption with requeue, a node failure: Slurm's Restarts count went up) leaves the run `queued`;
  a cancel or preemption without requeue leaves it `lost`, saying that `ftlaunch resume` submits it
  again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

from ftlaunch.errors import FtlaunchError, StateError
from ftlaunch.run import transitions as journal
from ftlaunch.run.events import Event
from ftlaunch.run.procs import python_module
from ftlaunch.run.slurm import beat
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.state import FailureKind, RunStatus
from ftlaunch.run.store import read_events, read_state


class Flags:
    """What the signal handlers saw."""

    def __init__(self) -> None:
        self.usr1 = False
        self.term = False

    def on_usr1(self, _sig: int, _frame: FrameType | None) -> None:
        self.usr1 = True

    def on_term(self, _sig: int, _frame: FrameType | None) -> None:
        self.term = True


def child_command(run_dir: Path, python: str) -> list[str]:
    """The supervisor for a run that never started; else a foreground resume (a requeued job)."""
    started = any(e.get("event") == Event.ATTEMPT_STARTED for e in read_events(run_dir))
    if not started:
        return python_module(python, "ftlaunch.run.supervisor", str(run_dir))
    return python_module(python, "ftlaunch", "resume", run_dir.name, "--foreground", "--no-follow")


# A run that ended here must stay down when the job is requeued (by us, an admin or a node failure):
# restarting it would only repeat the attempts that made no progress, or fill the same disk again.
_STAY_DOWN = (RunStatus.NO_PROGRESS, RunStatus.DISK_FULL)


def _stays_down(run_dir: Path) -> int | None:
    """The exit code of a run the restart brake (or a full disk) ended, else None."""
    try:
        state = read_state(run_dir)
    except StateError:
        return None
    if state.status not in _STAY_DOWN:
        return None
    journal.note(run_dir, Event.SLURM_NOT_RESUMED, status=state.status.value, message=state.message)
    print(f"ftlaunch: run {run_dir.name} ended {state.status.value}: not resumed ({state.message})", file=sys.stderr)
    return state.status.exit_code()


def stop_requested(events: list[dict], job_id: str | None) -> bool:
    """`ftlaunch stop` asked for this job's end (pure: over the run's events)."""
    return any(e.get("event") == Event.STOP_REQUESTED and str(e.get("job_id")) == str(job_id) for e in events)


def signal_for_supervisor(events: list[dict], job_id: str | None) -> int:
    """What a SIGTERM to the batch step becomes for the supervisor (pure): SIGTERM when `ftlaunch stop`
    asked for this job's end (a user's stop), else SIGUSR2 (Slurm's own: a requeue, a preemption, a
    scancel from outside ftlaunch), which the supervisor journals as Slurm's, never as the user's."""
    return signal.SIGTERM if stop_requested(events, job_id) else signal.SIGUSR2


def ended_by_slurm(info: slurm.JobInfo, restart_count: int, run_id: str) -> tuple[RunStatus, str, Event]:
    """What a SIGTERM that ftlaunch did not ask for was: (status, message, event). Pure."""
    if info.restarts is not None and info.restarts > restart_count:
        return (
            RunStatus.QUEUED,
            "requeued by Slurm (scontrol requeue, preemption or a node failure); resumes from the last "
            "complete checkpoint when the job runs again",
            Event.REQUEUED_BY_SLURM,
        )
    what = "preempted" if info.state == "PREEMPTED" else f"ended by Slurm ({info.state or 'state unknown'})"
    return (
        RunStatus.LOST,
        f"{what}, not by `ftlaunch stop`; `ftlaunch resume {run_id}` submits it again "
        "from the last complete checkpoint",
        Event.ENDED_BY_SLURM,
    )


def _master_addr(run_dir: Path, env: dict[str, str]) -> str | None:
    """Set MASTER_ADDR in ``env`` (chosen and resolved here, on the first node); None when that
    worked, else why not (the run is then recorded failed: rendezvous)."""
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None  # not in a job (tests of the step itself): MASTER_ADDR as given
    try:
        node = slurm.first_host(nodelist, env)
        given = env.get("FTLAUNCH_MASTER_ADDR") or None
        chosen = slurm.choose_master_addr(node, given, () if given else slurm.node_addresses(node, env))
    except FtlaunchError as exc:
        return exc.message
    journal.note(run_dir, Event.MASTER_ADDR, addr=chosen.addr, how=chosen.how)
    if chosen.addr is None:
        return chosen.how
    env["MASTER_ADDR"] = chosen.addr
    print(f"ftlaunch: MASTER_ADDR {chosen.how}", flush=True)
    return None


def _fail(run_dir: Path, why: str) -> int:
    message = f"rendezvous: {why}"
    kind, status = FailureKind.RENDEZVOUS, RunStatus.FAILED
    said = {"status": status.value, "failure_kind": kind.value}
    journal.job_ended(run_dir, Event.ENDED, said, status=status, message=message, failure_kind=kind)
    print(f"ftlaunch: run {run_dir.name} failed before the trainer started: {message}", flush=True)
    return RunStatus.FAILED.exit_code()


def _after_term(run_dir: Path, job: Mapping[str, str], env: Mapping[str, str]) -> None:
    """A SIGTERM ended the job: keep `stopped` only where `ftlaunch stop` asked for it."""
    job_id = job.get("SLURM_JOB_ID")
    if not job_id or stop_requested(read_events(run_dir), job_id):
        return
    try:
        recorded = read_state(run_dir).status
    except StateError:
        recorded = RunStatus.LOST
    if recorded.is_terminal() and recorded is not RunStatus.STOPPED:
        return  # it ended on its own (succeeded, failed...) before the signal landed
    info = slurm.query_job(job_id, env)
    status, message, event = ended_by_slurm(info, int(job.get("SLURM_RESTART_COUNT") or 0), run_dir.name)
    said = {"job_id": job_id, "slurm_state": info.state, "restarts": info.restarts, "status": status.value}
    journal.job_ended(run_dir, event, said, status=status, message=message)


def main(argv: list[str] | None = None, poll: float = 0.2) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ftlaunch.run.slurm.job RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    env = dict(os.environ)
    flags = Flags()
    signal.signal(signal.SIGUSR1, flags.on_usr1)
    signal.signal(signal.SIGTERM, flags.on_term)
    job = slurm.slurm_env(env)
    journal.job_started(run_dir, job)
    if (held := _stays_down(run_dir)) is not None:
        return held
    if (why := _master_addr(run_dir, env)) is not None:
        return _fail(run_dir, why)
    # The supervisor writes train.log itself; its echo would reach train.log twice via Slurm's output.
    child = subprocess.Popen(child_command(run_dir, sys.executable), env=env, stdout=subprocess.DEVNULL)
    forwarded = False
    beaten = 0.0
    while child.poll() is None:
        if job.get("SLURM_JOB_ID") and time.monotonic() - beaten >= beat.BEAT_S:
            beat.beat(run_dir, job["SLURM_JOB_ID"])  # `status` on the login node: this step is alive
            beaten = time.monotonic()
        if (flags.usr1 or flags.term) and not forwarded:
            why = "time limit near (USR1)" if flags.usr1 else "SIGTERM (scancel, requeue or preemption)"
            sig = signal.SIGUSR2  # the time limit near: Slurm's, as a requeue or a preemption is
            if flags.term and not flags.usr1:  # `ftlaunch stop`'s (a user's stop), or Slurm's own
                sig = signal_for_supervisor(read_events(run_dir), job.get("SLURM_JOB_ID"))
            journal.note(run_dir, Event.SLURM_SIGNAL, why=why, by="ftlaunch stop" if sig == signal.SIGTERM else "slurm")
            child.send_signal(sig)  # the supervisor stops the trainer's group gracefully
            forwarded = True
        time.sleep(poll)
    code = child.returncode
    if flags.usr1 and not flags.term and job.get("SLURM_JOB_ID") and _stays_down(run_dir) is None:
        if slurm.requeue(job["SLURM_JOB_ID"], env):
            journal.requeued(run_dir, job["SLURM_JOB_ID"])
            return 0
        journal.note(run_dir, Event.REQUEUE_FAILED, job_id=job["SLURM_JOB_ID"])
    elif flags.term and not flags.usr1:
        _after_term(run_dir, job, env)
    return code


if __name__ == "__main__":
    sys.exit(main())
