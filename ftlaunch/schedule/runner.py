"""``schedule run``: one scheduled run, in the foreground, through ftlaunch.run.launch.start_run
(the one launch use case, as `train`): never two at once, each into its own version dir, recorded
in the schedule's history, then ``latest``, pruning and the notification.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ftlaunch.errors import BusyError, ConfigError, FtlaunchError
from ftlaunch.schedule.notify import Notifier, Summary, notify, redact_target
from ftlaunch.schedule.records import (
    EntryStatus,
    HistoryEntry,
    ScheduleRecord,
    SkipReason,
    acquire_run_lock,
    read_record,
    read_schedule_secrets,
    record_entry,
    update_record,
)
from ftlaunch.schedule.versions import base_output_dir, content_hash, prune, set_latest, version_name

if TYPE_CHECKING:
    from ftlaunch.run.view import RunView


@dataclass(frozen=True)
class ScheduleRun:
    status: EntryStatus  # the run's end, or skipped
    exit_code: int
    message: str
    run_id: str | None = None
    output_dir: str | None = None
    summary: Summary | None = None
    notify_error: str | None = None


def run_schedule(
    name: str,
    env: Mapping[str, str],
    *,
    echo: bool = False,
    poll: float = 0.5,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    notifier: Notifier = notify,
    say: Callable[[str], None] = lambda _text: None,
) -> ScheduleRun:
    """One scheduled run, in the foreground: never two at once, each into its own version dir."""
    rec = read_record(env, name)
    try:
        lock = acquire_run_lock(env, name)
    except BusyError as exc:
        record_entry(env, name, HistoryEntry.skip(SkipReason.OVERLAP, exc.message))
        raise
    base_lock: IO[str] | None = None
    try:
        try:
            base_lock = _claim_base(env, rec)
        except BusyError as exc:
            record_entry(env, name, HistoryEntry.skip(SkipReason.OVERLAP, exc.message))
            raise
        return _run_locked(rec, env, echo=echo, poll=poll, clock=clock, notifier=notifier, say=say)
    finally:
        if base_lock is not None:
            base_lock.close()
        lock.close()


def _claim_base(env: Mapping[str, str], rec: ScheduleRecord) -> IO[str] | None:
    """The one rule for "a trainer lives in this output_dir" (ftlaunch.run.orphans.runs_of_output_dir),
    applied to the schedule's base output_dir: each run trains into its own version dir under it, so
    the version dir's lock alone would let a trainer start beside a plain `train` of the same config,
    or beside an earlier run's trainer that outlived its `schedule run`, on the same GPUs (issue 31).

    Holding the schedule's lock: takes the base output_dir's lock for the run's life (a `train` or
    `resume` into the base exits 7 meanwhile, and a live one there makes this exit 7), then refuses
    (exit 7) beside any live trainer of a run into the base, of any schedule's run under it, or of an
    earlier run of this schedule. None when the config has no output_dir (the run itself says so)."""
    from ftlaunch.run.orphans import refuse_if_alive, runs_of_output_dir, runs_where
    from ftlaunch.run.outdir import SCHEDULED_RUN, acquire_output_lock

    try:
        base = str(base_output_dir(rec)[0])
    except FtlaunchError:
        return None
    lock = acquire_output_lock(env, base, f"{SCHEDULED_RUN}{rec.name}'s run (pid {os.getpid()})")
    try:
        runs = runs_of_output_dir(env, base)
        seen = {d for d, _ in runs}
        runs += [(d, st) for d, st in runs_where(env, lambda st: st.schedule == rec.name) if d not in seen]
        refuse_if_alive(base, runs)
    except BaseException:
        lock.close()
        raise
    return lock


def _run_locked(
    rec: ScheduleRecord,
    env: Mapping[str, str],
    *,
    echo: bool,
    poll: float,
    clock: Callable[[], datetime],
    notifier: Notifier,
    say: Callable[[str], None],
) -> ScheduleRun:
    from ftlaunch.run.launch import start_run
    from ftlaunch.run.state import StartFacts
    from ftlaunch.run.view import run_view

    name = rec.name
    started = clock()
    t0 = time.monotonic()
    run_dir: Path | None = None
    vdir: Path | None = None
    digest = None
    try:
        base, values, base_dir = base_output_dir(rec)
        if rec.only_if_changed:
            digest = content_hash(values, base_dir)
            if digest == rec.last_success_hash:
                msg = "config and dataset files unchanged since the last success; skipped"
                record_entry(env, name, HistoryEntry.skip(SkipReason.UNCHANGED, msg))
                say(f"schedule {name}: {msg}")
                return ScheduleRun(EntryStatus.SKIPPED, 0, msg)
        base.mkdir(parents=True, exist_ok=True)
        taken = {p.name for p in base.iterdir()}
        vdir = base / version_name(name, started, taken)
        target = vdir

        def check(p: Any) -> None:
            if str(p.config.get("output_dir")) != str(target):
                raise ConfigError(f"output_dir override did not apply ({p.config.get('output_dir')} != {target})")
            if not rec.notify_cmd:  # the run's supervisor reads $FTLAUNCH_HOME/notify.yaml: checked first (exit 19)
                from ftlaunch.run.notify import load_file

                load_file(env)

        def created(rd: Path, _plan: Any) -> None:
            nonlocal run_dir
            run_dir = rd
            if rec.notify_cmd or rec.notify_on is not None:  # the supervisor's notifications, as `train` keeps them
                from ftlaunch.run.notify import NotifySpec, keep_spec, parse_on

                keep_spec(rd, NotifySpec(cmd=rec.notify_cmd, on=parse_on(",".join(rec.notify_on or ()))))
            say(f"schedule {name}: run {rd.name} -> {target}")
            running = Summary(EntryStatus.RUNNING, rd.name, name, 0.0, None, str(target))
            record_entry(env, name, _entry(running, started, None))

        code = start_run(
            rec.plan_request(str(vdir), read_schedule_secrets(env, name)),
            env,
            rec.run_options().supervisor_settings(),
            foreground=True,
            echo=echo,
            poll=poll,
            facts=StartFacts(schedule=name),
            check=check,
            on_created=created,
        ).exit_code
    except FtlaunchError as exc:
        if run_dir is None:  # nothing was started: the schedule alone records it
            code = int(exc.exit_code)
            out = str(vdir) if vdir else None
            s = Summary(EntryStatus.FAILED, None, name, time.monotonic() - t0, None, out, message=exc.message)
            err = _notify(rec, s, env, notifier, None)
            record_entry(env, name, replace(_entry(s, started, code), notify_error=err))
            raise
        # the supervisor recorded it in the run; the schedule records it too
        run_id = run_dir.name
        s = Summary(EntryStatus.FAILED, run_id, name, time.monotonic() - t0, None, str(vdir), message=exc.message)
        failed = replace(_entry(s, started, int(exc.exit_code)), notify_error=_notify(rec, s, env, notifier, run_dir))
        update_record(env, name, lambda d: d.with_result(run_id, failed))
        raise
    assert run_dir is not None and vdir is not None
    run_id = run_dir.name
    view = run_view(run_dir)
    status = EntryStatus.of_run(view.status.value)
    message = str(view.message or status)
    notes: list[str] = []
    if code == 0:
        try:
            set_latest(base, vdir.name)
        except (OSError, FtlaunchError) as exc:
            notes.append(f"latest not updated: {exc}")
    s = Summary(
        status,
        run_id,
        name,
        time.monotonic() - t0,
        _final_loss(view, vdir),
        str(vdir),
        exit_code=code,
        message=message if code != 0 else None,
    )
    entry = _entry(s, started, code)
    if notes:
        entry = replace(entry, message="; ".join([message, *notes]))

    def finish(d: ScheduleRecord) -> ScheduleRecord:
        d = d.with_result(run_id, entry)
        if code != 0:
            return d
        return d.changed(latest=d.latest if notes else vdir.name, last_success_hash=digest or d.last_success_hash)

    data = update_record(env, name, finish)
    pruned = prune(base, data) if code == 0 and data else []
    err = _notify(rec, s, env, notifier, run_dir)
    if err or pruned:
        update_record(env, name, lambda d: d.annotated(run_id, err, pruned))
    say(f"schedule {name}: run {run_id} {status}" + (f" (pruned {len(pruned)})" if pruned else ""))
    return ScheduleRun(status, code, message, run_id, str(vdir), s, err)


def _final_loss(view: RunView, vdir: Path) -> float | None:
    """The last logged loss; else the trainer's own train_results.json."""
    if isinstance(view.loss, (int, float)):
        return float(view.loss)
    try:
        value = json.loads((vdir / "train_results.json").read_text()).get("train_loss")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _entry(s: Summary, started: datetime, code: int | None) -> HistoryEntry:
    return HistoryEntry(
        t=started.astimezone(UTC).isoformat(timespec="seconds"),
        status=s.status,
        run_id=s.run_id,
        output_dir=s.output_dir,
        duration_s=s.duration_s,
        final_loss=s.final_loss,
        exit_code=code,
        message=s.message or None,
    )


def _notify(
    rec: ScheduleRecord, s: Summary, env: Mapping[str, str], notifier: Notifier, run_dir: Path | None
) -> str | None:
    """Send ``s`` to the schedule's notifier, if it has one, and note it in the run's events."""
    if not rec.notify:
        return None
    err = notifier(rec.notify, s.to_json(), env)
    if run_dir is not None:
        from ftlaunch.run.events import Event
        from ftlaunch.run.transitions import note

        note(run_dir, Event.NOTIFIED, target=redact_target(rec.notify), ok=err is None, error=err)
    return err
