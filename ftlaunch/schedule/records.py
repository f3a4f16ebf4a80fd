"""Schedule records: ``$FTLAUNCH_HOME/schedules/<name>.json``, one per schedule, and their history.

Values (pure): ``ScheduleRecord``, frozen and versioned, read by ``from_json`` and written by
``to_json`` as the JSON it always was; a record of another ``version`` is refused
(StateVersionError), so one a newer ftlaunch wrote is never overwritten, and keys this version does
not know are kept in ``extra`` and written back. ``HistoryEntry`` is one line of its history, with
``EntryStatus`` (a run's result, ``running`` while it lasts, or ``skipped``) and ``SkipReason``.

Shell: the registry paths, the schedule name rule, read / list / update under a lock (replaced
atomically), the lock that keeps two runs of one schedule apart, and the schedule's secret override
values (``schedules/secrets/<name>.json``, 0600; the record holds ``key=***``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import BusyError, ConfigError, FtlaunchError, RunNotFoundError, StateError, StateVersionError
from ftlaunch.files import JSON_LIMIT, home, home_folder, now_iso, read_user_bytes, write_json_atomic
from ftlaunch.locks import held, try_flock
from ftlaunch.run.options import RunOptions
from ftlaunch.schedule.cron import ScheduleError

SCHEDULE_VERSION = 1
HISTORY_MAX = 200
SECRETS_DIR = "secrets"  # schedules/secrets/<name>.json: secret override values, 0600
MASK = "***"  # a secret override's value as the record holds it
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class EntryStatus(StrEnum):
    """What one history entry says: the run's result (as ``ftlaunch.run`` names it), or a skip."""

    RUNNING = "running"  # the run started; replaced by its result when it ends
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    DIVERGED = "diverged"
    LOST = "lost"
    SKIPPED = "skipped"  # no run was made: see SkipReason

    @classmethod
    def of_run(cls, status: str) -> EntryStatus:
        """A finished run's status; one that is not an end (its supervisor did not record one) is
        ``running``, which ``schedule list`` checks against the run."""
        try:
            found = cls(status)
        except ValueError:
            return cls.RUNNING
        return cls.RUNNING if found is cls.SKIPPED else found


class SkipReason(StrEnum):
    OVERLAP = "overlap"  # the previous run of the schedule was still alive
    UNCHANGED = "unchanged"  # --only-if-changed: config and dataset files as at the last success


class Installed(StrEnum):
    CRONTAB = "crontab"  # a line in the user's crontab
    MANUAL = "manual"  # `add --print`: the user installs the line or the systemd units


def _enum_or_none(kind: type[StrEnum], value: Any) -> Any:
    return None if value is None else kind(value)


@dataclass(frozen=True)
class HistoryEntry:
    """One scheduled run (or skip) as the record's ``history`` and ``last`` hold it."""

    t: str  # when it started (a skip: when it was decided), ISO 8601
    status: EntryStatus
    run_id: str | None = None
    output_dir: str | None = None
    duration_s: float | None = None
    final_loss: float | None = None
    exit_code: int | None = None
    message: str | None = None
    reason: SkipReason | None = None
    notify_error: str | None = None
    pruned: bool = False  # its version dir was deleted by --keep
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", EntryStatus(self.status))
        object.__setattr__(self, "reason", _enum_or_none(SkipReason, self.reason))

    @classmethod
    def skip(cls, reason: SkipReason, message: str) -> HistoryEntry:
        return cls(t=now_iso(), status=EntryStatus.SKIPPED, reason=reason, message=message)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HistoryEntry:
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        values["pruned"] = bool(values.get("pruned"))
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t, "status": self.status.value}
        if self.status is not EntryStatus.SKIPPED:  # a run's entry names all of these, null or not
            out.update(
                run_id=self.run_id,
                output_dir=self.output_dir,
                duration_s=self.duration_s,
                final_loss=self.final_loss,
                exit_code=self.exit_code,
            )
        for key, value in (("reason", self.reason), ("message", self.message), ("notify_error", self.notify_error)):
            if value is not None:
                out[key] = value.value if isinstance(value, StrEnum) else value
        if self.pruned:
            out["pruned"] = True
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}


_RUN_KEYS = RunOptions.keys()  # stored flat in the record, as `train` takes them


