"""The ``schedule add`` and ``schedule remove`` use cases: validate everything (cron, name, the config
planned now, writable directories), then register the record and install one crontab line; remove
takes out only the schedule's own line and its record.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ftlaunch.errors import ConfigError, FtlaunchError, RunNotFoundError, StateError
from ftlaunch.files import now_iso
from ftlaunch.plan.config import mask_override, secret_override
from ftlaunch.run.options import RunOptions
from ftlaunch.schedule.cron import ScheduleError, next_fire, parse_cron
from ftlaunch.schedule.crontab import Crontab, CrontabError, add_entry, cron_line, find_crontab, remove_entry
from ftlaunch.schedule.records import (
    Installed,
    ScheduleRecord,
    check_name,
    locked,
    read_record,
    record_path,
    schedules_dir,
    secrets_path,
    write_record,
    write_schedule_secrets,
)
from ftlaunch.schedule.units import carried_env, check_no_secrets, log_path, run_argv, systemd_units
from ftlaunch.schedule.versions import base_output_dir, version_name


def writable_problem(path: Path) -> str | None:
    """Why ``path`` (to be created if missing) cannot be written, or None."""
    from ftlaunch.run.outdir import link_trouble

    if trouble := link_trouble(path):  # a symlink loop or a link to nothing "does not exist" either
        return trouble
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
    notify_cmd: str | None = None  # the supervisor's notifications for each run, as `train` takes them
    notify_on: tuple[str, ...] | None = None
    run: RunOptions = RunOptions()  # everything `train` takes: scheduled runs are the same runs
    cwd: str | None = None


@dataclass(frozen=True)
class Added:
    record: ScheduleRecord
    line: str
    units: dict[str, str]
    installed: bool
    next_time: datetime | None


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
    # Secret overrides (swanlab_api_key=...): the record holds key=***, the values a 0600 file of their own.
    secrets = dict(found for o in spec.overrides if (found := secret_override(o)))
    rec = ScheduleRecord(
        name=spec.name,
        cron=cron.text,
        config=str(Path(cwd, spec.config).absolute()),
        overrides=tuple(mask_override(o) for o in spec.overrides),
        cwd=cwd,
        keep=spec.keep,
        only_if_changed=spec.only_if_changed,
        notify=spec.notify,
        notify_cmd=spec.notify_cmd,
        notify_on=spec.notify_on,
        run=spec.run.absolute(cwd),
    )
    base, _, _ = base_output_dir(rec)
    rec = rec.changed(output_dir=str(base))
    # Plan exactly what the first run will plan, so a broken config fails today, not at 2 a.m.
    make_plan(rec.plan_request(str(base / version_name(spec.name, now or datetime.now(UTC))), secrets), env)
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
    check_no_secrets(line + "".join(units.values()) + json.dumps(rec.to_json(), default=str), env, secrets.values())
    rec = rec.changed(installed=Installed.CRONTAB if install else Installed.MANUAL, command=line, created=now_iso())

    tab = find_crontab(env) if install else None
    with locked(env, "crontab"):
        if record_path(env, spec.name).exists():  # added by another process since the check above
            raise ScheduleError(f"schedule {spec.name!r} already exists")
        current = tab.read() if tab else ""
        new_text = add_entry(current, spec.name, line) if tab else ""  # a duplicate marker raises here
        write_schedule_secrets(env, spec.name, secrets)
        write_record(env, rec)
        if tab:
            try:
                tab.write(new_text)
            except BaseException:
                record_path(env, spec.name).unlink(missing_ok=True)
                secrets_path(env, spec.name).unlink(missing_ok=True)
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
    installed: Installed | None = Installed.CRONTAB  # an unreadable record may have a line: look for it
    if had_record:
        try:
            installed = read_record(env, name).installed
        except FtlaunchError:
            pass
    removed = 0
    try:
        tab: Crontab | None = find_crontab(env)
    except CrontabError:
        if had_record and installed in (Installed.CRONTAB, None):
            raise
        tab = None
    with locked(env, "crontab"):
        if tab is not None:
            current = tab.read()
            new_text, removed = remove_entry(current, name)
            if not had_record and not removed:
                raise RunNotFoundError(f"no schedule {name!r}", hint="`ftlaunch schedule list` shows them")
            if removed:
                tab.write(new_text)
        elif not had_record:
            raise RunNotFoundError(f"no schedule {name!r}", hint="`ftlaunch schedule list` shows them")
        with locked(env, f"schedule-{name}.json"):
            path.unlink(missing_ok=True)
            secrets_path(env, name).unlink(missing_ok=True)
    return Removed(name, removed, had_record)
