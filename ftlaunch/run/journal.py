"""What the supervisor records about a run: its events (events.jsonl), its state (state.json) and the
lines it adds to train.log. One method per thing that happens, so the supervisor's loop reads as
decisions, and every event and state field it writes is listed here.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ftlaunch.run.checkpoints import SetAside
from ftlaunch.run.progress import Progress
from ftlaunch.run.recovery import Decision, Exit
from ftlaunch.run.state import Budget, FailureKind, RunState, RunStatus
from ftlaunch.run.store import RunFolder, append_event, update_state


def _batch(values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "micro_batch": values.get("per_device_train_batch_size"),
        "accumulation": values.get("gradient_accumulation_steps"),
    }


def _best_effort(method: Callable[..., Any]) -> Callable[..., Any]:
    """A record that cannot be written (FTLAUNCH_HOME full or unwritable) must not end the supervisor:
    it would take the trainer with it. The failure is counted and said once the folder takes writes again."""

    @functools.wraps(method)
    def wrapper(self: RunJournal, *args: Any, **kwargs: Any) -> Any:
        try:
            result = method(self, *args, **kwargs)
        except OSError as exc:
            self.unwritten += 1
            if self.unwritable is None:
                self.unwritable = f"{exc.strerror or exc} ({getattr(exc, 'filename', None) or self.run_dir})"
                print(
                    f"ftlaunch supervisor: cannot write the run's records: {self.unwritable}; "
                    "the trainer keeps running",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        if self.unwritable is not None:
            lost, why = self.unwritten, self.unwritable
            self.unwritable, self.unwritten = None, 0
            self.say(
                f"ftlaunch: {lost} record(s) of the run could not be written while its folder refused writes "
                f"({why}); the trainer kept running"
            )
        return result

    return wrapper


class RunJournal:
    def __init__(self, run_dir: Path, echo: bool = False):
        self.run_dir = run_dir
        self.echo = echo
        self.unwritable: str | None = None  # why the run folder refuses writes right now
        self.unwritten = 0  # records lost meanwhile

    @_best_effort
    def say(self, text: str) -> None:
        """A line of ftlaunch's own in train.log (`ftlaunch logs` shows it), echoed when in the foreground."""
        if self.echo:
            print(text, flush=True)
        with open(RunFolder(self.run_dir).train_log, "a") as f:
            f.write(text + "\n")

    @_best_effort
    def busy(self, message: str) -> None:
        """Another run holds the output_dir: this one never started."""
        update_state(self.run_dir, status=RunStatus.FAILED, failure_kind=FailureKind.BUSY, message=message)
        append_event(self.run_dir, "failed", kind=FailureKind.BUSY.value, message=message)

    @_best_effort
    def supervising(self, pid: int, pid_start: float | None) -> None:
        update_state(self.run_dir, status=RunStatus.STARTING, pid=pid, pid_start=pid_start, ended=None, exit_code=None)

    @_best_effort
    def attempt_started(
        self,
        attempt: int,
        status: RunStatus,
        budget: Budget,
        values: Mapping[str, Any],
        resume_from: str | None,
        set_aside: list[SetAside],
    ) -> None:
        for s in set_aside:
            append_event(self.run_dir, "checkpoint_set_aside", checkpoint=s.name, problems=list(s.problems))
        update_state(
            self.run_dir, status=status, attempt=attempt, budget=budget, resume_from=resume_from, **_batch(values)
        )
        append_event(
            self.run_dir,
            "attempt_started",
            attempt=attempt,
            resume_from=resume_from,
            **_batch(values),
            set_aside=[s.describe() for s in set_aside],
        )

    @_best_effort
    def attempt_header(self, attempt: int) -> None:
        with open(RunFolder(self.run_dir).train_log, "a") as f:
            f.write(f"\n===== ftlaunch attempt {attempt} =====\n")

    @_best_effort
    def trainer_started(self, pid: int, start: float | None) -> None:
        update_state(self.run_dir, trainer_pid=pid, trainer_start=start)

    @_best_effort
    def stopping(self, signum: int | None) -> None:
        append_event(self.run_dir, "stopping", signal=signum)

    @_best_effort
    def progress(self, p: Progress, rate: float | None, at: float, recovered: int | None = None) -> None:
        """The trainer's progress; ``recovered``: the attempt whose trainer just passed the furthest
        step seen before it (a recovering run is running again)."""
        more: dict[str, Any] = {}
        if recovered is not None:
            more["status"] = RunStatus.RUNNING
            append_event(self.run_dir, "recovered", attempt=recovered, step=p.step)
        update_state(self.run_dir, progress=p.to_dict(), steps_per_second=rate, progress_at=at, **more)

    @_best_effort
    def last_progress(self, p: Progress) -> None:
        """The last lines of an attempt may have come while updates were throttled."""
        update_state(self.run_dir, progress=p.to_dict())

    @_best_effort
    def checkpoint(self, step: int, path: Path, best: int) -> None:
        append_event(self.run_dir, "checkpoint", step=step, path=path.name)
        update_state(self.run_dir, last_checkpoint=step, best_checkpoint=best)

    @_best_effort
    def watchdog(self, stall: Mapping[str, Any]) -> None:
        """The stall watchdog's view of this attempt (`status` shows the idle seconds and the allowance)."""
        update_state(self.run_dir, stall=dict(stall))

    @_best_effort
    def stalled(self, attempt: int, description: str, dump: str, stall: Mapping[str, Any]) -> None:
        append_event(self.run_dir, "stalled", attempt=attempt, message=description, stacks=dump)
        update_state(self.run_dir, stall=dict(stall))

    @_best_effort
    def partial_removed(self, names: list[str], freed: int) -> None:
        """ENOSPC: the partial folder of the failed save is removed (it can never be resumed)."""
        append_event(self.run_dir, "partial_checkpoint_removed", names=names, bytes=freed)

    @_best_effort
    def gpu_waited(self, message: str, waited_s: float, released: bool) -> None:
        """Clean restarts: how long the next attempt waited for the old trainer's GPU memory."""
        append_event(self.run_dir, "gpu_wait", message=message, waited_s=waited_s, released=released)
        self.say(f"ftlaunch: {message}")

    @_best_effort
    def observed_peak(self, gib: float) -> None:
        update_state(self.run_dir, observed_peak_gib=round(gib, 3))

    @_best_effort
    def exited(self, attempt: int, rc: int, ex: Exit, step: int | None) -> None:
        kind = ex.kind.value if ex.kind else "success"
        append_event(self.run_dir, "exited", attempt=attempt, code=rc, kind=kind, message=ex.message, step=step)

    @_best_effort
    def retry(
        self, attempt: int, d: Decision, ex: Exit, values: Mapping[str, Any], trainer_env: Mapping[str, str]
    ) -> None:
        append_event(self.run_dir, "retry", attempt=attempt, message=d.message, edits=d.edits)
        update_state(
            self.run_dir,
            status=RunStatus.RECOVERING,
            no_progress_attempts=d.no_progress,
            message=d.message,
            budget=d.budget,
            trainer_env=dict(trainer_env),
            last_failure=ex.kind,
            **_batch(values),
            **({"recovered_batch": True} if "per_device_train_batch_size" in d.edits else {}),
        )
        self.say(f"ftlaunch: {d.message}")

    @_best_effort
    def finished(
        self, status: RunStatus, code: int, ex: Exit, message: str, budget: Budget, no_progress: int | None = None
    ) -> RunState:
        more = {} if no_progress is None else {"no_progress_attempts": no_progress}
        state = update_state(
            self.run_dir,
            **more,
            status=status,
            ended=time.time(),
            exit_code=code,
            failure_kind=ex.kind,
            message=message,
            budget=budget,
            trainer_pid=None,
        )
        append_event(self.run_dir, status.value, message=message, exit_code=code)
        return state
