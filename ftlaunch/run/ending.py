"""Why an attempt ended, with what only the world shows: the pure ``recovery.why_it_ended`` over the
AttemptEnd, then, for an ENOSPC (or the check before a save), the failed save's partial folder removed,
for a bare SIGKILL, the kernel log asked whether the host's OOM killer sent it (issue 11), and for a
checkpoint the trainer could not load on resume, that checkpoint set aside (issue 40)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftlaunch.run import progress as prog
from ftlaunch.run import transitions
from ftlaunch.run.checkpoints import set_aside_unloadable
from ftlaunch.run.disk import enospc_line
from ftlaunch.run.events import Event
from ftlaunch.run.journal import RunJournal
from ftlaunch.run.recovery import UNLOADABLE, AttemptEnd, Exit, why_it_ended
from ftlaunch.run.state import FailureKind, RunState
from ftlaunch.run.watch.disk import after_disk_full


def explain(
    end: AttemptEnd,
    ended: RunState,
    out: Path,
    weights_only: bool,
    stopped: bool,
    journal: RunJournal,
    read_kernel_log: Callable[[], str],
) -> Exit:
    """``ended``: the state once the attempt ended (its progress, checkpoints, disk forecast, trainer
    pid); ``stopped``: a stop was asked for."""

    def stepped() -> bool:  # in any attempt: a step recorded or a checkpoint saved
        progressed = bool((ended.progress or {}).get("step")) or bool(ended.best_checkpoint)
        return progressed or prog.last_complete_checkpoint(out, weights_only) is not None

    ex = why_it_ended(end, stopped=stopped, stepped=stepped, enospc=enospc_line)
    if ex.kind is FailureKind.DISK_FULL:
        return after_disk_full(ex, out, weights_only, ended.disk, journal)
    if ex.kind is FailureKind.HOST_OOM:
        return with_kernel_evidence(ex, ended.trainer_pid, read_kernel_log)
    if ex.detail.get(UNLOADABLE):
        return after_unloadable(ex, out, ended.resume_from, journal)
    return ex


def after_unloadable(ex: Exit, out: Path, resumed: str | None, journal: RunJournal) -> Exit:
    """The trainer could not load the checkpoint this attempt resumed from (``resumed``, as the state
    recorded it): set it aside, so the next attempt (a crash retry, budgeted and braked) resumes from
    the one before; the message says where it went."""
    try:
        moved = set_aside_unloadable(out, resumed, str(ex.detail[UNLOADABLE]))
    except OSError as exc:  # a read-only output_dir: the retry meets it again, the budget ends it
        return replace(ex, message=f"{ex.message}; {resumed} could not be set aside: {exc}")
    if moved is None:
        return ex
    fields = {"checkpoint": moved.name, "moved_to": moved.moved_to, "problems": list(moved.problems)}
    journal.write(lambda: transitions.note(journal.run_dir, Event.CHECKPOINT_SET_ASIDE, reason="unloadable", **fields))
    journal.say(f"ftlaunch: set aside {moved.describe()}")
    return replace(ex, message=f"{ex.message}; set aside {moved.name} as {moved.moved_to}")


def kernel_log() -> str:
    """The kernel ring buffer when this user may read it (often root only); empty otherwise."""
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def with_kernel_evidence(ex: Any, pid: int | None, read: Callable[[], str] = kernel_log) -> Any:
    """Say only what the kernel log shows about a SIGKILL with no traceback (issue 11).

    Shows an OOM kill of the trainer: a host OOM. Readable but shows none: not the OOM killer, a
    crash retried as such. Unreadable: the cause is unknown, and the message says so."""
    text = read()
    if not text or not pid:
        return replace(
            ex,
            message=ex.message + ": cause unknown (the kernel log is not readable here to tell whether the "
            "host's OOM killer did it; `sudo dmesg` / `journalctl -k` would show it)",
        )
    if re.search(rf"Killed process {pid}\b", text):
        return replace(ex, message=f"the kernel's OOM killer killed the trainer (pid {pid}): host RAM ran out")
    return replace(
        ex,
        kind=FailureKind.CRASH,
        message=ex.message + f": not the host's OOM killer (the kernel log shows no OOM kill of pid {pid}); "
        "another process or a person sent SIGKILL",
    )
