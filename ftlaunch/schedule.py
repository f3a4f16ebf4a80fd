"""Scheduled, unattended retraining: ``ftlaunch schedule add|list|remove|run``.

Pure core (no files, no clock, no environment):
  cron expressions (``parse_cron``, ``next_fire``; a standard 5-field parser: no cron library is a
  dependency of ftlaunch), crontab text editing (``add_entry``, ``remove_entry``: one marked line,
  every other byte untouched), the cron line and systemd units, version naming, the prune choice.
Shells:
  the ``crontab`` executable (``-l`` / ``-``), the registry ``$FTLAUNCH_HOME/schedules/<name>.json``
  (replaced atomically), a non-blocking flock per schedule (``$FTLAUNCH_HOME/locks``), the content
  hash of config + dataset files, notifiers (HTTP POST or a command), and ``run_schedule``, which
  trains one version in the foreground under the Supervisor.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from .errors import BusyError, ConfigError, ExitCode, FtlaunchError, RunNotFoundError, StateError
from .launch import SECRET_ENV
from .locks import try_flock
from .runstore import home, now_iso, write_json_atomic

SCHEDULE_VERSION = 1
HISTORY_MAX = 200
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MARK = "ftlaunch-schedule:"
MARK_RE = re.compile(r"(?:^|\s)#\s?" + re.escape(MARK) + r"(?P<name>[A-Za-z0-9_.-]+)\s*$")
# Environment carried into the cron line: where state and caches live, which trainer and GPUs.
# An allowlist, so that no secret (HF_TOKEN, WANDB_API_KEY, ...) can ever reach the crontab.
CARRY_ENV = (
    "FTLAUNCH_HOME",
    "FTLAUNCH_LLAMAFACTORY_CLI",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "CUDA_VISIBLE_DEVICES",
)


class ScheduleError(FtlaunchError):
    """Bad input to `schedule`: a cron expression, a name, a duplicate. A usage error (2)."""

    exit_code = ExitCode.USAGE


class CrontabError(FtlaunchError):
    """The crontab executable is missing or refused the new table."""

    exit_code = ExitCode.FAILED


# ---------------------------------------------------------------- cron expressions (pure)


@dataclass(frozen=True)
class _Field:
    name: str
    lo: int
    hi: int
    names: Mapping[str, int] = field(default_factory=dict)


MONTHS = {m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())}
WEEKDAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}
FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day of month", 1, 31),
    _Field("month", 1, 12, MONTHS),
    _Field("day of week", 0, 7, WEEKDAYS),  # 0 and 7 are both Sunday
)
MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


@dataclass(frozen=True)
class Cron:
    """A parsed 5-field cron expression, with Vixie cron's day-of-month/day-of-week rule."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday .. 6 = Saturday
    days_star: bool  # the field starts with '*': then both day fields must match, else either
    weekdays_star: bool

    def day_matches(self, d: date) -> bool:
        dom = d.day in self.days
        dow = d.isoweekday() % 7 in self.weekdays
        if self.days_star or self.weekdays_star:
            return dom and dow
        return dom or dow


def _value(token: str, f: _Field, problems: list[str], item: str) -> int | None:
    if token.isdigit():
        v = int(token)
    elif token.lower() in f.names:
        v = f.names[token.lower()]
    else:
        problems.append(f"{f.name}: {item!r} is not a number{' or a name' if f.names else ''}")
        return None
    if not f.lo <= v <= f.hi:
        problems.append(f"{f.name}: {v} is out of range {f.lo}-{f.hi}")
        return None
    return v


def _parse_field(text: str, f: _Field, problems: list[str]) -> frozenset[int]:
    values: set[int] = set()
    for item in text.split(","):
        if not item:
            problems.append(f"{f.name}: empty item in {text!r}")
            continue
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) == 0:
                problems.append(f"{f.name}: step {step_text!r} in {item!r} must be a positive number")
                continue
            step = int(step_text)
        if base == "*":
            lo, hi = f.lo, f.hi
        elif "-" in base:
            a, _, b = base.partition("-")
            lo_v, hi_v = _value(a, f, problems, item), _value(b, f, problems, item)
            if lo_v is None or hi_v is None:
                continue
            if lo_v > hi_v:
                problems.append(f"{f.name}: range {item!r} runs backwards")
                continue
            lo, hi = lo_v, hi_v
        else:
            v = _value(base, f, problems, item)
            if v is None:
                continue
            lo, hi = v, (f.hi if slash else v)  # "5/15" means 5-max/15, as in cronie
        values.update(range(lo, hi + 1, step))
    if f.name == "day of week" and 7 in values:
        values = (values - {7}) | {0}
    return frozenset(values)


