"""Why an attempt ended, with what only the world shows: the pure ``recovery.why_it_ended`` over the
AttemptEnd, then, for an ENOSPC (or the check before a save), the failed save's partial folder removed,
and for a bare SIGKILL, the kernel log asked whether the host's OOM killer sent it (issue 11)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftlaunch.run import progress as prog
from ftlaunch.run.disk import enospc_line
from ftlaunch.run.journal import RunJournal
from ftlaunch.run.recovery import AttemptEnd, Exit, why_it_ended
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
    return ex


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