@dataclass(frozen=True)
class ScheduleRecord:
    """A schedule as ``schedule add`` registered it, and what its runs came to."""

    name: str
    cron: str
    config: str  # absolute
    cwd: str | None = None
    overrides: tuple[str, ...] = ()
    keep: int | None = None
    only_if_changed: bool = False
    notify: str | None = None
    # The supervisor's notifications for each run (as `train --notify-cmd/--notify-on`); None: not given.
    notify_cmd: str | None = None
    notify_on: tuple[str, ...] | None = None
    run: RunOptions = RunOptions()  # everything `train` takes: scheduled runs are the same runs
    output_dir: str | None = None  # the config's own; each run trains into <output_dir>/<name>-<UTC time>
    installed: Installed | None = None
    command: str | None = None  # the crontab line
    created: str | None = None
    history: tuple[HistoryEntry, ...] = ()
    last: HistoryEntry | None = None
    latest: str | None = None  # the version dir <output_dir>/latest points at
    last_success_hash: str | None = None  # --only-if-changed: the content hash of the last success
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", tuple(self.overrides))
        object.__setattr__(self, "installed", _enum_or_none(Installed, self.installed))
        object.__setattr__(self, "history", tuple(self.history))
        if self.notify_on is not None:
            object.__setattr__(self, "notify_on", tuple(self.notify_on))

    @classmethod
    def from_json(cls, data: Any, where: str) -> ScheduleRecord:
        """Read a record object. Refuses (StateVersionError) a version it does not know, and
        (StateError) values it cannot read."""
        if not isinstance(data, Mapping) or data.get("version") != SCHEDULE_VERSION:
            raise StateVersionError(f"{where} has an unknown version", hint="re-add the schedule")
        known = {f.name for f in fields(cls)} - {"extra", "run"}
        values = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known | _RUN_KEYS | {"version"}}
        try:
            values["history"] = tuple(HistoryEntry.from_json(h) for h in values.get("history") or ())
            if values.get("last") is not None:
                values["last"] = HistoryEntry.from_json(values["last"])
            run = RunOptions.from_dict({k: v for k, v in data.items() if k in _RUN_KEYS})
            return cls(**values, run=run, extra=extra)
        except (TypeError, ValueError, AttributeError) as exc:
            raise StateError(f"{where} holds a value this ftlaunch cannot read ({exc})") from None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": SCHEDULE_VERSION,
            "name": self.name,
            "cron": self.cron,
            "config": self.config,
            "overrides": list(self.overrides),
            "cwd": self.cwd,
            "keep": self.keep,
            "only_if_changed": self.only_if_changed,
            "notify": self.notify,
            **self.run.to_dict(),
            "output_dir": self.output_dir,
        }
        optional = {
            "installed": self.installed.value if self.installed else None,
            "command": self.command,
            "created": self.created,
            "notify_cmd": self.notify_cmd,
            "notify_on": list(self.notify_on) if self.notify_on is not None else None,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        out["history"] = [h.to_json() for h in self.history]
        if self.last is not None:
            out["last"] = self.last.to_json()
        out.update({k: v for k, v in (("latest", self.latest), ("last_success_hash", self.last_success_hash)) if v})
        return {**out, **{k: v for k, v in self.extra.items() if k not in out}}

    def changed(self, **changes: Any) -> ScheduleRecord:
        return replace(self, **changes)

    def run_options(self) -> RunOptions:
        """The run options it was added with; the run is named after the schedule unless --name said."""
        return replace(self.run, run_name=self.run.run_name or self.name)

    def plan_request(self, output_dir: str, secrets: Mapping[str, str] | None = None) -> Any:
        """What a run plans: the config, its overrides (secret ones with their values from
        ``secrets``, the schedule's secrets file), and output_dir set to ``output_dir``."""
        # JSON is valid YAML: the path stays one string whatever characters it holds.
        over = (*self.unmasked_overrides(secrets or {}), f"output_dir={json.dumps(output_dir)}")
        return self.run_options().plan_request(self.config, over, strict=True, cwd=self.cwd)

    def unmasked_overrides(self, secrets: Mapping[str, str]) -> tuple[str, ...]:
        """The overrides as given to `schedule add`: each ``key=***`` with its value from ``secrets``.
        Raises ConfigError when a secret's value is gone (the secrets file was removed)."""
        from ftlaunch.plan.config import secret_override

        out = []
        for item in self.overrides:
            found = secret_override(item)
            if found and found[1] == MASK:
                if found[0] not in secrets:
                    raise ConfigError(
                        f"schedule {self.name}: the value of {found[0]} is not in {SECRETS_DIR}/{self.name}.json",
                        hint=f"`ftlaunch schedule remove {self.name}`, then add it again with {found[0]}=...",
                    )
                item = f"{item.partition('=')[0]}={secrets[found[0]]}"
            out.append(item)
        return tuple(out)

    # ---- history (pure): each returns the record with the change

    def with_entry(self, entry: HistoryEntry) -> ScheduleRecord:
        return replace(self, history=(*self.history, entry), last=entry)

    def with_result(self, run_id: str, entry: HistoryEntry) -> ScheduleRecord:
        """``entry`` in place of the run's ``running`` entry (appended if that is gone)."""
        hist = list(self.history)
        i = next((i for i, h in enumerate(hist) if h.run_id == run_id), None)
        if i is None:
            hist.append(entry)
        else:
            hist[i] = entry
        return replace(self, history=tuple(hist), last=entry)

    def annotated(self, run_id: str, notify_error: str | None, pruned: Collection[str]) -> ScheduleRecord:
        """The run's notification error, and the versions ``--keep`` deleted, marked in the history."""

        def mark(h: HistoryEntry) -> HistoryEntry:
            if h.run_id == run_id and notify_error:
                h = replace(h, notify_error=notify_error)
            if h.output_dir in pruned:
                h = replace(h, pruned=True)
            return h

        last = self.last
        if notify_error and last is not None and last.run_id == run_id:
            last = replace(last, notify_error=notify_error)
        return replace(self, history=tuple(mark(h) for h in self.history), last=last)


@dataclass(frozen=True)
class Unreadable:
    """A record file that could not be read, as `schedule list` shows it."""

    name: str
    message: str


# ---------------------------------------------------------------- registry (shell)


def schedules_dir(env: Mapping[str, str]) -> Path:
    return home_folder(env, "schedules")  # StateError (exit 12) when FTLAUNCH_HOME is a file


def record_path(env: Mapping[str, str], name: str) -> Path:
    return schedules_dir(env) / f"{name}.json"


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise ScheduleError(
            f"schedule name {name!r} is not allowed",
            hint="letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64",
        )


def read_record(env: Mapping[str, str], name: str) -> ScheduleRecord:
    check_name(name)
    path = record_path(env, name)
    try:
        data = json.loads(read_user_bytes(path, limit=JSON_LIMIT, what=f"schedule {name}: {path}", error=StateError))
    except FileNotFoundError:
        raise RunNotFoundError(f"no schedule {name!r}", hint="`ftlaunch schedule list` shows them") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"schedule {name}: {path} is unreadable ({exc})") from None
    return ScheduleRecord.from_json(data, f"schedule {name}: {path}")


