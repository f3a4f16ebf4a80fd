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
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import IO, Any

from rich.console import Console, ConsoleOptions, Group
from rich.segment import Segment
from rich.text import Text

from ftlaunch.cli.render import fmt_seconds
from ftlaunch.present.tables import INDENT, Col, Grid, Para, kv_table, wrap
from ftlaunch.run.live import LiveRow, LiveRows, sparkline

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


def _cells(r: LiveRow) -> tuple[tuple[str, ...], tuple[str, str]]:
    """A run's numbers (the grid's cells) and its (id, name · engine · restarts · last event)."""
    v = r.view
    numbers = (
        v.id,
        v.status.value,
        f"{v.step if v.step is not None else 0}/{v.total_steps}" if v.total_steps else "-",
        _loss(r),
        _rate(v.cost.tokens_per_second),
        fmt_seconds(v.eta_seconds),
    )
    return numbers, (v.id, f"{v.name or '-'} · {r.engine} · restarts {r.restarts} · {r.last_event}")


Cells = tuple[tuple[str, ...], tuple[str, str]]


def _title(shown: int, hidden: int, now: datetime | None) -> str:
    stamp = (now or datetime.now(UTC)).strftime("%H:%M:%S")
    title = f"{shown + hidden} run(s), {stamp} UTC; q or Ctrl-C leaves"
    return title + (f"; {hidden} older not shown" if hidden else "")


def _numbers(cells: list[Cells]) -> Grid:
    g = Grid(
        Col("id"),
        Col("status"),
        Col("step", justify="right"),
        Col("loss"),
        Col("tok/s", justify="right"),
        Col("ETA", justify="right"),
    )
    for numbers, _ in cells:
        g.add_row(*numbers)
    return g


def _about(cells: list[Cells]) -> Grid:
    return kv_table(None, [about for _, about in cells] or [("-", "no runs")])


def _body(cells: list[Cells]) -> Group:
    return Group(_numbers(cells), Text(""), _about(cells))


def live_view(rows: list[LiveRow], now: datetime | None = None, hidden: int = 0) -> Group:
    """The screen of ``rows`` (oldest first): the title, a grid of numbers, then each run's name,
    engine and last event."""
    return Group(Para(_title(len(rows), hidden, now)), _body([_cells(r) for r in rows]))


def layout(cells: list[Cells], width: int) -> tuple[int, list[int]]:
    """The lines ``_body(cells)`` takes at ``width``, from the tables' own layout (no drawing): (lines
    besides the runs', each run's lines). A grid of words is its header, its rule and one line a run;
    the about table's rows are as tall as their wrapped values. A stacked grid (a narrow console) is
    reckoned a line per cell and one between runs; the screen checks what it drew anyway."""
    numbers, about = _numbers(cells), _about(cells)
    if numbers.widths(width) is not None:
        fixed, each = 2, 1
    else:
        fixed, each = -1, len(numbers.cols) + 1
    heights = _about_heights(about, width)
    if not cells:
        return fixed + 1 + sum(heights) + 1, []
    return fixed + 1, [each + h for h in heights]


def _about_heights(about: Grid, width: int) -> list[int]:
    widths = about.widths(width)
    if widths is None:  # stacked: the label, then the value indented below it
        return [1 + len(wrap(str(value), "prose", width - INDENT)) for _, value in about.rows]
    return [max(len(wrap(str(c), "prose", w)) for c, w in zip(row, widths, strict=True)) for row in about.rows]


