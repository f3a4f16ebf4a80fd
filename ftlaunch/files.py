"""The ground's file helpers: where ftlaunch keeps its state (``home``), UTC time stamps, strict
JSON text, and atomic writes (a temp file in the same folder, then ``os.replace``: readers see the
old file or the new one, never half of one). Imports only ftlaunch.errors.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Mapping
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
