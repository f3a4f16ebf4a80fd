"""``schedule run``: one scheduled run, in the foreground, through ftlaunch.run.launch.start_run
(the one launch use case): never two at once, each into its own version dir, recorded in the
schedule's history, notified.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ftlaunch.errors import BusyError, ConfigError, FtlaunchError
from ftlaunch.files import now_iso
from ftlaunch.schedule.manage import plan_request, run_options_of
from ftlaunch.schedule.notify import notify, redact_target, summary
from ftlaunch.schedule.records import acquire_run_lock, read_record, update_record
from ftlaunch.schedule.versions import base_output_dir, content_hash, prune, set_latest, version_name


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
        base, values, base_dir = base_output_dir(rec)
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
            plan_request(rec, str(vdir)),
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
    pruned = prune(base, name, data, rec) if code == 0 and data else []
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