def secrets_path(env: Mapping[str, str], name: str) -> Path:
    """The schedule's secret override values, 0600 (a folder apart: records are the ``*.json`` beside)."""
    return schedules_dir(env) / SECRETS_DIR / f"{name}.json"


def write_schedule_secrets(env: Mapping[str, str], name: str, secrets: Mapping[str, str]) -> None:
    """Secret overrides (key -> value as given), readable by this user only: mkstemp creates 0600."""
    if secrets:
        write_json_atomic(secrets_path(env, name), dict(secrets))


def read_schedule_secrets(env: Mapping[str, str], name: str) -> dict[str, str]:
    path = secrets_path(env, name)
    try:
        data = json.loads(read_user_bytes(path, limit=JSON_LIMIT, what=f"schedule {name}: {path}", error=StateError))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StateError(f"schedule {name}: {secrets_path(env, name)} is unreadable ({exc})") from None
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def write_record(env: Mapping[str, str], rec: ScheduleRecord) -> None:
    """Replace the record atomically (mode 0600: a webhook's URL is often its secret)."""
    write_json_atomic(record_path(env, rec.name), rec.to_json())


def list_records(env: Mapping[str, str]) -> list[ScheduleRecord | Unreadable]:
    d = schedules_dir(env)
    if not d.is_dir():
        return []
    out: list[ScheduleRecord | Unreadable] = []
    for path in sorted(d.glob("*.json")):
        try:
            out.append(read_record(env, path.stem))
        except FtlaunchError as exc:
            out.append(Unreadable(path.stem, exc.message))
    return out


@contextmanager
def locked(env: Mapping[str, str], what: str) -> Iterator[None]:
    """Serialise read-modify-write of one shared file (a record, the crontab) between processes.

    Waits for the lock: these are held for one read and one write, never for a run.
    """
    path = home(env) / "locks" / f"{what}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with held(path):
        yield


def update_record(
    env: Mapping[str, str], name: str, change: Callable[[ScheduleRecord], ScheduleRecord]
) -> ScheduleRecord | None:
    """Apply ``change`` to the record under a lock; None if the schedule was removed meanwhile.

    A record of an unknown version is refused (read_record raises) and so never overwritten.
    """
    with locked(env, f"schedule-{name}.json"):
        try:
            rec = read_record(env, name)
        except RunNotFoundError:
            return None
        new = change(rec)
        new = new.changed(history=new.history[-HISTORY_MAX:])
        write_record(env, new)
        return new


def record_entry(env: Mapping[str, str], name: str, entry: HistoryEntry) -> None:
    """Append ``entry`` to the schedule's history; it becomes ``last``."""
    update_record(env, name, lambda rec: rec.with_entry(entry))


def acquire_run_lock(env: Mapping[str, str], name: str) -> IO[str]:
    """A non-blocking flock held for the whole `schedule run`; the kernel drops it when we die."""
    got = try_flock(home(env) / "locks" / f"schedule-{name}.lock", f"pid {os.getpid()}")
    if isinstance(got, str):
        raise BusyError(
            f"schedule {name} is already running ({got or 'another process'}); skipped this run",
            hint="the next scheduled time will run it; `ftlaunch runs` shows the live run",
        )
    return got
