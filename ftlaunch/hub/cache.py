"""The hub cache's hygiene: stale lock files of dead processes, orphaned partial files."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import BusyError

log = logging.getLogger(__name__)


def lock_is_held(path: Path) -> bool:
    """True if some process holds the flock on ``path`` (how huggingface_hub's filelock locks).

    A lock file whose flock can be taken without blocking is not held by anyone: its owner died or finished.
    Where flock cannot be probed (no fcntl, or a filesystem without flock), report "held" to stay on the safe
    side; filelock's soft-lock fallback recovers stale locks of dead processes by itself there.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _remove_if_free(path: Path) -> bool:
    """Unlink ``path`` while holding its flock, so a process that is just taking it is never raced."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        # filelock (4.x) re-checks the inode after acquiring, so unlinking under our flock is safe for waiters.
        try:
            path.unlink()
        except OSError:
            return False
        return True
    finally:
        os.close(fd)  # releases the flock


def clear_stale_locks(cache_dir: Path, *, is_alive: Callable[[Path], bool] = lock_is_held) -> list[Path]:
    """Remove ``.locks/**/*.lock`` files in the hub cache whose holder is gone; return the removed paths.

    ``is_alive(lock_path)`` says whether the lock is held by a live process; by default its flock is probed
    (and the removal itself happens under that flock).
    """
    locks_dir = Path(cache_dir) / ".locks"
    if not locks_dir.is_dir():
        return []
    removed: list[Path] = []
    for lock in sorted(locks_dir.rglob("*.lock")):
        if is_alive is lock_is_held:
            if _remove_if_free(lock):
                removed.append(lock)
        elif not is_alive(lock):
            try:
                lock.unlink()
                removed.append(lock)
            except OSError:
                pass
    if removed:
        log.info("removed %d stale lock file(s) under %s", len(removed), locks_dir)
    return removed


def _wait_for_locks(
    lock_dir: Path, repo_id: str, *, timeout: float, is_alive: Callable[[Path], bool], sleep: Callable[[float], None]
) -> None:
    """Wait until no live process holds a lock of this repo; BusyError after ``timeout`` seconds.

    huggingface_hub itself would wait forever on such a lock, without a word. Time is counted from the requested
    sleeps (not the clock) so tests with an instant ``sleep`` stay deterministic.
    """
    interval = 0.5
    waited = 0.0
    announced = False
    while True:
        held = [p for p in sorted(lock_dir.glob("*.lock")) if is_alive(p)] if lock_dir.is_dir() else []
        if not held:
            return
        if waited >= timeout:
            raise BusyError(
                f"another process is downloading {repo_id} into this cache (it holds {held[0]}); waited {waited:g}s",
                hint="wait for the other download to finish and run again, or use a different cache_dir",
            )
        if not announced:
            log.warning("another process holds a download lock of %s; waiting up to %gs", repo_id, timeout)
            announced = True
        sleep(interval)
        waited += interval


_UNIQUE_PARTIAL = re.compile(r"^(?P<etag>[^.]+)\.[0-9a-f]{8}\.incomplete$")
_LEGACY_PARTIAL = re.compile(r"^(?P<etag>[^.]+)\.incomplete$")


def _sweep_partials(storage: Path, lock_dir: Path, is_alive: Callable[[Path], bool]) -> list[Path]:
    """Remove ``blobs/*.incomplete`` files that nobody is writing and nobody can resume.

    huggingface_hub 1.x names its temp files ``<etag>.<8 hex>.incomplete``, unique per download, and never reads
    one back: any such file whose lock is free was left by a killed process. Older versions resume from
    ``<etag>.incomplete``, so that name is only removed once the finished blob exists.
    """
    blobs = storage / "blobs"
    if not blobs.is_dir():
        return []
    removed: list[Path] = []
    for partial in sorted(blobs.glob("*.incomplete")):
        m = _UNIQUE_PARTIAL.match(partial.name) or _LEGACY_PARTIAL.match(partial.name)
        if m is None:
            continue
        etag = m.group("etag")
        if is_alive(lock_dir / f"{etag}.lock"):
            continue  # a live download is writing it
        unique = _UNIQUE_PARTIAL.match(partial.name) is not None
        if unique or (blobs / etag).exists():
            try:
                partial.unlink()
                removed.append(partial)
            except OSError:  # gone already, or a read-only shared cache: leave it
                pass
    return removed
