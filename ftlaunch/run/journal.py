"""What the supervisor records about a run: its events (events.jsonl), its state (state.json) and the
lines it adds to train.log. One method per thing that happens, so the supervisor's loop reads as
decisions, and every event and state field it writes is listed here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftlaunch.run.checkpoints import SetAside
from ftlaunch.run.progress import Progress
from ftlaunch.run.recovery import Decision, Exit
from ftlaunch.run.state import Budget, FailureKind, RunState, RunStatus
from ftlaunch.run.store import append_event, update_state


def _batch(values: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "micro_batch": values.get("per_device_train_batch_size"),
        "accumulation": values.get("gradient_accumulation_steps"),
    }


class RunJournal:
    def __init__(self, run_dir: Path, echo: bool = False):
        self.run_dir = run_dir
        self.echo = echo

    def say(self, text: str) -> None:
        """A line of ftlaunch's own in train.log (`ftlaunch logs` shows it), echoed when in the foreground."""
        with open(self.run_dir / "train.log", "a") as f:
            f.write(text + "\n")
        if self.echo:
            print(text, flush=True)

    def busy(self, message: str) -> None:
        """Another run holds the output_dir: this one never started."""
        update_state(self.run_dir, status=RunStatus.FAILED, failure_kind=FailureKind.BUSY, message=message)
        append_event(self.run_dir, "failed", kind=FailureKind.BUSY.value, message=message)

    def supervising(self, pid: int, pid_start: float | None) -> None:
        update_state(self.run_dir, status=RunStatus.STARTING, pid=pid, pid_start=pid_start, ended=None, exit_code=None)

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

    def attempt_header(self, attempt: int) -> None:
        with open(self.run_dir / "train.log", "a") as f:
            f.write(f"\n===== ftlaunch attempt {attempt} =====\n")

    def trainer_started(self, pid: int, start: float | None) -> None:
        update_state(self.run_dir, trainer_pid=pid, trainer_start=start)

    def stopping(self, signum: int | None) -> None:
        append_event(self.run_dir, "stopping", signal=signum)

    def progress(self, p: Progress, rate: float | None, at: float, recovered: int | None = None) -> None:
        """The trainer's progress; ``recovered``: the attempt whose trainer just passed the furthest
        step seen before it (a recovering run is running again)."""
        more: dict[str, Any] = {}
        if recovered is not None:
            more["status"] = RunStatus.RUNNING
            append_event(self.run_dir, "recovered", attempt=recovered, step=p.step)
        update_state(self.run_dir, progress=p.to_dict(), steps_per_second=rate, progress_at=at, **more)

    def last_progress(self, p: Progress) -> None:
        """The last lines of an attempt may have come while updates were throttled."""
        update_state(self.run_dir, progress=p.to_dict())

    def checkpoint(self, step: int, path: Path) -> None:
        append_event(self.run_dir, "checkpoint", step=step, path=path.name)
        update_state(self.run_dir, last_checkpoint=step)

    def observed_peak(self, gib: float) -> None:
        update_state(self.run_dir, observed_peak_gib=round(gib, 3))

    def exited(self, attempt: int, rc: int, ex: Exit, step: int | None) -> None:
        kind = ex.kind.value if ex.kind else "success"
        append_event(self.run_dir, "exited", attempt=attempt, code=rc, kind=kind, message=ex.message, step=step)

    def retry(
        self, attempt: int, d: Decision, ex: Exit, values: Mapping[str, Any], trainer_env: Mapping[str, str]
    ) -> None:
        append_event(self.run_dir, "retry", attempt=attempt, message=d.message, edits=d.edits)
        update_state(
            self.run_dir,
            status=RunStatus.RECOVERING,
            message=d.message,
            budget=d.budget,
            trainer_env=dict(trainer_env),
            last_failure=ex.kind,
            **_batch(values),
            **({"recovered_batch": True} if "per_device_train_batch_size" in d.edits else {}),
        )
        self.say(f"ftlaunch: {d.message}")

    def finished(self, status: RunStatus, code: int, ex: Exit, message: str, budget: Budget) -> RunState:
        state = update_state(
            self.run_dir,
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
