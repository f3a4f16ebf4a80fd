"""`ftlaunch runs --watch`: every run at a glance, redrawn in place (rich Live) until `q` or Ctrl-C.

The rows come from ftlaunch.run.live (run folders only: no torch); the tables follow the one rule of
ftlaunch/present/tables.py (nothing cut; a grid when it fits, else stacked). Numbers sit in one grid
(id, status, step/total, loss sparkline, tokens/s, ETA); each run's name, engine, restarts and last
event, which are prose, in a second one below, so the whole view fits 80 columns (the widest numbers
each column can hold side by side: tests/cli/test_watch.py).
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import IO

from rich.console import Console, Group
from rich.text import Text

from ftlaunch.cli.render import fmt_seconds
from ftlaunch.present.tables import Col, Grid, kv_table
from ftlaunch.run.live import LiveRow, live_rows, sparkline

SPARK_WIDTH = 6  # with a 3-digit loss, the numbers' grid stays within 80 columns
QUIT_KEYS = (b"q", b"Q", b"\x1b")


def _rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v < 1000 else f"{v / 1000:.1f}k" if v < 1e6 else f"{v / 1e6:.1f}M"


def _loss(r: LiveRow) -> str:
    loss = r.view.loss
    spark = sparkline(r.losses, SPARK_WIDTH)
    value = f"{loss:.3g}" if isinstance(loss, (int, float)) else "-"
    return f"{spark} {value}" if spark else value


def live_view(rows: list[LiveRow], now: datetime | None = None, hidden: int = 0) -> Group:
    """The screen of ``rows`` (oldest first): a grid of numbers, then each run's name, engine and
    last event."""
    stamp = (now or datetime.now(UTC)).strftime("%H:%M:%S")
    title = f"{len(rows) + hidden} run(s), {stamp} UTC; q or Ctrl-C leaves"
    if hidden:
        title += f"; {hidden} older not shown"
    g = Grid(
        Col("id"),
        Col("status"),
        Col("step", justify="right"),
        Col("loss"),
        Col("tok/s", justify="right"),
        Col("ETA", justify="right"),
        title=title,
    )
    for r in rows:
        v = r.view
        g.add_row(
            v.id,
            v.status.value,
            f"{v.step if v.step is not None else 0}/{v.total_steps}" if v.total_steps else "-",
            _loss(r),
            _rate(v.cost.tokens_per_second),
            fmt_seconds(v.eta_seconds),
        )
    about = kv_table(
        None,
        [(r.view.id, f"{r.view.name or '-'} · {r.engine} · restarts {r.restarts} · {r.last_event}") for r in rows]
        or [("-", "no runs")],
    )
    return Group(g, Text(""), about)


def fitted_view(console: Console, rows: list[LiveRow], now: datetime | None = None) -> Group:
    """The newest runs whose view fits the console's height (measured as rendered: nothing is cut,
    so older runs are left out instead, and the title says how many)."""
    shown = list(rows)
    while True:
        view = live_view(shown, now, hidden=len(rows) - len(shown))
        if len(shown) <= 1 or len(console.render_lines(view, pad=False)) <= console.height - 1:
            return view
        shown = shown[1:]


def watch_runs(
    env: Mapping[str, str],
    interval: float = 1.0,
    *,
    stdin: IO[str] | None = None,
    console: Console | None = None,
    rows: Callable[[Mapping[str, str]], list[LiveRow]] = live_rows,
) -> None:
    """Redraw every ``interval`` seconds until `q` (or Esc) on a terminal, or Ctrl-C anywhere."""
    from rich.live import Live

    stdin = sys.stdin if stdin is None else stdin
    console = console or Console()
    fd = _fileno(stdin)
    saved = _cbreak(fd)
    try:
        with Live(console=console, auto_refresh=False, transient=False, redirect_stdout=False) as live:
            while True:
                found = rows(env)
                _notice_lost(env, found)
                live.update(fitted_view(console, found), refresh=True)
                if _quit_pressed(fd, interval):
                    break
    except KeyboardInterrupt:
        pass
    finally:
        _restore(fd, saved)


def _notice_lost(env: Mapping[str, str], rows: list[LiveRow]) -> None:
    """As `status` does: a lost run's destinations are told once (ftlaunch.run.notify.notice_lost)."""
    lost = [r.view for r in rows if r.view.status.value == "lost"]
    if lost:
        from pathlib import Path

        from ftlaunch.run.notify import notice_lost

        for v in lost:
            notice_lost(Path(v.run_dir), env, v.pid)


def _fileno(stream: IO[str]) -> int | None:
    try:
        return stream.fileno() if stream.isatty() else None
    except (AttributeError, ValueError, OSError):
        return None


def _cbreak(fd: int | None) -> list | None:
    """Keys arrive one by one, unechoed (Ctrl-C still interrupts); the old settings to restore."""
    if fd is None:
        return None
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    return saved


def _restore(fd: int | None, saved: list | None) -> None:
    if fd is not None and saved is not None:
        import termios

        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _quit_pressed(fd: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` for a key; True when it is a quit key."""
    if fd is None:
        time.sleep(timeout)
        return False
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            key = os.read(fd, 1)
            if key in QUIT_KEYS or key == b"":  # b"": the terminal went away
                return True
    return False
