"""A full FTLAUNCH_HOME under a detached run of the real trainer (issue 31 item 1).

FTLAUNCH_HOME is a real 4 MiB tmpfs, filled while the tiny model trains: the supervisor (whose own
stderr, supervisor.log, is on that filesystem too) must keep its trainer going, count what it could not
write and say it once there is room, and leave the run's end where `status` finds it when state.json
cannot take it. Mounting a tmpfs needs root: the test skips, saying why, where it is not permitted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftlaunch.run.journal import LastWord, OutputLog, QuietStream, RunJournal, Spell, read_last_word
from ftlaunch.run.records import keep
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import read_events, read_state, write_state
from ftlaunch.run.view import run_view

from ..conftest import child_env, tiny_config, write_yaml
from .test_e2e_detached import ftl, slow_env, trainer_steps, wait_for
from .test_e2e_disk import fill, tmpfs

NOTICE = "could not be written while its folder refused writes"


def _status(name: str, env: dict) -> tuple[int, dict, str]:
    r = ftl("status", name, "--json", env=env)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout), r.stderr


def _steps(out: Path) -> list[int]:
    try:
        return trainer_steps(out)
    except (OSError, ValueError):
        return []


@pytest.mark.e2e
def test_a_detached_run_survives_a_full_home_and_ends_succeeded(tiny, tmp_path, isolated_home):
    out = tmp_path / "out"
    # 64 rows, 2 x 2 a step, 2.5 epochs: 40 steps (the fault run's length), a checkpoint every 10
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, num_train_epochs=2.5, save_steps=10))
    with tmpfs(tmp_path / "home", 4096) as home:
        env = slow_env("0.2", FTLAUNCH_HOME=str(home))
        plain = child_env(FTLAUNCH_HOME=str(home))
        r = ftl("train", str(cfg), "--json", "--name", "fullhome", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        run_dir = Path(json.loads(r.stdout)["run_dir"])
        try:
            wait_for(lambda: max(_steps(out), default=0) >= 3, timeout=240)
            # First spell: full from step 3 to step 15, then room again.
            fill(home / "filler")
            code, st, _ = _status("fullhome", plain)  # reading works on a full home
            assert code == 11 and st["status"] == "running", st
            wait_for(lambda: max(_steps(out), default=0) >= 15, timeout=240)
            os.unlink(home / "filler")
            wait_for(lambda: NOTICE in (run_dir / "train.log").read_text(errors="replace"), timeout=60)
            # Second spell: full from here to the end: state.json cannot take the run's end.
            fill(home / "filler2")
            wait_for(lambda: _status("fullhome", plain)[1]["status"] not in ("starting", "running"), timeout=300)
            code, st, _ = _status("fullhome", plain)
            assert (code, st["status"]) == (0, "succeeded"), st
            word = st["supervisor_last_word"]
            assert word["status"] == "succeeded" and "state.json could not be written" in word["cause"], word
            assert Path(word["where"]).parent == run_dir  # the room reserved at the start took it
            steps = _steps(out)
            assert steps[-1] == 40 and set(range(1, 41)) <= set(steps), steps  # the trainer did every step
            os.unlink(home / "filler2")
            r = ftl("status", "fullhome", env=plain)
            assert r.returncode == 0 and "succeeded" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
            # With room again, `resume` finds it ended: the end goes into state.json, nothing trains.
            r = ftl("resume", "fullhome", "--no-follow", env=plain)
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
            wait_for(lambda: json.loads((run_dir / "state.json").read_text())["status"] == "succeeded", timeout=60)
            assert _status("fullhome", plain)[1]["supervisor_last_word"] is None
            assert _steps(out) == steps  # not one step more
        finally:
            ftl("stop", "fullhome", env=plain)  # the mount must not be busy when it goes
        # What was lost is said once a spell ends, each spell once: never a running total.
        log = (run_dir / "train.log").read_text(errors="replace")
        notices = [line for line in log.splitlines() if NOTICE in line]
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if '"unwritten"' in x]
        assert len(notices) == len(events) == 1, (notices, events)  # the first spell; the second never had room
        assert all(n.startswith("ftlaunch: ") and "the trainer kept running" in n for n in notices)  # own line
        assert sum(e["records"] for e in events) >= 1
        assert "Traceback" not in (run_dir / "supervisor.log").read_text(errors="replace")
        print(f"notices: {notices}; events: {events}")


# ---------------------------------------------------------------- the parts, on /dev/full (ENOSPC on every write)


def _full(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/full")


def _room(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.touch()


def _run_dir(tmp_path: Path, **state) -> Path:
    run_dir = tmp_path / "runs" / "20260101-000000-abcd"
    run_dir.mkdir(parents=True)
    write_state(run_dir, RunState(id=run_dir.name, status=RunStatus.RUNNING, **state))
    return run_dir


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_what_could_not_be_written_is_counted_once_and_said_once_per_spell(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    run_dir = _run_dir(tmp_path)
    log, events = run_dir / "train.log", run_dir / "events.jsonl"
    journal = RunJournal(run_dir)
    _full(log), _full(events)
    for i in range(3):
        journal.say(f"line {i}")  # 3 records
    journal.stopping(15)  # an event: 1 record
    out = OutputLog(journal)
    out.write(b"x" * 100)  # 100 bytes of trainer output
    out.close()
    records = run_dir / "trainer_records.jsonl"
    _full(records)
    keep(run_dir, b'{"current_steps": 1}\n{"current_steps": 2}\n', journal.unwritten)  # 2 records
    _room(log), _room(events), _room(records)
    journal.say("room again")
    first = log.read_text()
    _full(log)
    journal.say("lost again")  # a second spell: counted from 0
    _room(log)
    OutputLog(journal).write(b"output again\n")  # the pump's write that goes through says it too
    notices = [line for line in (first + log.read_text()).splitlines() if NOTICE in line]
    assert len(notices) == 2, log.read_text()
    assert "6 record(s) of the run and 100 byte(s) of trainer output" in notices[0]
    assert notices[1].startswith("ftlaunch: 1 record(s) of the run could not be written"), notices[1]
    said = [(e["records"], e["output_bytes"]) for e in read_events(run_dir) if e["event"] == "unwritten"]
    assert said == [(6, 100), (1, 0)]  # one event per spell too
    assert "No space left on device" in notices[0]


def test_a_notice_after_a_torn_line_of_output_starts_a_line_of_its_own():
    torn = Spell("No space left on device (train.log)", records=1, output_bytes=5, torn=True)
    assert torn.notice().startswith("\nftlaunch: 1 record(s) of the run and 5 byte(s) of trainer output")
    assert Spell("x", records=2).notice().startswith("ftlaunch: 2 record(s) of the run could not be written")
    assert Spell("x", 1).joined(Spell("y", 2, 3, 4, True)) == Spell("x", 3, 3, 4, True)


def test_a_stream_on_a_full_disk_drops_and_counts_instead_of_raising(tmp_path):
    journal = RunJournal(tmp_path)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        stream = QuietStream(fd, journal.unwritten)
        print("a line that cannot be written", file=stream, flush=True)
    finally:
        os.close(fd)
    spell = journal.unwritten.take()
    assert spell is not None and spell.log_bytes == len("a line that cannot be written\n")


def test_a_supervisor_that_fails_leaves_its_cause_and_outlives_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_dir = _run_dir(tmp_path, output_dir=str(out))
    journal = RunJournal(run_dir)
    pid = _dead_pid()  # the failed supervisor, gone by the time `status` looks
    journal.supervising(pid, None)
    assert (run_dir / ".last-word.json").stat().st_size == 8192  # reserved while there was room
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"])
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        journal.died(exc, trainer)
    assert trainer.returncode == 3  # it waited for its trainer rather than take it down
    view = run_view(run_dir)
    assert view.status is RunStatus.LOST
    flat = " ".join(str(view.message).split())
    assert f"its supervisor (pid {pid}) failed: RuntimeError: boom" in flat, flat
    assert "its trainer ran on to its end, exit code 3" in flat and "resume" in flat
    assert view.to_json()["supervisor_last_word"]["where"] == str(run_dir / ".last-word.json")


def test_a_last_word_goes_beside_the_output_dir_or_to_the_temp_folder_when_its_room_is_gone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_dir = _run_dir(tmp_path, output_dir=str(out))
    pid = _dead_pid()
    where = LastWord(run_dir, pid, 1.5, str(out)).leave(status="succeeded", exit_code=0, message="done", cause="x")
    assert where is not None and where.parent == out  # nothing reserved in the run folder
    assert read_last_word(run_dir, str(out), pid, 1.5)["status"] == "succeeded"
    assert read_last_word(run_dir, str(out), pid, 2.5) is None  # another supervisor of the same pid
    where.unlink()
    temp = LastWord(run_dir, pid, None, None).leave(cause="RuntimeError: boom")
    try:
        assert temp is not None and run_dir.name in temp.name
        assert read_last_word(run_dir, None, pid, None)["cause"] == "RuntimeError: boom"
    finally:
        LastWord(run_dir, pid, None, None).clear()
    assert not temp.exists()


def test_an_end_left_as_a_last_word_is_written_into_the_state_by_the_next_supervisor(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_dir = _run_dir(tmp_path, output_dir=str(out))
    first = RunJournal(run_dir)
    first.supervising(_dead_pid(), None)
    first.last_word.leave(status="succeeded", exit_code=0, message="done", ended=1.0, cause="state.json ...")
    # `resume` of it: the next supervisor settles the end before anything else
    RunJournal(run_dir).settle()
    st = read_state(run_dir)
    assert (st.status, st.exit_code, st.message) == (RunStatus.SUCCEEDED, 0, "done")
    assert not (run_dir / ".last-word.json").exists()
    (ended,) = [e for e in read_events(run_dir) if e["event"] == "succeeded"]
    assert ended["settled_from"] == str(run_dir / ".last-word.json")
    assert "had ended succeeded while its folder refused writes" in (run_dir / "train.log").read_text()


def test_a_read_only_run_folder_is_counted_and_the_last_word_goes_beside_the_output_dir(tmp_path):
    mnt = tmp_path / "home"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        out = tmp_path / "out"
        out.mkdir()
        run_dir = _run_dir(mnt, output_dir=str(out))
        journal = RunJournal(run_dir)
        pid = _dead_pid()
        journal.supervising(pid, None)  # reserved while writable
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)  # EROFS from now on
        journal.say("cannot be written")
        journal.stopping(15)
        spell = journal.unwritten.take()
        assert spell is not None and spell.records == 2 and "Read-only file system" in spell.reason, spell
        where = journal.last_word.leave(cause="OSError: [Errno 30] Read-only file system")
        assert where is not None and where.parent == out  # not even the reserved blocks take a write
        assert read_last_word(run_dir, str(out), pid, None)["where"] == str(where)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