def parse_cron(text: str) -> Cron:
    """Parse a standard cron expression; raise ScheduleError listing every problem."""
    normal = " ".join(text.split())
    expanded = MACROS.get(normal.lower(), normal)
    if normal.lower() == "@reboot":
        raise ScheduleError("cron expression '@reboot' is not a time", hint='give a time, e.g. --cron "0 2 * * *"')
    if expanded.startswith("@"):
        raise ScheduleError(
            f"cron expression {text!r}: unknown macro", hint=f"macros: {', '.join(sorted(MACROS))}, or 5 fields"
        )
    parts = expanded.split()
    if len(parts) != 5:
        raise ScheduleError(
            f"cron expression {text!r} has {len(parts)} field(s), not 5",
            hint='minute hour day-of-month month day-of-week, e.g. "0 2 * * *" (every night at 02:00)',
        )
    problems: list[str] = []
    sets = [_parse_field(p, f, problems) for p, f in zip(parts, FIELDS, strict=True)]
    if problems:
        raise ScheduleError(
            f"cron expression {text!r}: " + "; ".join(problems),
            hint='minute hour day-of-month month day-of-week, e.g. "0 2 * * *" or "30 3 * * mon-fri"',
        )
    cron = Cron(normal, *sets, days_star=parts[2].startswith("*"), weekdays_star=parts[4].startswith("*"))
    if next_fire(cron, datetime(2000, 1, 1)) is None:
        raise ScheduleError(f"cron expression {text!r} never fires (no such date)", hint="check day and month")
    return cron


def next_fire(cron: Cron, after: datetime) -> datetime | None:
    """The first minute strictly after ``after`` that the expression matches (same tz as ``after``)."""
    t = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    limit = t + timedelta(days=366 * 8)  # covers 29 February on a given weekday
    while t < limit:
        if t.month not in cron.months:
            t = (t.replace(day=1, hour=0, minute=0) + timedelta(days=32)).replace(day=1)
        elif not cron.day_matches(t.date()):
            t = t.replace(hour=0, minute=0) + timedelta(days=1)
        elif t.hour not in cron.hours:
            t = t.replace(minute=0) + timedelta(hours=1)
        elif t.minute not in cron.minutes:
            t += timedelta(minutes=1)
        else:
            return t
    return None


# ---------------------------------------------------------------- crontab text (pure)


def _lines(text: str) -> list[str]:
    """Split keeping every byte: joining the result gives ``text`` back exactly."""
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def entry_name(line: str) -> str | None:
    """The schedule a crontab line belongs to, from its trailing marker; None for foreign lines."""
    if line.lstrip().startswith("#"):
        return None  # a comment (perhaps a disabled copy of ours) belongs to the user
    m = MARK_RE.search(line.rstrip("\n"))
    return m.group("name") if m else None


def entries(text: str) -> dict[str, str]:
    return {n: line for line in _lines(text) if (n := entry_name(line))}


def add_entry(text: str, name: str, line: str) -> str:
    """Append one marked line. A missing final newline is added first (cron needs it)."""
    if name in entries(text):
        raise ScheduleError(
            f"the crontab already has an entry for schedule {name!r}",
            hint=f"`ftlaunch schedule remove {name}` removes it",
        )
    if entry_name(line) != name or "\n" in line:
        raise ValueError("a schedule entry is one line ending with its marker")
    if text and not text.endswith("\n"):
        text += "\n"
    return text + line + "\n"


def remove_entry(text: str, name: str) -> tuple[str, int]:
    """Drop the lines marked for ``name``; every other line stays byte for byte."""
    kept, removed = [], 0
    for line in _lines(text):
        if entry_name(line) == name:
            removed += 1
        else:
            kept.append(line)
    return "".join(kept), removed


# ---------------------------------------------------------------- the command cron runs (pure)


def run_argv(name: str, python: str) -> list[str]:
    """The same Python environment, by absolute path (never resolved: a venv's python is a link)."""
    return [os.path.abspath(python), "-m", "ftlaunch.cli", "schedule", "run", name]


def carried_env(env: Mapping[str, str]) -> dict[str, str]:
    """What the cron line sets: an allowlist, minus anything that looks like a credential."""
    out = {}
    for key in CARRY_ENV:
        value = env.get(key)
        if value is None or "\n" in value:
            continue
        if "@" in urllib.parse.urlsplit(value).netloc:  # user:password@host
            continue
        out[key] = value
    return out


def log_path(env: Mapping[str, str], name: str) -> Path:
    return home(env) / "schedules" / f"{name}.log"


