"""Exclusive, non-blocking flocks held for a process's life: the kernel drops them when it dies."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO


def try_flock(path: Path, owner: str) -> IO[str] | str:
    """Lock ``path`` and write ``owner`` into it. Returns the open file (keep it open to hold the
    lock), or, when another process holds it, the text that process wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        return holder
    f.seek(0)
    f.truncate()
    f.write(owner)
    f.flush()
    return f
