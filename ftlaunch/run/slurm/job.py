"""The batch step of a Slurm run (`python -m ftlaunch.run.slurm.job RUN_DIR`, from job.sbatch).

Runs the supervisor as a child, exactly as on one machine (first start: the supervisor; a requeued
job: `ftlaunch resume RUN --foreground`, which restarts from the last complete checkpoint). Slurm's
warning before the time limit (USR1, from `--signal=B:USR1@N`) stops the trainer gracefully through
the supervisor and requeues the job; SIGTERM (scancel) stops it for good. Signal handlers only
record; the loop acts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from ftlaunch.errors import StateError
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.state import RunStatus
from ftlaunch.run.store import append_event, read_events, read_state, update_state


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
    started = any(e.get("event") == "attempt_started" for e in read_events(run_dir))
    if not started:
        return [python, "-m", "ftlaunch.run.supervisor", str(run_dir)]
    return [python, "-m", "ftlaunch", "resume", run_dir.name, "--foreground", "--no-follow"]


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
    append_event(run_dir, "slurm_not_resumed", status=state.status.value, message=state.message)
    print(f"ftlaunch: run {run_dir.name} ended {state.status.value}: not resumed ({state.message})", file=sys.stderr)
    return state.status.exit_code()


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
    append_event(run_dir, "slurm_job_started", **{k.lower(): v for k, v in job.items()})
    update_state(run_dir, slurm_job=job)
    if (held := _stays_down(run_dir)) is not None:
        return held
    # The supervisor writes train.log itself; its echo would reach train.log twice via Slurm's output.
    child = subprocess.Popen(child_command(run_dir, sys.executable), env=env, stdout=subprocess.DEVNULL)
    forwarded = False
    while child.poll() is None:
        if (flags.usr1 or flags.term) and not forwarded:
            why = "time limit near (USR1)" if flags.usr1 else "cancelled (SIGTERM)"
            append_event(run_dir, "slurm_signal", why=why)
            child.send_signal(signal.SIGTERM)  # the supervisor stops the trainer's group gracefully
            forwarded = True
        time.sleep(poll)
    code = child.returncode
    if flags.usr1 and not flags.term and job.get("SLURM_JOB_ID") and _stays_down(run_dir) is None:
        ok = slurm.requeue(job["SLURM_JOB_ID"], env)
        append_event(run_dir, "requeued" if ok else "requeue_failed", job_id=job["SLURM_JOB_ID"])
        if ok:
            update_state(
                run_dir, status=RunStatus.QUEUED, message="requeued before the time limit; resumes when it runs"
            )
            return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
