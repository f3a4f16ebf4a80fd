"""What ``schedule list`` shows: one schedule as a view, and every schedule with a last run still
marked running checked against its run (it may be lost).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ftlaunch.errors import FtlaunchError
from ftlaunch.plan.config import mask_override
from ftlaunch.schedule.cron import ScheduleError, next_fire, parse_cron
from ftlaunch.schedule.notify import redact_target
from ftlaunch.schedule.records import EntryStatus, ScheduleRecord, Unreadable, list_records


def schedule_view(rec: ScheduleRecord | Unreadable, now: datetime | None = None) -> dict[str, Any]:
    """One schedule as `schedule list --json` shows it; next time in local time."""
    if isinstance(rec, Unreadable):
        return {"name": rec.name, "result": "unreadable", "message": rec.message}
    last = rec.last
    try:
        nxt = next_fire(parse_cron(rec.cron), now or datetime.now())
    except ScheduleError:
        nxt = None
    result = last.status.value if last else None
    if last and last.status is EntryStatus.SKIPPED:
        result = f"skipped ({last.reason.value if last.reason else None})"
    return {
        "name": rec.name,
        "cron": rec.cron,
        "config": rec.config,
        "overrides": [mask_override(o) for o in rec.overrides],  # a record written before secrets had a file
        "output_dir": rec.output_dir,
        "keep": rec.keep,
        "only_if_changed": rec.only_if_changed,
        "notify": redact_target(rec.notify),
        "installed": rec.installed.value if rec.installed else None,
        "last_run": last.t if last else None,
        "run_id": last.run_id if last else None,
        "result": result,
        "latest": rec.latest,
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
                v["result"] = run_view(runs_root(env) / v["run_id"]).status.value
            except FtlaunchError:
                v["result"] = "lost"
        out.append(v)
    return out
