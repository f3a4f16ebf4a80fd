"""Exclusive flocks, the one implementation: the kernel drops a flock when its holder dies, so no lock
is ever stale. Held for a process's life (``try_flock``: an output_dir, a schedule run), taken over
from a parent (``flock_open``), or held for one read-modify-write (``held``)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def flock_open(f: IO[str]) -> bool:
    """Take the exclusive flock of an open file without waiting; False when another file holds it.

    The flock belongs to the open file: a child that inherited it re-locks it successfully."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def set_owner(f: IO[str], owner: str) -> None:
    """Write the holder's name into a lock file it holds (others read it to say who holds it)."""
    f.seek(0)
    f.truncate()
    f.write(owner)
    f.flush()


def try_flock(path: Path, owner: str) -> IO[str] | str:
    """Lock ``path`` and write ``owner`` into it. Returns the open file (keep it open to hold the
    lock), or, when another process holds it, the text that process wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    if not flock_open(f):
        f.seek(0)
        holder = f.read().strip()
        f.close()
        return holder
    set_owner(f, owner)
    return f


@contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold the exclusive flock of ``path`` for a with-block, waiting for it: for one read-modify-write
    of a shared file by several processes, never for a whole run."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
