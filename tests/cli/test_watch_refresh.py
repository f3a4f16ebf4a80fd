"""What a refresh of `ftlaunch runs --watch` costs (issue 40 item 8: 29-33% of a core with 42 runs, the
whole view drawn once per run left out): one draw per refresh, the runs that fit counted by the tables'
layout (checked here against drawing, run by run), and a run whose status is final not read again
until one of its files changes (real run folders, a real supervisor process that dies)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console

from ftlaunch.cli.watch import Screen, _cells, fitting, live_view, watch_runs
from ftlaunch.run.live import RACY_S, LiveRow, LiveRows
from ftlaunch.run.procs import start_time
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import RunFolder, write_state
from ftlaunch.run.view import CostView, RunView

NOW = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


def rows(n: int, step: int = 100, long_every: int = 3) -> list[LiveRow]:
    """``n`` runs, oldest first; every ``long_every``-th one's last event wraps over two or three lines."""
    out = []
    for i in range(n):
        event = "10:11:58 retry retrying after a CUDA out of memory error with a smaller micro-batch [1/3]"
        event = event * (1 + (i % long_every == 0)) if long_every else "10:11:58 checkpoint step 8"
        view = RunView(
            id=f"20261202-10{i // 60:02d}{i % 60:02d}-ab{i:02d}",
            status=RunStatus.RUNNING if i % 2 else RunStatus.SUCCEEDED,
            run_dir=f"/runs/{i}",
            name=f"nightly-{i}",
            step=step,
            total_steps=60000,
            loss=0.43125,
            eta_seconds=3700,
            cost=CostView(tokens_per_second=12345.0),
        )
        out.append(LiveRow(view=view, engine="lf-v0 local", losses=(2.0, 1.5, 1.2), restarts=i % 4, last_event=event))
    return out


def console(width: int = 80, height: int = 40) -> Console:
    return Console(width=width, height=height, force_terminal=True, color_system=None, file=io.StringIO())


def drawn_height(con: Console, shown: list[LiveRow], hidden: int) -> int:
    return len(con.render_lines(live_view(shown, NOW, hidden=hidden), pad=False))


@pytest.mark.parametrize(("width", "height"), [(80, 40), (80, 24), (120, 30), (100, 60), (80, 12)])
def test_the_layouts_count_is_what_drawing_finds(width, height):
    """``fitting`` (no drawing) keeps exactly as many runs as drawing them one by one would: the most
    that fit, and one more would not."""
    all_rows = rows(42)
    con = console(width, height)
    k = fitting([_cells(r) for r in all_rows], width, height - 1, NOW)
    n = len(all_rows)
    assert 1 <= k < n
    assert drawn_height(con, all_rows[n - k :], n - k) <= height - 1
    assert drawn_height(con, all_rows[n - k - 1 :], n - k - 1) > height - 1


def test_one_draw_per_refresh_with_40_runs_moving_or_idle():
    """watch_runs with an injected console, reader and draw: 40 runs, each refresh drawn once, the
    newest that fit shown whole within the height, the title saying how many are left out."""
    con = console(80, 40)
    drawn: list[object] = []

    def render(renderable):
        drawn.append(renderable)
        return con.render_lines(renderable, pad=False)

    refreshes = iter([rows(40, step=100), rows(40, step=101), rows(40, step=101), rows(40, step=101)])
    frames: list[int] = []

    def read(env):
        try:
            found = next(refreshes)
        except StopIteration:
            raise KeyboardInterrupt from None
        frames.append(len(drawn))
        return found

    watch_runs({}, interval=0, stdin=io.StringIO(), console=con, rows=read, render=render)
    assert frames == [0, 1, 2, 3] and len(drawn) == 4  # one draw per refresh, moving (1, 2) or not (3, 4)

    screen = Screen(con)
    frame = screen.frame(rows(40), NOW)
    assert len(frame.lines) <= 39
    text = ["".join(s.text for s in line) for line in frame.lines]
    shown = [x for x in text if re.match(r"^20261202-\S+ +(running|succeeded) +100/60000 ", x)]
    hidden = 40 - len(shown)
    assert f"; {hidden} older not shown" in text[0] and hidden > 0
    assert any(x.startswith("20261202-100039-ab39") for x in text)  # the newest stays


