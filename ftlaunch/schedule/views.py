"""What ``schedule list`` shows: one schedule as a view, and every schedule with a last run still
marked running checked against its run (it may be lost).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ftlaunch.errors import FtlaunchError
from ftlaunch.schedule.cron import ScheduleError, next_fire, parse_cron
from ftlaunch.schedule.notify import redact_target
from ftlaunch.schedule.records import list_records


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
