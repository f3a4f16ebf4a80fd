"""`ftlaunch runs --watch` read back from a real 80-column terminal (tmux), with 5 runs of the scripted
trainer (tests/fake_trainer.py) going at once under their real, detached supervisors; its CPU use
while watching is measured with psutil (printed: run with -s to see it)."""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime

import psutil
import pytest
from click.testing import CliRunner
from rich.console import Console

from ftlaunch.cli.main import main
from ftlaunch.cli.watch import fitted_view
from ftlaunch.run.live import SPARK, LiveRow, engine_of, event_line, losses_of, restarts_of, sparkline
from ftlaunch.run.state import RunStatus
from ftlaunch.run.view import CostView, RunView

from ..fake_trainer import write_config
from ..helpers import said, wait_for
from ..run.test_reliability import fake  # noqa: F401  (the scripted trainer, in-process)

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_pure_parts():
    assert sparkline([3.0, 2.0, 1.0]) == "█▄▁" and sparkline([]) == "" and sparkline([1.0, 1.0]) == "▁▁"
    assert len(sparkline(range(20), 6)) == 6
    recs = b'{"ftlaunch_attempt": 1}\n{"current_steps": 1, "loss": 2.5}\n{"current_steps": 2}\nnot json\n'
    assert losses_of(recs) == (2.5,)
    events = [{"event": "retry"}, {"event": "checkpoint", "step": 8, "t": "2026-12-02T10:11:58Z"}]
    assert restarts_of(events) == 1 and event_line(events) == "10:11:58 checkpoint step 8"
    assert engine_of({"micro_batch_size": 2, "deepspeed": "z3.json"}, False, 4) == "lf-v1 torchrun×4 ds"
    assert engine_of({"per_device_train_batch_size": 2}, True, 1) == "lf-v0 slurm"


def test_the_numbers_stay_a_grid_at_80_columns_and_older_runs_give_way_to_the_height():
    """The widest values each column can hold side by side at 80 columns, and more runs than fit."""
    rows = [
        LiveRow(
            view=RunView(
                id=f"20261202-10105{i}-ab1{i}",
                status=RunStatus.NO_PROGRESS,
                run_dir="/x",
                name=f"nightly-{i}",
                step=12345,
                total_steps=60000,
                loss=0.43125,
                eta_seconds=370250,
                cost=CostView(tokens_per_second=123456.0),
            ),
            engine="lf-v0 torchrun×8 ds",
            losses=(2.0, 1.5, 1.2, 1.0, 0.8, 0.7, 0.6),
            restarts=12,
            last_event="10:11:58 retry retrying after a CUDA out of memory error with a smaller micro-batch [1/3]",
        )
        for i in range(9)
    ]
    console = Console(width=80, height=24, force_terminal=True, color_system=None, record=True, file=io.StringIO())
    console.print(fitted_view(console, rows, datetime(2026, 12, 2, tzinfo=UTC)))
    lines = console.export_text().splitlines()
    assert len(lines) <= 24 and max(len(x) for x in lines) <= 80
    row = re.compile(r"^2026\S+ +no_progress +12345/60000 +\S+ 0\.431 +123\.5k +102h50m$")
    shown = [x for x in lines if row.match(x.rstrip())]
    assert 1 <= len(shown) < 9 and "older not shown" in lines[0]
    assert shown[-1].startswith("20261202-101058-ab18")  # the newest stay
    assert said("nightly-8 · lf-v0 torchrun×8 ds · restarts 12 · 10:11:58 retry retrying after", "\n".join(lines))


def _tmux(sock: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=20).stdout


def _screen(sock: str) -> str:
    return _tmux(sock, "capture-pane", "-p", "-t", "watch")


def test_five_live_runs_whole_at_80_columns_refreshed_in_place_and_q_leaves(tmp_path, fake, isolated_home):  # noqa: F811
    fake({"train": True, "steps": 300, "save_steps": 50, "step_sleep": 0.2})
    ids = []
    try:
        for i in range(5):
            d = tmp_path / f"r{i}"
            d.mkdir()
            r = cli("train", str(write_config(d)), "--gpu", "A10G", "--name", f"watch-{i}", "--json")
            assert r.exit_code == 0, r.output
            ids.append(json.loads(r.stdout)["id"])
        sock = f"ftlaunch-test-{os.getpid()}-{secrets.token_hex(3)}"
        # The pane is the terminal: its own 80 columns, not a COLUMNS/LINES the test run may carry.
        cmd = f"exec env -u COLUMNS -u LINES {sys.executable} -m ftlaunch runs --watch --interval 1"
        _tmux(sock, "-f", "/dev/null", "new-session", "-d", "-s", "watch", "-x", "80", "-y", "40", cmd)
        try:
            _tmux(sock, "set-option", "-t", "watch", "remain-on-exit", "on")
            _tmux(sock, "set-option", "-t", "watch", "status", "off")
            pid = int(_tmux(sock, "display-message", "-p", "-t", "watch", "#{pane_pid}").strip())

            def all_running() -> str | None:
                s = _screen(sock)
                rows = [x for x in s.splitlines() if re.match(r"^\d{8}-\d{6}-\w+ +running +\d+/300 ", x)]
                ok = all(s.count(i) == 2 for i in ids) and len(rows) == 5 and any(c in s for c in SPARK)
                return s if ok else None

            first = wait_for(all_running, "5 running runs on the watch screen")
            lines = first.splitlines()
            assert max(len(x.rstrip()) for x in lines) <= 80
            header = [x for x in lines if re.match(r"^id +status +step +loss +tok/s +ETA$", x.rstrip())]
            assert len(header) == 1, first  # a grid, not stacked
            rows = [x for x in lines if re.match(r"^\d{8}-\d{6}-\w+ +running +\d+/300 ", x)]
            assert len(rows) == 5, first
            for i in range(5):
                assert re.search(rf"{ids[i]} +watch-{i} · lf-v0 local · restarts 0 · ", first), first
            # CPU while watching: the watcher's own process, over 10 s of 1 s redraws
            proc = psutil.Process(pid)
            t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
            time.sleep(10)
            cpu = (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
            print(f"\nruns --watch CPU while watching 5 runs: {cpu * 100:.1f}% of one core")
            assert cpu < 0.5
            later = _screen(sock)
            assert later != first  # redrawn: the steps moved
            history = _tmux(sock, "capture-pane", "-p", "-S", "-", "-t", "watch")
            assert sum(1 for x in history.splitlines() if x.startswith("id ")) == 1  # in place, no scroll
            _tmux(sock, "send-keys", "-t", "watch", "q")
            psutil.wait_procs([proc], timeout=15)
            assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
            last = _screen(sock)
            assert "Traceback" not in last and all(i in last for i in ids)  # the last view stays
            # Ctrl-C leaves as well, without a traceback
            _tmux(sock, "respawn-pane", "-k", "-t", "watch", cmd)

            def title() -> str:
                return next((x for x in _screen(sock).splitlines() if "run(s)," in x), "")

            seen = {title()}  # the dead pane's last view stays until the new watch draws: wait for 2 redraws
            wait_for(lambda: seen.add(title()) or len(seen) >= 3, "the watch redrawn again")
            _tmux(sock, "send-keys", "-t", "watch", "C-c")
            wait_for(lambda: _tmux(sock, "list-panes", "-F", "#{pane_dead}").strip() == "1", "exit on Ctrl-C")
            assert "Traceback" not in _screen(sock)
        finally:
            _tmux(sock, "kill-server")
    finally:
        for run_id in ids:
            cli("stop", run_id, "--grace", "5")
