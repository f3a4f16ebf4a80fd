"""Writing a file the user named (``bundle -o PATH``): what PATH is decides how, and nothing there is
ever replaced by something it was not, nor left half-written.

- ``-`` streams to standard output.
- A symlink is followed: what it points to is written (the link stays a link).
- A regular file, or nothing yet, is written atomically: a temp file in the same folder (folders made
  as needed), then ``os.replace``; on any error the temp file is removed and PATH is as it was.
- Another existing non-regular file (a FIFO, a character device such as /dev/null or a terminal) is
  written through: opened and written, never replaced. A block device is refused (as root, ``-o
  /dev/sda`` would write over a disk), as is a socket.

Every OS error becomes one line naming PATH: ``DiskFullError`` (exit 17) when the filesystem is full,
``OutputError`` (exit 20) otherwise. Imports only the ground (errors, files).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ftlaunch.errors import DiskFullError, FtlaunchError, OutputError
from ftlaunch.files import file_in_the_way, file_kind

STDOUT = "-"
HINT = "choose another -o: a folder you can write with room, or -o - to stream it to stdout"
FULL = (errno.ENOSPC, errno.EDQUOT)

Produce = Callable[[BinaryIO], None]


@dataclass(frozen=True)
class Written:
    """Where ``write_out`` wrote (the path as given, or "stdout"), how many bytes, and how."""

    where: str
    size: int
    how: str  # "replaced", "created", "through a FIFO", "through a character device", "streamed"


class _Counter:
    """A write-only file that counts what went through it (tarfile's stream mode needs write only),
    over ``write_some`` (``os.write`` on a descriptor: unbuffered, so an error is raised by the write
    that met it, never again by a flush at close)."""

    def __init__(self, write_some: Callable[[memoryview], int | None]) -> None:
        self.write_some = write_some
        self.size = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            n = self.write_some(view)
            n = len(view) if n is None else n
            view = view[n:]
            self.size += n
        return len(data)


def write_out(target: str, produce: Produce, stdout: BinaryIO | None = None) -> Written:
    """Call ``produce`` with a binary file that ends up at ``target`` (see the module's rules)."""
    if not target:
        raise OutputError("no output path given (an empty -o)", hint=HINT)
    if target == STDOUT:
        out = stdout if stdout is not None else sys.stdout.buffer
        return Written("stdout", _stream(out, produce), "streamed")
    path = Path(target)
    try:
        mode = os.stat(path).st_mode  # follows a symlink: its target decides
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as exc:
        raise cannot_write(target, exc) from None
    kind = file_kind(mode)
    if kind in ("a directory", "a block device", "a socket"):
        raise OutputError(f"cannot write {target}: it is {kind}; only a file, a FIFO or a character device", hint=HINT)
    if kind is not None:
        return Written(target, _write_through(path, produce, target), f"through {kind}")
    real = Path(os.path.realpath(path))
    size = _replace(real, produce, target)
    return Written(target, size, "replaced" if mode is not None else "created")


def _through(write_some: Callable[[memoryview], int | None], produce: Produce, label: str) -> int:
    counter = _Counter(write_some)
    try:
        produce(counter)  # type: ignore[arg-type]
    except OSError as exc:
        raise cannot_write(label, exc, counter.size) from None
    return counter.size


def _stream(f: BinaryIO, produce: Produce) -> int:
    """To stdout: what its buffer holds goes first, then the archive straight to its descriptor
    (a stream with none, as a test's, takes the writes itself)."""
    try:
        f.flush()
        fd = f.fileno()
    except (AttributeError, ValueError, OSError):
        return _through(f.write, produce, "stdout")
    return _through(lambda b: os.write(fd, b), produce, "stdout")


def _write_through(path: Path, produce: Produce, label: str) -> int:
    """Open an existing FIFO or device for writing (never created, never truncated) and write."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise cannot_write(label, exc) from None
    try:
        return _through(lambda b: os.write(fd, b), produce, label)
    finally:
        os.close(fd)


def _replace(real: Path, produce: Produce, label: str) -> int:
    """A temp file beside ``real``, written whole and synced, then renamed over it."""
    tmp = real.with_name(f".{real.name}.{os.getpid()}.tmp")
    counter = None
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            counter = _Counter(lambda b: os.write(fd, b))
            produce(counter)  # type: ignore[arg-type]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, real)
    except BaseException as exc:
        _unlink(tmp)
        if isinstance(exc, OSError):
            raise cannot_write(label, exc, counter.size if counter else 0, removed=True) from None
        raise
    return counter.size


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # the folder went away or turned read-only: nothing of ours is left to remove


def cannot_write(label: str, exc: OSError, written: int = 0, removed: bool = False) -> FtlaunchError:
    """One line naming the path and what the OS said; exit 17 for a full filesystem, else 20.
    ``removed``: a partial temp file was removed (PATH is as it was)."""
    why = (exc.strerror or str(exc)).lower()
    if exc.errno in FULL:
        left = f"; {label} is as it was" if removed else ""
        return DiskFullError(f"cannot write {label}: its filesystem is full after {written:,} bytes{left}", hint=HINT)
    if exc.errno in (errno.EEXIST, errno.ENOTDIR) and (blocker := file_in_the_way(Path(label).parent)):
        why = f"{blocker} is a file, not a folder"
    elif exc.errno == errno.EPIPE:
        return OutputError(
            f"cannot write {label}: its reader went away before the end (broken pipe)",
            hint="pipe it to a command that reads it whole, or write a file with -o PATH",
        )
    elif exc.errno == errno.EROFS:
        why = "its filesystem is read-only"
    elif exc.errno == errno.ENOENT and Path(label).parent.is_dir():
        why = f"its folder {Path(label).parent} takes no new files (no such file or directory)"
    return OutputError(f"cannot write {label}: {why}", hint=HINT)