def test_an_idle_screen_draws_only_its_title_again():
    """The same runs again (idle): the body's lines are kept, the title (its clock) is drawn anew."""
    con = console(80, 40)
    drawn: list[object] = []

    def render(renderable):
        drawn.append(type(renderable).__name__)
        return con.render_lines(renderable, pad=False)

    screen = Screen(con, render)
    first = screen.frame(rows(40), NOW)
    later = screen.frame(rows(40), NOW.replace(second=7))
    assert drawn == ["Group", "Para"]
    assert first.lines[1:] == later.lines[1:] and first.lines[0] != later.lines[0]
    assert "10:00:07" in "".join(s.text for s in later.lines[0])


def test_a_narrow_console_stacks_and_still_fits():
    con = console(50, 30)
    frame = Screen(con).frame(rows(12), NOW)
    assert 1 <= len(frame.lines) <= 29


# -- reading: real run folders ---------------------------------------------------------------------


def _run(home: Path, run_id: str, **state) -> Path:
    d = home / "runs" / run_id
    d.mkdir(parents=True)
    write_state(d, RunState(id=run_id, **state))
    RunFolder(d).events.write_text('{"event": "created", "t": "2026-12-02T10:00:00Z"}\n')
    return d


def _age(run_dir: Path, seconds: float = 60.0) -> None:
    """Every file of the run last written ``seconds`` ago (older than RACY_S: its stamp can be kept)."""
    t = datetime.now(UTC).timestamp() - seconds
    for p in run_dir.iterdir():
        os.utime(p, (t, t))


def _rewrite_in_place(path: Path, old: str, new: str) -> None:
    """Change ``old`` to ``new`` (same length) in place, then give the file its mtime back: a change
    no stamp can see, so only a row that was not read again still says ``old``."""
    st = path.stat()
    text = path.read_text()
    assert len(old) == len(new) and old in text
    with open(path, "r+") as f:
        f.write(text.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_ino == st.st_ino


def test_a_final_run_is_not_read_again_until_a_file_changes(isolated_home):
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    d = _run(isolated_home, "20261202-100000-aaaa", status=RunStatus.FAILED, message="boom-aaaa")
    _age(d)
    reader = LiveRows()
    assert [r.view.message for r in reader(env)] == ["boom-aaaa"]
    _rewrite_in_place(d / "state.json", "boom-aaaa", "boom-bbbb")
    assert [r.view.message for r in reader(env)] == ["boom-aaaa"]  # not read again: kept
    assert [r.view.message for r in LiveRows()(env)] == ["boom-bbbb"]  # (a fresh reader reads it)
    # a real change (a new state, replaced atomically as the journal does) is seen at once
    write_state(d, RunState(id=d.name, status=RunStatus.FAILED, message="boom-cccc"))
    assert [r.view.message for r in reader(env)] == ["boom-cccc"]
    # a file written within RACY_S is never kept: an unseen same-size change is still read
    _rewrite_in_place(d / "state.json", "boom-cccc", "boom-dddd")
    assert [r.view.message for r in reader(env)] == ["boom-dddd"]
    assert RACY_S <= 5


def test_a_live_run_is_looked_at_every_refresh(isolated_home):
    """Nothing in its folder changes when its supervisor dies: the next refresh says lost anyway."""
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    sup = subprocess.Popen(["sleep", "600"])
    try:
        d = _run(
            isolated_home, "20261202-100000-bbbb", status=RunStatus.RUNNING, pid=sup.pid, pid_start=start_time(sup.pid)
        )
        _age(d)
        reader = LiveRows()
        assert [r.view.status for r in reader(env)] == [RunStatus.RUNNING]
        assert [r.view.status for r in reader(env)] == [RunStatus.RUNNING]
    finally:
        sup.kill()
        sup.wait()
    assert [r.view.status for r in reader(env)] == [RunStatus.LOST]


def test_events_are_counted_whole_once_per_change(isolated_home):
    """Restarts are every retry in events.jsonl (not only its tail), read again when it grows."""
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    d = _run(isolated_home, "20261202-100000-cccc", status=RunStatus.FAILED, message="x")
    filler = "".join(json.dumps({"event": "progress", "step": i, "pad": "x" * 200}) + "\n" for i in range(200))
    RunFolder(d).events.write_text(json.dumps({"event": "retry"}) + "\n" + filler)  # the retry far from the tail
    _age(d)
    reader = LiveRows()
    assert [r.restarts for r in reader(env)] == [1]
    with open(RunFolder(d).events, "a") as f:
        f.write(json.dumps({"event": "retry", "t": "2026-12-02T10:05:00Z", "message": "again"}) + "\n")
    row = reader(env)[0]
    assert row.restarts == 2 and row.last_event.endswith("retry again")
