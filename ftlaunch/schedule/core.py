"""Scheduled, unattended retraining: ``ftlaunch schedule add|list|remove|run``.

Cron expressions live in ``ftlaunch.schedule.cron``, the crontab line and table in ``ftlaunch.schedule.crontab``.
Pure core (no files, no clock, no environment):
  the command cron runs (``run_argv``, the carried environment, no secrets), the systemd units,
  version naming, the prune choice, the notification summary.
Shells:
  the registry ``$FTLAUNCH_HOME/schedules/<name>.json`` (replaced atomically), a non-blocking flock
  per schedule (``$FTLAUNCH_HOME/locks``), the content hash of config + dataset files, notifiers
  (HTTP POST or a command).
Use cases:
  ``add_schedule``, ``remove_schedule``, ``list_views`` and ``run_schedule``, which trains one
  version in the foreground under the Supervisor.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from ftlaunch.errors import BusyError, ConfigError, FtlaunchError, RunNotFoundError, StateError
from ftlaunch.files import home, now_iso, write_json_atomic
from ftlaunch.locks import try_flock
from ftlaunch.run.options import RunOptions
from ftlaunch.run.trainer import SECRET_ENV
from ftlaunch.schedule.cron import Cron, ScheduleError, next_fire, on_calendar, parse_cron
from ftlaunch.schedule.crontab import Crontab, CrontabError, add_entry, cron_line, find_crontab, remove_entry

SCHEDULE_VERSION = 1
HISTORY_MAX = 200
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
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


# ---------------------------------------------------------------- the command cron runs, its systemd units (pure)


def run_argv(name: str, python: str) -> list[str]:
    """The same Python environment, by absolute path (never resolved: a venv's python is a link)."""
    return [os.path.abspath(python), "-m", "ftlaunch", "schedule", "run", name]


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
    # A real probe in the nearest existing folder (nothing is left behind): os.access says yes to
    # root on a read-only mount.
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as exc:
        return f"{path} is not writable ({p}: {exc.strerror or exc})"
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
    run: RunOptions = RunOptions()  # everything `train` takes: scheduled runs are the same runs
    cwd: str | None = None


@dataclass(frozen=True)
class Added:
    record: dict[str, Any]
    line: str
    units: dict[str, str]
    installed: bool
    next_time: datetime | None


def run_options_of(rec: Mapping[str, Any]) -> RunOptions:
    """The run options a record was added with (older records hold a subset under the same keys)."""
    return RunOptions.from_dict({**rec, "run_name": rec.get("run_name") or rec["name"]})


def _plan_request(rec: Mapping[str, Any], output_dir: str) -> Any:
    # JSON is valid YAML: the path stays one string whatever characters it holds.
    over = (*rec.get("overrides", ()), f"output_dir={json.dumps(output_dir)}")
    return run_options_of(rec).plan_request(rec["config"], tuple(over), strict=True, cwd=rec.get("cwd"))


def _base_output_dir(rec: Mapping[str, Any]) -> tuple[Path, dict[str, Any], Path]:
    """The config's own output_dir (absolute), its resolved values and its base directory."""
    from ftlaunch.plan.config import load_config, resolve_paths

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
    from ftlaunch.run.prepare import make_plan
    from ftlaunch.run.trainer import find_trainer

    check_name(spec.name)
    cron = parse_cron(spec.cron)
    if record_path(env, spec.name).exists():
        raise ScheduleError(
            f"schedule {spec.name!r} already exists",
            hint=f"`ftlaunch schedule remove {spec.name}` first, or choose another name",
        )
    cwd = spec.cwd or os.getcwd()
    run = spec.run.absolute(cwd).to_dict()
    rec: dict[str, Any] = {
        "version": SCHEDULE_VERSION,
        "name": spec.name,
        "cron": cron.text,
        "config": str(Path(cwd, spec.config).absolute()),
        "overrides": list(spec.overrides),
        "cwd": cwd,
        "keep": spec.keep,
        "only_if_changed": spec.only_if_changed,
        "notify": spec.notify,
        **run,
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
    from ftlaunch.run.launch import start_run
    from ftlaunch.run.view import run_view

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
        target = vdir

        def check(p: Any) -> None:
            if str(p.config.get("output_dir")) != str(target):
                raise ConfigError(f"output_dir override did not apply ({p.config.get('output_dir')} != {target})")

        def created(rd: Path, _plan: Any) -> None:
            nonlocal run_dir
            run_dir = rd
            say(f"schedule {name}: run {rd.name} -> {target}")
            _record(env, name, {**_entry(summary("running", rd.name, name, 0.0, None, str(target)), started, None)})

        code = start_run(
            _plan_request(rec, str(vdir)),
            env,
            run_options_of(rec).supervisor_settings(),
            foreground=True,
            echo=echo,
            poll=poll,
            extra_state={"schedule": name},
            check=check,
            on_created=created,
        ).exit_code
    except FtlaunchError as exc:
        if run_dir is None:  # nothing was started: the schedule alone records it
            code = int(exc.exit_code)
            s = summary(
                "failed", None, name, time.monotonic() - t0, None, str(vdir) if vdir else None, message=exc.message
            )
            err = _notify(rec, s, env, notifier, None)
            _record(env, name, {**_entry(s, started, code), "notify_error": err})
            raise
        # the supervisor recorded it in the run; the schedule records it too
        run_id = run_dir.name
        s = summary("failed", run_id, name, time.monotonic() - t0, None, str(vdir), message=exc.message)
        failed = {**_entry(s, started, int(exc.exit_code)), "notify_error": _notify(rec, s, env, notifier, run_dir)}
        update_record(env, name, lambda d: _replace_running(d, run_id, failed))
        raise
    assert run_dir is not None and vdir is not None
    run_id = run_dir.name
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
        from ftlaunch.run.store import append_event

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
    from ftlaunch.run.store import runs_root
    from ftlaunch.run.view import run_view

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
