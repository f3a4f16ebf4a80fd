"""The ground's file helpers: where ftlaunch keeps its state (``home``), UTC time stamps, strict
JSON text, atomic writes (a temp file in the same folder, then ``os.replace``: readers see the
old file or the new one, never half of one), and bounded reads of files a user gave or could have
placed (``read_user_bytes``: a regular file of at most a stated size, or the caller's error).
Imports only ftlaunch.errors.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ftlaunch.errors import StateError


def home(env: Mapping[str, str]) -> Path:
    """FTLAUNCH_HOME, else the XDG state dir (~/.local/state/ftlaunch)."""
    if env.get("FTLAUNCH_HOME"):
        return Path(env["FTLAUNCH_HOME"]).expanduser()
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "~")) / ".local" / "state")
    return Path(base).expanduser() / "ftlaunch"


def file_in_the_way(folder: Path) -> Path | None:
    """``folder`` or the nearest folder above it that exists, when that is not a directory (a file
    where a folder should be: nothing can be made under it), else None. An unreadable one is None:
    the read or write that follows says what is wrong."""
    found = folder
    while True:
        try:
            mode = os.stat(found).st_mode
        except (FileNotFoundError, NotADirectoryError):
            if found.parent == found:
                return None
            found = found.parent
            continue
        except OSError:
            return None
        return None if stat.S_ISDIR(mode) else found


def home_folder(env: Mapping[str, str], *parts: str) -> Path:
    """``home(env) / parts``, a folder that is there or can be made: StateError (exit 12) when it, or
    a folder above it, is a file. Readers call it too, so a misplaced FTLAUNCH_HOME is an error
    naming it, never an empty listing ("0 runs") or "no runs"."""
    root = home(env)
    path = root.joinpath(*parts)
    found = file_in_the_way(path)
    if found is None:
        return path
    label = f"FTLAUNCH_HOME={root}" if env.get("FTLAUNCH_HOME") else f"ftlaunch's state folder {root}"
    if found == root:
        what = f"{label} is a file, not a directory"
    elif found in root.parents:
        what = f"{label} cannot be made: {found} is a file, not a directory"
    else:
        what = f"{label}: {found} is a file, not the directory ftlaunch keeps there"
    raise StateError(
        f"{what}; ftlaunch keeps its runs and schedules in a directory",
        hint=f"set FTLAUNCH_HOME to a directory (made if missing), or move {found} away",
    )


def now_iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat(timespec="milliseconds")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that readers see the old or the new file, never half of one."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """The one atomic write: a temp file in the same folder (made 0600 by mkstemp), flushed to disk,
    then ``os.replace``: readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def reserve_file(path: Path, text: str, size: int) -> None:
    """Write ``text`` padded with spaces to ``size`` bytes: the blocks are then the file's, so
    ``overwrite_reserved`` can still write there when the filesystem is full (a JSON text parses with
    the padding)."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data + b" " * max(0, size - len(data)))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def overwrite_reserved(path: Path, text: str) -> None:
    """Write ``text`` over a file made by ``reserve_file``, in place and padded to its size: no block is
    added, so it works on a full filesystem. OSError when it does not fit or the file is gone."""
    fd = os.open(path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        data = text.encode()
        if len(data) > size:
            raise OSError(errno.EFBIG, f"{len(data)} bytes do not fit the {size} reserved", str(path))
        os.pwrite(fd, data + b" " * (size - len(data)), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def json_safe(obj: Any) -> Any:
    """Strict JSON for machines: a non-finite float (a NaN loss) becomes the string "nan"/"inf"/"-inf",
    never a bare NaN token that strict parsers (jq, JSON.parse) reject."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def to_json(obj: Any) -> str:
    """What every --json and every JSON file of a run prints: indented, strict (see json_safe)."""
    return json.dumps(json_safe(obj), indent=2, default=str, allow_nan=False)


