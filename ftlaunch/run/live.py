"""What `ftlaunch runs --watch` shows of each run, read from the run folders only (no torch, no trainer).

A ``LiveRow`` is a run's ``RunView`` (ftlaunch.run.view) plus what a glance at many runs needs: the
engine (LLaMA-Factory v0/v1, local, torchrun xN or Slurm, DeepSpeed), the recent losses for a
sparkline, the restarts so far and the last event. Reads are bounded, so a refresh stays cheap however
long a run is: the tails of trainer_records.jsonl and events.jsonl only, and config.yaml once per
change of its mtime. The parsing (``losses_of``, ``restarts_of``, ``event_line``, ``sparkline``) is pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ftlaunch.errors import StateError
from ftlaunch.files import JSON_LIMIT, read_user_text, value_error
from ftlaunch.run.events import Event
from ftlaunch.run.records import MARK
from ftlaunch.run.recovery import is_v1
from ftlaunch.run.store import RunFolder, json_lines, list_runs, read_state
from ftlaunch.run.view import RunView, run_view

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 8
RECORDS_TAIL = 16 * 1024
EVENTS_TAIL = 16 * 1024
RESTART_EVENTS = frozenset({"retry", "recovered"})  # a retry is a restart; `recovered` ends one (not counted)
QUIET_EVENTS = frozenset({"progress"})  # not worth the last-event column


@dataclass(frozen=True)
class LiveRow:
    view: RunView
    engine: str = "-"
    losses: tuple[float, ...] = ()
    restarts: int = 0
    last_event: str = "-"


def sparkline(values: Iterable[float], width: int = SPARK_WIDTH) -> str:
    """The last ``width`` values as bars, lowest to highest of those shown; "" for none."""
    vals = [v for v in values if v == v and abs(v) != float("inf")][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    return "".join(SPARK[int((v - lo) / span * (len(SPARK) - 1)) if span else 0] for v in vals)


def tail_lines(path: Path, limit: int) -> bytes:
    """The last ``limit`` bytes of a file from a line start; b"" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return b""
    if size > limit:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    return data


def losses_of(records: bytes) -> tuple[float, ...]:
    """The losses of the step records in a tail of trainer_records.jsonl (attempt markers skipped)."""
    recs, _ = json_lines(records, lambda r: MARK not in r and isinstance(r.get("loss"), (int, float)))
    return tuple(float(r["loss"]) for r in recs)


def restarts_of(events: Iterable[Mapping[str, Any]]) -> int:
    return sum(1 for e in events if e.get("event") == Event.RETRY)


def event_line(events: list[Mapping[str, Any]]) -> str:
    """The last telling event as one line: its name, its step or message, and its time (HH:MM:SS)."""
    for e in reversed(events):
        name = str(e.get("event"))
        if name in QUIET_EVENTS:
            continue
        detail = e.get("message") or (f"step {e['step']}" if e.get("step") is not None else "")
        t = str(e.get("t") or "")[11:19]
        return " ".join(x for x in (t, name, str(detail).splitlines()[0] if detail else "") if x)
    return "-"


def engine_of(config: Mapping[str, Any], slurm: bool, world_size: int | None) -> str:
    where = "slurm" if slurm else f"torchrun×{world_size}" if (world_size or 1) > 1 else "local"
    parts = ["lf-v1" if is_v1(dict(config)) else "lf-v0", where]
    if config.get("deepspeed"):
        parts.append("ds")
    return " ".join(parts)


_CONFIGS: MutableMapping[Path, tuple[int, Mapping[str, Any]]] = {}


def _config(path: Path) -> Mapping[str, Any]:
    """config.yaml's values, parsed again only when it changed (a resume with edits, an OOM rung)."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return {}
    cached = _CONFIGS.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    try:
        values = yaml.safe_load(read_user_text(path, limit=JSON_LIMIT, what=str(path), error=value_error)) or {}
    except (OSError, ValueError, yaml.YAMLError):
        values = {}
    _CONFIGS[path] = (mtime, values if isinstance(values, dict) else {})
    return _CONFIGS[path][1]


def live_row(run_dir: Path) -> LiveRow:
    try:
        view = run_view(run_dir)
        state = read_state(run_dir)
    except StateError as exc:
        return LiveRow(view=RunView.unreadable(run_dir, exc.message))
    folder = RunFolder(run_dir)
    events, _ = json_lines(tail_lines(folder.events, EVENTS_TAIL), lambda r: isinstance(r.get("event"), str))
    return LiveRow(
        view=view,
        engine=engine_of(_config(folder.config), state.job.submitted, state.world_size),
        losses=losses_of(tail_lines(folder.records, RECORDS_TAIL)),
        restarts=_all_restarts(folder) if _size(folder.events) > EVENTS_TAIL else restarts_of(events),
        last_event=event_line(events),
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _all_restarts(folder: RunFolder) -> int:
    """Restarts of a run whose events outgrew the tail: counted on the whole file, as bytes (cheap;
    store.append_event writes json.dumps's default separators)."""
    try:
        return folder.events.read_bytes().count(json.dumps({"event": Event.RETRY.value})[1:-1].encode())
    except OSError:
        return 0


def live_rows(env: Mapping[str, str]) -> list[LiveRow]:
    return [live_row(p) for p in list_runs(env)]