def fitting(cells: list[Cells], width: int, height: int, now: datetime) -> int:
    """How many of the newest runs fit ``height`` lines with the title: counted by the tables' layout,
    not by drawing (issue 40: drawing the view once per run left out cost 30% of a core at 42 runs).
    A first count from every run's layout, then checked with the layout of the runs it keeps (their
    columns may be narrower), one more or one fewer until it holds."""
    n = len(cells)
    if n <= 1:
        return n
    memo: dict[int, bool] = {}

    def fits(k: int) -> bool:
        if k not in memo:
            fixed, rows = layout(cells[n - k :], width)
            memo[k] = len(wrap(_title(k, n - k, now), "prose", width)) + fixed + sum(rows) <= height
        return memo[k]

    fixed, rows = layout(cells, width)
    k, used = 0, len(wrap(_title(n, 0, now), "prose", width)) + fixed
    while k < n and used + rows[n - 1 - k] <= height:
        used += rows[n - 1 - k]
        k += 1
    k = max(k, 1)
    while k > 1 and not fits(k):
        k -= 1
    while k < n and fits(k + 1):
        k += 1
    return k


class Drawn:
    """Lines already drawn, handed to rich's Live as they are (Live draws nothing again)."""

    def __init__(self, lines: list[list[Segment]]) -> None:
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Segment]:
        for line in self.lines:
            yield from line
            yield Segment.line()


class Screen:
    """The watch's screen at one console's size, drawn once per refresh: the runs that fit are
    counted by the tables' layout (``fitting``), then drawn in one pass; when the runs shown are as
    they were (idle runs), only the title (its clock) is drawn again. ``render`` draws a renderable
    into lines (a test counts the draws through it)."""

    def __init__(self, console: Console, render: Callable[[Any], list[list[Segment]]] | None = None) -> None:
        self.console = console
        self.render = render or (lambda r: console.render_lines(r, pad=False))
        self._body: tuple[Any, list[list[Segment]]] | None = None
        self._fit: tuple[Any, int] | None = None

    def _fitting(self, cells: list[Cells], width: int, room: int, now: datetime) -> int:
        """``fitting``, counted again only when the runs or the console's size changed (the title's
        clock does not change its lines: HH:MM:SS is always 8 columns)."""
        key = (width, room, cells)
        if self._fit is None or self._fit[0] != key:
            self._fit = (key, fitting(cells, width, room, now))
        return self._fit[1]

    def frame(self, rows: list[LiveRow], now: datetime | None = None) -> Drawn:
        cells = [_cells(r) for r in rows]
        width, room, now = self.console.width, self.console.height - 1, now or datetime.now(UTC)
        k = self._fitting(cells, width, room, now)
        while True:
            shown = cells[len(cells) - k :]
            title = _title(k, len(cells) - k, now)
            if self._body is not None and self._body[0] == (width, shown):
                lines = self.render(Para(title)) + self._body[1]
            else:
                lines = self.render(Group(Para(title), _body(shown)))
                self._body = ((width, shown), lines[len(wrap(title, "prose", width)) :])
            if k <= 1 or len(lines) <= room:
                return Drawn(lines)
            k -= 1  # the layout's count was wrong (a stacked grid): one fewer, drawn again


def fitted_view(console: Console, rows: list[LiveRow], now: datetime | None = None) -> Drawn:
    """The newest runs whose view fits the console's height (nothing is cut, so older runs are left
    out instead, and the title says how many), drawn once."""
    return Screen(console).frame(rows, now)


def watch_runs(
    env: Mapping[str, str],
    interval: float = 1.0,
    *,
    stdin: IO[str] | None = None,
    console: Console | None = None,
    rows: Callable[[Mapping[str, str]], list[LiveRow]] | None = None,
    render: Callable[[Any], list[list[Segment]]] | None = None,
) -> None:
    """Redraw every ``interval`` seconds until `q` (or Esc) on a terminal, or Ctrl-C anywhere. ``rows``
    reads the runs (default: a LiveRows, which reads again only what changed)."""
    from rich.live import Live

    stdin = sys.stdin if stdin is None else stdin
    console = console or Console()
    rows = rows or LiveRows()
    screen = Screen(console, render)
    fd = _fileno(stdin)
    saved = _cbreak(fd)
    try:
        with Live(console=console, auto_refresh=False, transient=False, redirect_stdout=False) as live:
            while True:
                found = rows(env)
                _notice_lost(env, found)
                live.update(screen.frame(found), refresh=True)
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
