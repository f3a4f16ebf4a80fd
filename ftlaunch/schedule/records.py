"""Schedule records on disk: ``$FTLAUNCH_HOME/schedules/<name>.json`` (replaced atomically), the
schedule name rule, read / list / update under a lock, and the lock that keeps two runs of one
schedule apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import BusyError, FtlaunchError, RunNotFoundError, StateError
from ftlaunch.files import home, write_json_atomic
from ftlaunch.locks import try_flock
from ftlaunch.schedule.cron import ScheduleError

SCHEDULE_VERSION = 1


HISTORY_MAX = 200


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def schedules_dir(env: Mapping[str, str]) -> Path:
    return home(env) / "schedules"


def record_path(env: Mapping[str, str], name: str) -> Path:
    return schedules_dir(env) / f"{name}.json"


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise ScheduleError(
            f"schedule name {name!r} is not allowed",
            hint="letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64",
        )


def read_record(env: Mapping[str, str], name: str) -> dict[str, Any]:
    check_name(name)
    path = record_path(env, name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunNotFoundError(f"no schedule {name!r}", hint="`ftlaunch schedule list` shows them") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise StateError(f"schedule {name}: {path} is unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != SCHEDULE_VERSION:
        raise StateError(f"schedule {name}: {path} has an unknown version", hint="re-add the schedule")
    return data


def list_records(env: Mapping[str, str]) -> list[dict[str, Any]]:
    d = schedules_dir(env)
    if not d.is_dir():
        return []
    out = []
    for path in sorted(d.glob("*.json")):
        try:
            out.append(read_record(env, path.stem))
        except FtlaunchError as exc:
            out.append({"name": path.stem, "unreadable": exc.message})
    return out


@contextmanager
def locked(env: Mapping[str, str], what: str) -> Iterator[None]:
    """Serialise read-modify-write of one shared file (a record, the crontab) between processes."""
    path = home(env) / "locks" / f"{what}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def update_record(env: Mapping[str, str], name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """Apply ``change`` to the record under a lock; None if the schedule was removed meanwhile."""
    with locked(env, f"schedule-{name}.json"):
        try:
            data = read_record(env, name)
        except RunNotFoundError:
            return None
        change(data)
        data["history"] = data.get("history", [])[-HISTORY_MAX:]
        write_json_atomic(record_path(env, name), data)
        return data


def acquire_run_lock(env: Mapping[str, str], name: str) -> IO[str]:
    """A non-blocking flock held for the whole `schedule run`; the kernel drops it when we die."""
    got = try_flock(home(env) / "locks" / f"schedule-{name}.lock", f"pid {os.getpid()}")
    if isinstance(got, str):
        raise BusyError(
            f"schedule {name} is already running ({got or 'another process'}); skipped this run",
            hint="the next scheduled time will run it; `ftlaunch runs` shows the live run",
        )
    return got