def cron_line(cron: Cron, name: str, argv: Sequence[str], env: Mapping[str, str], log: Path) -> str:
    """One crontab line: ``<when> K=V ... <argv> >> <log> 2>&1 # ftlaunch-schedule:<name>``."""
    words = [f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv]
    command = " ".join(words) + f" >> {shlex.quote(str(log))} 2>&1"
    command = command.replace("%", "\\%")  # cron turns a bare % into a newline
    return f"{cron.text} {command} # {MARK}{name}"


def check_no_secrets(text: str, env: Mapping[str, str]) -> None:
    for key in SECRET_ENV:
        value = env.get(key)
        if value and len(value) >= 4 and value in text:
            raise StateError(f"refusing to write {key} into a schedule entry", hint="this is a bug; please report it")


def _systemd_word(arg: str) -> str:
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not re.search(r"[\s\"'\\;]", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def on_calendar(cron: Cron) -> list[str]:
    """systemd OnCalendar= values for a cron expression (two when either day field may match)."""

    def part(values: frozenset[int], lo: int, hi: int) -> str:
        return "*" if values >= set(range(lo, hi + 1)) else ",".join(f"{v:02d}" for v in sorted(values))

    hm = f"{part(cron.hours, 0, 23)}:{part(cron.minutes, 0, 59)}:00"
    month = part(cron.months, 1, 12)
    days = part(cron.days, 1, 31)
    names = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"]
    weekdays = "" if cron.weekdays >= set(range(7)) else ",".join(names[d] for d in sorted(cron.weekdays)) + " "
    if cron.days_star or cron.weekdays_star or not weekdays or days == "*":
        return [f"{weekdays}*-{month}-{days} {hm}"]
    return [f"*-{month}-{days} {hm}", f"{weekdays}*-{month}-* {hm}"]  # cron: either day field matches


def systemd_units(cron: Cron, name: str, argv: Sequence[str], env: Mapping[str, str], log: Path) -> dict[str, str]:
    """A user service + timer pair doing what the cron line does; file name -> text."""
    envs = "".join(f"Environment={_systemd_word(f'{k}={v}')}\n" for k, v in env.items())
    log_s = str(log).replace("%", "%%")
    service = (
        f"[Unit]\nDescription=ftlaunch schedule {name}\n\n"
        f"[Service]\nType=oneshot\n{envs}"
        f"ExecStart={' '.join(_systemd_word(a) for a in argv)}\n"
        f"StandardOutput=append:{log_s}\nStandardError=append:{log_s}\n"
    )
    calendars = "".join(f"OnCalendar={c}\n" for c in on_calendar(cron))
    timer = (
        f"[Unit]\nDescription=ftlaunch schedule {name} ({cron.text})\n\n"
        f"[Timer]\n{calendars}Persistent=true\n\n"
        "[Install]\nWantedBy=timers.target\n"
    )
    return {f"ftlaunch-{name}.service": service, f"ftlaunch-{name}.timer": timer}


# ---------------------------------------------------------------- versions and pruning (pure)


def version_name(name: str, when: datetime, taken: Collection[str] = ()) -> str:
    """``<name>-<UTC timestamp>``, with ``-2``, ``-3`` ... when two runs start in the same second."""
    base = f"{name}-{when.astimezone(UTC):%Y%m%dT%H%M%SZ}"
    candidate, n = base, 2
    while candidate in taken:
        candidate, n = f"{base}-{n}", n + 1
    return candidate


def choose_prune(history: Sequence[Mapping[str, Any]], keep: int | None, latest: str | None) -> list[str]:
    """Version dirs to delete: successful ones older than the ``keep`` newest.

    Never the latest, never a run that did not succeed (its logs and checkpoints stay), never one
    that is not in the history (ftlaunch did not make it).
    """
    if not keep:
        return []
    done: list[str] = []
    for h in history:
        d = h.get("output_dir")
        if h.get("status") == "succeeded" and d and not h.get("pruned") and d not in done:
            done.append(d)
    spare = set(done[-keep:]) | ({latest} if latest else set())
    not_succeeded = {h.get("output_dir") for h in history if h.get("status") != "succeeded"}
    return [d for d in done if d not in spare and d not in not_succeeded]


def dataset_files(values: Mapping[str, Any], info: Mapping[str, Any]) -> tuple[list[str], list[Mapping[str, Any]]]:
    """Local files named by ``dataset``/``eval_dataset`` in dataset_info.json, and the hub entries."""
    files: list[str] = []
    remote: list[Mapping[str, Any]] = []
    for key in ("dataset", "eval_dataset"):
        names = values.get(key) or []
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        for n in names:
            entry = info.get(n)
            if not isinstance(entry, Mapping):
                continue
            if entry.get("file_name"):
                files.append(str(entry["file_name"]))
            else:
                remote.append({n: entry})  # hub/script datasets: the entry, not the bytes
    return files, remote


def summary(
    status: str,
    run_id: str | None,
    schedule: str,
    duration_s: float,
    final_loss: float | None,
    output_dir: str | None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "status": status,
        "run_id": run_id,
        "schedule": schedule,
        "duration_s": round(duration_s, 1),
        "final_loss": final_loss,
        "output_dir": output_dir,
        **extra,
    }


def redact_target(target: str | None) -> str | None:
    """A notifier as it may be shown: a webhook's path and query often are its secret."""
    if not target:
        return target
    if target.startswith(("http://", "https://")):
        u = urllib.parse.urlsplit(target)
        return f"{u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}/..."
    words = target.split()
    return f"{words[0]} ..." if words else target


# ---------------------------------------------------------------- registry (shell)


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
def _meta_lock(env: Mapping[str, str], what: str) -> Iterator[None]:
    """Serialise read-modify-write of one shared file (a record, the crontab) between processes."""
    path = home(env) / "locks" / f"{what}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def update_record(env: Mapping[str, str], name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """Apply ``change`` to the record under a lock; None if the schedule was removed meanwhile."""
    with _meta_lock(env, f"schedule-{name}.json"):
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


# ---------------------------------------------------------------- crontab executable (shell)


@dataclass(frozen=True)
class Crontab:
    """The user's crontab through the real interface: ``crontab -l`` and ``crontab -``."""

    exe: str
    env: Mapping[str, str]

    def read(self) -> str:
        r = subprocess.run([self.exe, "-l"], env=dict(self.env), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            if "no crontab" in (r.stderr + r.stdout).lower():
                return ""
            raise CrontabError(f"`crontab -l` failed ({r.returncode}): {r.stderr.strip()}", hint=_PRINT_HINT)
        return r.stdout

    def write(self, text: str) -> None:
        r = subprocess.run([self.exe, "-"], input=text, env=dict(self.env), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise CrontabError(f"`crontab -` refused the table ({r.returncode}): {r.stderr.strip()}", hint=_PRINT_HINT)


_PRINT_HINT = "`ftlaunch schedule add ... --print` prints the line and systemd units to install yourself"


def find_crontab(env: Mapping[str, str]) -> Crontab:
    exe = shutil.which("crontab", path=env.get("PATH"))
    if exe is None:
        raise CrontabError("no `crontab` executable on PATH (is cron installed?)", hint=_PRINT_HINT)
    return Crontab(os.path.abspath(exe), env)


# ---------------------------------------------------------------- files (shell)


def writable_problem(path: Path) -> str | None:
    """Why ``path`` (to be created if missing) cannot be written, or None."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        return f"{path} cannot be created: {p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{path} is not writable ({p} is read-only for this user)"
    return None


def content_hash(values: Mapping[str, Any], env_base: Path) -> str:
    """sha256 of the config (as merged and resolved) and of every local dataset file it names."""
    h = hashlib.sha256()
    stable = {k: v for k, v in sorted(values.items()) if k != "output_dir"}
    h.update(json.dumps(stable, sort_keys=True, default=str).encode())
    ddir = Path(str(values.get("dataset_dir") or "data"))
    ddir = ddir if ddir.is_absolute() else env_base / ddir
    info_path = ddir / "dataset_info.json"
    try:
        info = json.loads(info_path.read_text())
        _hash_file(h, info_path)
    except (OSError, json.JSONDecodeError):
        info = {}
        h.update(b"no dataset_info.json")
    names, remote = dataset_files(values, info if isinstance(info, dict) else {})
    h.update(json.dumps(remote, sort_keys=True, default=str).encode())
    for name in names:
        p = Path(name) if Path(name).is_absolute() else ddir / name
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        for f in files:
            _hash_file(h, f)
    return h.hexdigest()


def _hash_file(h: Any, path: Path) -> None:
    h.update(f"\0{path}\0".encode())
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as exc:
        h.update(f"unreadable: {exc.strerror}".encode())


def set_latest(base: Path, version: str) -> None:
    """Point ``<base>/latest`` at ``version`` with one rename (readers never see it missing)."""
    link = base / "latest"
    if link.exists() and not link.is_symlink():
        raise StateError(f"{link} exists and is not a symlink; not replacing it", hint="move it away")
    tmp = base / f".latest.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(version)
    os.replace(tmp, link)


# ---------------------------------------------------------------- notify (shell)


def notify(target: str, data: Mapping[str, Any], env: Mapping[str, str], timeout: float = 10.0) -> str | None:
    """POST ``data`` as JSON to a URL, or run a command with it on stdin and in FTLAUNCH_* variables.

    Returns None on success, else why it failed. Never raises: a notifier never fails the run.
    """
    body = json.dumps(data, default=str)
    try:
        if target.startswith(("http://", "https://")):
            req = urllib.request.Request(
                target, data=body.encode(), headers={"Content-Type": "application/json"}, method="POST"
            )
            with _opener(target, env).open(req, timeout=timeout) as resp:
                resp.read(1 << 16)
            return None
        child = dict(env)
        child.update(
            FTLAUNCH_SUMMARY=body,
            FTLAUNCH_STATUS=str(data.get("status")),
            FTLAUNCH_RUN_ID=str(data.get("run_id") or ""),
            FTLAUNCH_SCHEDULE=str(data.get("schedule")),
            FTLAUNCH_OUTPUT_DIR=str(data.get("output_dir") or ""),
        )
        r = subprocess.run(
            ["/bin/sh", "-c", target],
            input=body,
            env=child,
            capture_output=True,
            text=True,
            timeout=timeout * 6,
            start_new_session=True,
        )
        if r.returncode != 0:
            return f"notify command exited {r.returncode}: {r.stderr.strip()[-300:]}"
        return None
    except Exception as exc:  # whatever the notifier does, the run's result stands
        return f"{type(exc).__name__}: {exc}"


def _opener(url: str, env: Mapping[str, str]) -> urllib.request.OpenerDirector:
    """Proxies from ``env`` (not os.environ), never for loopback or no_proxy hosts."""
    host = urllib.parse.urlsplit(url).hostname or ""
    no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
    proxies: dict[str, str] = {}
    if host not in ("localhost", "127.0.0.1", "::1") and not urllib.request.proxy_bypass_environment(
        host, {"no": no_proxy}
    ):
        for scheme in ("http", "https"):
            value = env.get(f"{scheme}_proxy") or env.get(f"{scheme.upper()}_PROXY")
            if value:
                proxies[scheme] = value
    return urllib.request.build_opener(urllib.request.ProxyHandler(proxies))


# ---------------------------------------------------------------- add / remove (use cases)


@dataclass(frozen=True)
class ScheduleSpec:
    """What `schedule add` was given; stored in the registry and replayed by `schedule run`."""

    name: str
    config: str
    cron: str
    overrides: tuple[str, ...] = ()
    keep: int | None = None
    only_if_changed: bool = False
    notify: str | None = None
    gpu: str | None = None
    source_gpus: int | None = None
    global_batch: int | None = None
    max_retries: int = 4
    max_crash_retries: int = 2
    cwd: str | None = None


@dataclass(frozen=True)
class Added:
    record: dict[str, Any]
    line: str
    units: dict[str, str]
    installed: bool
    next_time: datetime | None


def _plan_request(rec: Mapping[str, Any], output_dir: str) -> Any:
    from .service import PlanRequest

    # JSON is valid YAML: the path stays one string whatever characters it holds.
    over = (*rec.get("overrides", ()), f"output_dir={json.dumps(output_dir)}")
    return PlanRequest(
        config=rec["config"],
        overrides=tuple(over),
        gpu=rec.get("gpu"),
        source_gpus=rec.get("source_gpus"),
        global_batch=rec.get("global_batch"),
        strict_files=True,
        cwd=rec.get("cwd"),
    )


def _base_output_dir(rec: Mapping[str, Any]) -> tuple[Path, dict[str, Any], Path]:
    """The config's own output_dir (absolute), its resolved values and its base directory."""
    from .config import load_config, resolve_paths

    loaded = load_config(rec["config"], rec.get("overrides", ()), cwd=rec.get("cwd"))
    values, _, _ = resolve_paths(loaded.values, loaded.base_dir, strict=False)
    out = values.get("output_dir")
    if not out:
        raise ConfigError(
            "a scheduled config needs output_dir: each run trains into <output_dir>/<name>-<UTC time>",
            hint="add output_dir to the YAML or as an override: output_dir=saves/nightly",
        )
    return Path(str(out)), values, loaded.base_dir


def add_schedule(
    spec: ScheduleSpec,
    env: Mapping[str, str],
    *,
    install: bool = True,
    python: str = sys.executable,
    now: datetime | None = None,
) -> Added:
    """Validate everything (cron, name, config planned now, directories), then register and install.

    Nothing is written unless every check passed; a failed crontab write takes the record back.
    """
    from .launch import find_trainer
    from .service import make_plan

    check_name(spec.name)
    cron = parse_cron(spec.cron)
    if record_path(env, spec.name).exists():
        raise ScheduleError(
            f"schedule {spec.name!r} already exists",
            hint=f"`ftlaunch schedule remove {spec.name}` first, or choose another name",
        )
    rec: dict[str, Any] = {
        "version": SCHEDULE_VERSION,
        "name": spec.name,
        "cron": cron.text,
        "config": str(Path(spec.cwd or os.getcwd(), spec.config).absolute()),
        "overrides": list(spec.overrides),
        "cwd": spec.cwd or os.getcwd(),
        "keep": spec.keep,
        "only_if_changed": spec.only_if_changed,
        "notify": spec.notify,
        "gpu": spec.gpu,
        "source_gpus": spec.source_gpus,
        "global_batch": spec.global_batch,
        "max_retries": spec.max_retries,
        "max_crash_retries": spec.max_crash_retries,
    }
    base, _, _ = _base_output_dir(rec)
    rec["output_dir"] = str(base)
    # Plan exactly what the first run will plan, so a broken config fails today, not at 2 a.m.
    make_plan(_plan_request(rec, str(base / version_name(spec.name, now or datetime.now(UTC)))), env)
    trainer = find_trainer(env)
    if problem := writable_problem(base):
        raise ConfigError(f"output_dir {problem}")
    if problem := writable_problem(schedules_dir(env)):
        raise StateError(f"FTLAUNCH_HOME: {problem}", hint="set FTLAUNCH_HOME to a writable directory")

    argv = run_argv(spec.name, python)
    # cron's PATH is bare: name the trainer that was checked just now, by absolute path.
    carry = {**carried_env(env), "FTLAUNCH_LLAMAFACTORY_CLI": trainer[0]}
    log = log_path(env, spec.name)
    line = cron_line(cron, spec.name, argv, carry, log)
    units = systemd_units(cron, spec.name, argv, carry, log)
    check_no_secrets(line + "".join(units.values()) + json.dumps(rec), env)
    rec.update(installed="crontab" if install else "manual", command=line, created=now_iso(), history=[])

    tab = find_crontab(env) if install else None
    with _meta_lock(env, "crontab"):
        if record_path(env, spec.name).exists():  # added by another process since the check above
            raise ScheduleError(f"schedule {spec.name!r} already exists")
        current = tab.read() if tab else ""
        new_text = add_entry(current, spec.name, line) if tab else ""  # a duplicate marker raises here
        write_json_atomic(record_path(env, spec.name), rec)
        if tab:
            try:
                tab.write(new_text)
            except BaseException:
                record_path(env, spec.name).unlink(missing_ok=True)
                raise
    return Added(rec, line, units, installed=install, next_time=next_fire(cron, datetime.now()))


@dataclass(frozen=True)
class Removed:
    name: str
    entries_removed: int
    had_record: bool


def remove_schedule(name: str, env: Mapping[str, str]) -> Removed:
    """Remove the schedule's own crontab line (if any) and its record; nothing else."""
    check_name(name)
    path = record_path(env, name)
    had_record = path.exists()
    installed = "crontab"
    if had_record:
        try:
            installed = json.loads(path.read_text()).get("installed", "crontab")
        except (OSError, json.JSONDecodeError):
            pass
    removed = 0
    try:
        tab: Crontab | None = find_crontab(env)
    except CrontabError:
        if had_record and installed == "crontab":
            raise
        tab = None
    with _meta_lock(env, "crontab"):
        if tab is not None:
            current = tab.read()
            new_text, removed = remove_entry(current, name)
            if not had_record and not removed:
                raise RunNotFoundError(f"no schedule {name!r}", hint="`ftlaunch schedule list` shows them")
            if removed:
                tab.write(new_text)
        elif not had_record:
            raise RunNotFoundError(f"no schedule {name!r}", hint="`ftlaunch schedule list` shows them")
        with _meta_lock(env, f"schedule-{name}.json"):
            path.unlink(missing_ok=True)
    return Removed(name, removed, had_record)


# ---------------------------------------------------------------- run (use case)


@dataclass(frozen=True)
class ScheduleRun:
    status: str  # succeeded, failed, stopped, skipped
    exit_code: int
    message: str
    run_id: str | None = None
    output_dir: str | None = None
    summary: Mapping[str, Any] | None = None
    notify_error: str | None = None


def run_schedule(
    name: str,
    env: Mapping[str, str],
    *,
    echo: bool = False,
    poll: float = 0.5,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    notifier: Callable[[str, Mapping[str, Any], Mapping[str, str]], str | None] = notify,
    say: Callable[[str], None] = lambda _text: None,
) -> ScheduleRun:
    """One scheduled run, in the foreground: never two at once, each into its own version dir."""
    rec = read_record(env, name)
    try:
        lock = acquire_run_lock(env, name)
    except BusyError as exc:
        _record(env, name, {"t": now_iso(), "status": "skipped", "reason": "overlap", "message": exc.message})
        raise
    try:
        return _run_locked(rec, env, echo=echo, poll=poll, clock=clock, notifier=notifier, say=say)
    finally:
        lock.close()


def _run_locked(
    rec: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    echo: bool,
    poll: float,
    clock: Callable[[], datetime],
    notifier: Callable[[str, Mapping[str, Any], Mapping[str, str]], str | None],
    say: Callable[[str], None],
) -> ScheduleRun:
    from .launch import find_trainer
    from .service import create_run, make_plan, run_view
    from .supervisor import Supervisor

    name = rec["name"]
    started = clock()
    t0 = time.monotonic()
    run_dir: Path | None = None
    vdir: Path | None = None
    digest = None
    try:
        base, values, base_dir = _base_output_dir(rec)
        if rec.get("only_if_changed"):
            digest = content_hash(values, base_dir)
            if digest == rec.get("last_success_hash"):
                msg = "config and dataset files unchanged since the last success; skipped"
                _record(env, name, {"t": now_iso(), "status": "skipped", "reason": "unchanged", "message": msg})
                say(f"schedule {name}: {msg}")
                return ScheduleRun("skipped", 0, msg)
        base.mkdir(parents=True, exist_ok=True)
        taken = {p.name for p in base.iterdir()}
        vdir = base / version_name(name, started, taken)
        loaded, p = make_plan(_plan_request(rec, str(vdir)), env)
        if str(p.config.get("output_dir")) != str(vdir):
            raise ConfigError(f"output_dir override did not apply ({p.config.get('output_dir')} != {vdir})")
        find_trainer(env)
        run_dir = create_run(
            loaded,
            p,
            env,
            name=name,
            max_retries=int(rec.get("max_retries", 4)),
            max_crash_retries=int(rec.get("max_crash_retries", 2)),
            extra_state={"schedule": name},
        )
    except FtlaunchError as exc:
        code = int(exc.exit_code)
        s = summary("failed", None, name, time.monotonic() - t0, None, str(vdir) if vdir else None, message=exc.message)
        err = _notify(rec, s, env, notifier, None)
        _record(env, name, {**_entry(s, started, code), "notify_error": err})
        raise
    run_id = run_dir.name
    say(f"schedule {name}: run {run_id} -> {vdir}")
    _record(env, name, {**_entry(summary("running", run_id, name, 0.0, None, str(vdir)), started, None)})
    try:
        code = Supervisor(run_dir, env, echo=echo, poll=poll).run()
    except FtlaunchError as exc:  # the supervisor recorded it in the run; the schedule records it too
        s = summary("failed", run_id, name, time.monotonic() - t0, None, str(vdir), message=exc.message)
        failed = {**_entry(s, started, int(exc.exit_code)), "notify_error": _notify(rec, s, env, notifier, run_dir)}
        update_record(env, name, lambda d: _replace_running(d, run_id, failed))
        raise
    view = run_view(run_dir)
    status = view["status"]
    message = str(view.get("message") or status)
    notes: list[str] = []
    if code == 0:
        try:
            set_latest(base, vdir.name)
        except (OSError, FtlaunchError) as exc:
            notes.append(f"latest not updated: {exc}")
    s = summary(status, run_id, name, time.monotonic() - t0, _final_loss(view, vdir), str(vdir), exit_code=code)
    if code != 0:
        s["message"] = message
    entry = _entry(s, started, code)
    if notes:
        entry["message"] = "; ".join([message, *notes])

    def finish(data: dict[str, Any]) -> None:
        _replace_running(data, run_id, entry)
        if code == 0:
            data["latest"] = vdir.name if not notes else data.get("latest")
            if digest:
                data["last_success_hash"] = digest

    data = update_record(env, name, finish)
    pruned = _prune(base, name, data, rec) if code == 0 and data else []
    err = _notify(rec, s, env, notifier, run_dir)
    if err or pruned:
        update_record(env, name, lambda d: _annotate(d, run_id, err, pruned))
    say(f"schedule {name}: run {run_id} {status}" + (f" (pruned {len(pruned)})" if pruned else ""))
    return ScheduleRun(status, code, message, run_id, str(vdir), s, err)


def _final_loss(view: Mapping[str, Any], vdir: Path) -> float | None:
    """The last logged loss; else the trainer's own train_results.json."""
    if isinstance(view.get("loss"), (int, float)):
        return float(view["loss"])
    try:
        value = json.loads((vdir / "train_results.json").read_text()).get("train_loss")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _entry(s: Mapping[str, Any], started: datetime, code: int | None) -> dict[str, Any]:
    return {
        "t": started.astimezone(UTC).isoformat(timespec="seconds"),
        "status": s["status"],
        "run_id": s["run_id"],
        "output_dir": s["output_dir"],
        "duration_s": s["duration_s"],
        "final_loss": s["final_loss"],
        "exit_code": code,
        **({"message": s["message"]} if s.get("message") else {}),
    }


def _record(env: Mapping[str, str], name: str, entry: Mapping[str, Any]) -> None:
    def change(data: dict[str, Any]) -> None:
        data.setdefault("history", []).append(dict(entry))
        data["last"] = dict(entry)

    update_record(env, name, change)


def _replace_running(data: dict[str, Any], run_id: str, entry: Mapping[str, Any]) -> None:
    hist = data.setdefault("history", [])
    for i, h in enumerate(hist):
        if h.get("run_id") == run_id:
            hist[i] = dict(entry)
            break
    else:
        hist.append(dict(entry))
    data["last"] = dict(entry)


def _annotate(data: dict[str, Any], run_id: str, err: str | None, pruned: list[str]) -> None:
    for h in data.get("history", []):
        if h.get("run_id") == run_id and err:
            h["notify_error"] = err
        if h.get("output_dir") in pruned:
            h["pruned"] = True
    if err and data.get("last", {}).get("run_id") == run_id:
        data["last"]["notify_error"] = err


def _prune(base: Path, name: str, data: Mapping[str, Any], rec: Mapping[str, Any]) -> list[str]:
    latest = data.get("latest")
    chosen = choose_prune(data.get("history", []), rec.get("keep"), str(base / latest) if latest else None)
    done = []
    for d in chosen:
        p = Path(d)
        # Only what this schedule made: a direct child of its output_dir named <name>-<time>.
        if p.parent == base and p.name.startswith(f"{name}-") and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            done.append(d)
        elif not p.exists():
            done.append(d)
    return done


def _notify(
    rec: Mapping[str, Any],
    s: Mapping[str, Any],
    env: Mapping[str, str],
    notifier: Callable[[str, Mapping[str, Any], Mapping[str, str]], str | None],
    run_dir: Path | None,
) -> str | None:
    target = rec.get("notify")
    if not target:
        return None
    err = notifier(target, s, env)
    if run_dir is not None:
        from .runstore import append_event

        append_event(run_dir, "notified", target=redact_target(target), ok=err is None, error=err)
    return err


# ---------------------------------------------------------------- list (view)


def schedule_view(rec: Mapping[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """One schedule as `schedule list --json` shows it; next time in local time."""
    if rec.get("unreadable"):
        return {"name": rec["name"], "result": "unreadable", "message": rec["unreadable"]}
    last = rec.get("last") or {}
    try:
        nxt = next_fire(parse_cron(rec["cron"]), now or datetime.now())
    except ScheduleError:
        nxt = None
    result = last.get("status")
    if result == "skipped":
        result = f"skipped ({last.get('reason')})"
    return {
        "name": rec["name"],
        "cron": rec.get("cron"),
        "config": rec.get("config"),
        "overrides": rec.get("overrides", []),
        "output_dir": rec.get("output_dir"),
        "keep": rec.get("keep"),
        "only_if_changed": rec.get("only_if_changed", False),
        "notify": redact_target(rec.get("notify")),
        "installed": rec.get("installed"),
        "last_run": last.get("t"),
        "run_id": last.get("run_id"),
        "result": result,
        "latest": rec.get("latest"),
        "next": nxt.astimezone().isoformat(timespec="minutes") if nxt else None,
    }


def list_views(env: Mapping[str, str], now: datetime | None = None) -> list[dict[str, Any]]:
    """Every schedule; a last run still marked running is checked against its run (it may be lost)."""
    from .runstore import runs_root
    from .service import run_view

    out = []
    for rec in list_records(env):
        v = schedule_view(rec, now)
        if v.get("result") == "running" and v.get("run_id"):
            try:
                v["result"] = run_view(runs_root(env) / v["run_id"])["status"]
            except FtlaunchError:
                v["result"] = "lost"
        out.append(v)
    return out
