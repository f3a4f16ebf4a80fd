"""Following a run's log to its end, and the exit code a run's status maps to.

`status`, `train --follow`, `logs -f` and `resume` share both: a command that follows a run to its
end exits as `status` would (0 succeeded, 11 still running, 1 failed or stopped, 14 diverged).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import BinaryIO

from ftlaunch.cli.render import err_console

# Re-attaching to a live run shows the recent past, not the whole log.
FOLLOW_TAIL_LINES = 20


def follow_and_exit(run_dir: Path, tail_lines: int | None = None) -> None:
    """Follow to the end, then exit like `status`: 0 succeeded, 1 failed/stopped, 11 still running."""
    from ftlaunch.run.view import run_view

    follow_log(run_dir, tail_lines=tail_lines)
    sys.exit(run_view(run_dir).status.exit_code())


def tail_offset(f: BinaryIO, lines: int, block: int = 8192) -> int:
    """Byte offset where the last `lines` lines of the open binary file `f` start."""
    end = f.seek(0, 2)
    pos, data = end, b""
    while pos > 0 and data.count(b"\n") <= lines:
        pos = max(0, pos - block)
        f.seek(pos)
        data = f.read(end - pos)
    cut = data.split(b"\n")
    keep = b"\n".join(cut[-(lines + 1) :]) if len(cut) > lines + 1 else data
    return end - len(keep)


def follow_log(run_dir: Path, tail_lines: int | None = None, poll: float = 0.3) -> None:
    """Print the log (all of it, or its last `tail_lines` lines), then follow until the run ends."""
    from ftlaunch.run.store import RunFolder
    from ftlaunch.run.view import run_view

    path = RunFolder(run_dir).train_log
    try:
        with open(path, "rb") as f:
            f.seek(0 if tail_lines is None else tail_offset(f, tail_lines))
            quiet_since: float | None = None
            while True:
                chunk = f.read()
                if chunk:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                    quiet_since = None
                    continue
                status = run_view(run_dir).status
                if status.is_terminal():
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 1.0:
                        return
                time.sleep(poll)
    except KeyboardInterrupt:
        err_console.print("\n(stopped following; the run goes on)")
