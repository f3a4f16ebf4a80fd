"""What `ftlaunch runs --watch` shows of each run, read from the run folders only (no torch, no trainer).

A ``LiveRow`` is a run's ``RunView`` (ftlaunch.run.view) plus what a glance at many runs needs: the
engine (LLaMA-Factory v0/v1, local, torchrun xN or Slurm, DeepSpeed), the recent losses for a
sparkline, the restarts so far and the last event. A file is parsed once per change of it
(``FileMemo``: its mtime, size and inode), and a run whose status is final is not looked at again
until one of its files changes (``LiveRows``), so a refresh of many idle runs is a few stats each;
the records are read as a tail only. The parsing (``losses_of``, ``restarts_of``, ``event_line``,
``sparkline``) is pure."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ftlaunch.errors import StateError
from ftlaunch.files import JSON_LIMIT, read_user_text, value_error
from ftlaunch.run.events import Event
from ftlaunch.run.records import MARK
from ftlaunch.run.recovery import is_v1
from ftlaunch.run.store import RunFolder, json_lines, list_runs, read_events, read_state
from ftlaunch.run.view import RunView, run_view

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 8
RECORDS_TAIL = 16 * 1024
EVENTS_TAIL = 16 * 1024
RESTART_EVENTS = frozenset({"retry", "recovered"})  # a retry is a restart; `recovered` ends one (not counted)
QUIET_EVENTS = frozenset({"progress"})  # not worth the last-event column
T = TypeVar("T")


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


Stamp = tuple[int, int, int] | None  # (mtime, size, inode) of a file; None: not there
RACY_S = 2.0  # a file changed this recently may change again within its mtime's tick: never kept


def file_stamp(path: Path, now: float) -> tuple[Stamp, bool]:
    """(the file's stamp, whether it may be kept): a stamp newer than RACY_S may hide a second write
    of the same size in the same mtime tick (git's "racily clean" index entries), so it is not kept."""
    try:
        st = path.stat()
    except OSError:
        return None, True
    return (st.st_mtime_ns, st.st_size, st.st_ino), st.st_mtime < now - RACY_S


class FileMemo:
    """What was parsed out of a file, parsed again only when its stamp changed. A parse that raises
    is not kept (the next call raises again, or reads what was fixed)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._kept: dict[tuple[Path, str], tuple[Stamp, Any]] = {}

    def get(self, path: Path, what: str, parse: Callable[[Path], T]) -> T:
        seen, keep = file_stamp(path, self.clock())
        kept = self._kept.get((path, what))
        if kept is not None and kept[0] == seen:
            return kept[1]
        value = parse(path)
        if keep:
            self._kept[(path, what)] = (seen, value)
        else:
            self._kept.pop((path, what), None)
        return value

    def forget(self, keep: Callable[[Path], bool]) -> None:
        """Drop what was kept of the files ``keep`` says no to (the runs gone from the list)."""
        self._kept = {k: v for k, v in self._kept.items() if keep(k[0])}


def _config(path: Path) -> Mapping[str, Any]:
    """config.yaml's values ({} when it cannot be read)."""
    try:
        values = yaml.safe_load(read_user_text(path, limit=JSON_LIMIT, what=str(path), error=value_error)) or {}
    except (OSError, ValueError, yaml.YAMLError):
        values = {}
    return values if isinstance(values, dict) else {}


def _event_tail(path: Path) -> list[dict[str, Any]]:
    return json_lines(tail_lines(path, EVENTS_TAIL), lambda r: isinstance(r.get("event"), str))[0]


def live_row(run_dir: Path, memo: FileMemo | None = None) -> LiveRow:
    """A run's row. ``memo``: what was parsed of its files before (LiveRows keeps one: a watch reads
    again only the files that changed; a config, the events, the record tail are read once per change)."""
    memo = FileMemo() if memo is None else memo
    folder = RunFolder(run_dir)
    try:
        state = memo.get(folder.state, "state", lambda _: read_state(run_dir))
        events = memo.get(folder.events, "all", lambda _: read_events(run_dir))
        view = run_view(run_dir, state=state, events=events)
    except StateError as exc:
        return LiveRow(view=RunView.unreadable(run_dir, exc.message))
    tail = memo.get(folder.events, "tail", _event_tail)
    return LiveRow(
        view=view,
        engine=engine_of(memo.get(folder.config, "config", _config), state.job.submitted, state.world_size),
        losses=memo.get(folder.records, "losses", lambda p: losses_of(tail_lines(p, RECORDS_TAIL))),
        restarts=restarts_of(events),
        last_event=event_line(tail),
    )


def stamp(run_dir: Path, now: float) -> tuple[tuple[Stamp, ...], bool]:
    """What says a run's row may have changed: the stamps of the files it is read from, and whether
    they may be kept (none written within RACY_S)."""
    folder = RunFolder(run_dir)
    seen = [file_stamp(p, now) for p in (folder.state, folder.events, folder.records, folder.config)]
    return tuple(s for s, _ in seen), all(k for _, k in seen)


class LiveRows:
    """``live_rows`` with a memory, for a watch that reads every run every second (issue 40: 40 runs
    read whole every second were most of a refresh once drawing was cheap). A run whose status is
    final (succeeded, failed, stopped, lost...) is read again only when one of its files changed: four
    stats, instead of its state, its events, two tails and its engine's status (squeue, Ray's API).
    A live run is looked at every time (its liveness, ETA and stall clock move without a write), but
    its files are parsed again only when they changed (``FileMemo``)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.memo = FileMemo(clock)
        self._final: dict[Path, tuple[tuple[Stamp, ...], LiveRow]] = {}

    def __call__(self, env: Mapping[str, str]) -> list[LiveRow]:
        out: list[LiveRow] = []
        final: dict[Path, tuple[tuple[Stamp, ...], LiveRow]] = {}
        for run_dir in list_runs(env):
            seen, keep = stamp(run_dir, self.clock())
            kept = self._final.get(run_dir)
            row = kept[1] if kept is not None and kept[0] == seen else live_row(run_dir, self.memo)
            if keep and row.view.status.is_terminal():
                final[run_dir] = (seen, row)
            out.append(row)
        self._final = final  # a run gone from the list is forgotten
        listed = {p.parent for p in final} | {Path(r.view.run_dir) for r in out}
        self.memo.forget(lambda path: path.parent in listed)
        return out


def live_rows(env: Mapping[str, str]) -> list[LiveRow]:
    return [live_row(p) for p in list_runs(env)]