def tree_bytes(path: Path) -> int:
    """Apparent size of the files under ``path`` (what ``du -sb`` counts, less the folders); files
    that vanish meanwhile (a checkpoint rotated away) count 0."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# ---------------------------------------------------------------- bounded reads of what a user gave

MiB = 1024 * 1024
# The most ftlaunch reads of each file a user gives or could have placed (docs/limits.md keeps this
# table, with why): each is a hundred times what a real one holds or more, and small enough that a
# wrong one (a device, a log, a dataset named by mistake) is refused at once instead of filling memory
# or parsing for minutes (YAML: ~1 s per MiB with libyaml, ~4 s per MiB in pure Python, on one core).
CONFIG_LIMIT = 1 * MiB  # the training config, YAML or JSON (a real one: 1-5 KB)
JSON_LIMIT = 8 * MiB  # DeepSpeed JSONs, --model-config, config.json, dataset_info.json, a run's state files
HARDWARE_LIMIT = 1 * MiB  # --hardware FILE (`ftlaunch env --json` writes a few KB)
NOTIFY_LIMIT = 256 * 1024  # $FTLAUNCH_HOME/notify.yaml (pure-Python YAML; a real one: < 1 KB)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int | None) -> str | None:
    """What a file that is not a regular one is ("a FIFO (named pipe)"), None for a regular file or
    none at all (``mode`` None); read by the user-file reader here and the output writer (outfile)."""
    if mode is None or stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def _size_text(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:.3g} MiB"
    return f"{n / 1024:.3g} KiB" if n >= 1024 else f"{n} bytes"


def read_user_bytes(
    path: str | Path, *, limit: int, what: str, error: Callable[[str, str], Exception], hint: str | None = None
) -> bytes:
    """The bytes of ``path``, a regular file (symlinks followed) of at most ``limit`` bytes; else
    ``error(message, hint)``, the caller's own error (so each keeps its exit code). ``what`` names the
    file in the message ("hardware file /x/hw.json"); ``hint`` says what the file should be.

    A FIFO, a device (/dev/zero), a directory or a socket is refused before it is read, and opened
    with O_NONBLOCK so that a FIFO swapped in meanwhile never blocks; the size is checked from stat
    and again by reading at most ``limit + 1`` bytes (/proc files say 0). FileNotFoundError and
    NotADirectoryError pass through: callers tell a missing file apart (often it is no error)."""
    limit_text = _size_text(limit)
    advice = hint or f"point it at a regular file of at most {limit_text}"

    def refuse(message: str) -> Exception:
        return error(message, advice)

    try:
        kind = file_kind(os.stat(path).st_mode)  # before opening: opening a device can itself act
        if kind is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                kind = file_kind(st.st_mode)
                data = b"" if kind or st.st_size > limit else _read_at_most(fd, limit + 1)
            finally:
                os.close(fd)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:
        raise refuse(f"{what} cannot be read: {exc.strerror or exc}") from None
    if kind is not None:
        raise refuse(f"{what} is {kind}, not a regular file; ftlaunch reads only regular files")
    if st.st_size > limit:
        raise refuse(f"{what} is {_size_text(st.st_size)}, over the {limit_text} ftlaunch reads of it")
    if len(data) > limit:
        raise refuse(f"{what} holds more than {limit_text}, the most ftlaunch reads of it")
    return data


def value_error(message: str, hint: str) -> ValueError:
    """``error`` for a reader that takes an unreadable file as absent or as "cannot tell" (it catches
    ValueError, as it does for a file that does not parse)."""
    return ValueError(f"{message} ({hint})")


def _read_at_most(fd: int, n: int) -> bytes:
    chunks: list[bytes] = []
    while n > 0:
        chunk = os.read(fd, min(n, MiB))
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_user_text(
    path: str | Path, *, limit: int, what: str, error: Callable[[str, str], Exception], hint: str | None = None
) -> str:
    """``read_user_bytes`` as UTF-8 text; text that is not UTF-8 is ``error`` too, naming the byte."""
    data = read_user_bytes(path, limit=limit, what=what, error=error, hint=hint)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1].hex()
        raise error(
            f"{what} is not UTF-8 text: byte 0x{bad} at offset {exc.start} cannot be decoded",
            "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)",
        ) from None
