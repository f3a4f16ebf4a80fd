"""Scheduled retraining: cron expressions, a scratch crontab, overlap, versions, pruning, notifications.

Every test runs with a stand-in `crontab` first on PATH (the real one's `-l` / `-` interface, writing
a file under tmp_path): the user's real crontab is never read or written. Runs use the scripted
tests/fake_trainer.py; one e2e test trains the tiny model with the real llamafactory-cli.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.cli.schedule import schedule_group
from ftlaunch.errors import StateError
from ftlaunch.run.options import RunOptions
from ftlaunch.schedule.cron import ScheduleError, next_fire, on_calendar, parse_cron
from ftlaunch.schedule.crontab import add_entry, entries, remove_entry
from ftlaunch.schedule.manage import ScheduleSpec, add_schedule
from ftlaunch.schedule.records import EntryStatus, HistoryEntry, ScheduleRecord
from ftlaunch.schedule.runner import run_schedule
from ftlaunch.schedule.versions import choose_prune, version_name

from ..conftest import ROOT, needs_train_stack, tiny_config, write_yaml
from ..helpers import said, wait_for

INTEGRATED = "schedule" in main.commands  # cli.py registers the group itself once integrated
if not INTEGRATED:
    main.add_command(schedule_group, "schedule")

# `python -c` entry that works before and after cli.py registers the group.
ENTRY = (
    "from ftlaunch.cli.main import main; from ftlaunch.cli.schedule import schedule_group; "
    "main.add_command(schedule_group, 'schedule'); main()"
)
FOREIGN = (
    "# m h dom mon dow command\n"
    "MAILTO=ops@example.com\n"
    "SHELL=/bin/bash\n"
    "*/5 * * * * /usr/local/bin/backup.sh --quiet >/dev/null 2>&1\n"
    "\n"
    "# 0 3 * * * /opt/old.sh  # ftlaunch-schedule:nightly (a disabled copy: a comment stays the user's)\n"
    "30 1 * * 0 echo '%weekly%'   # trailing spaces kept   \n"
    "0 4 1 * * /home/u/monthly.sh\n"
)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def scratch_crontab(tmp_path, monkeypatch) -> Path:
    """A stand-in crontab first on PATH; returns the file it keeps the table in."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tab = tmp_path / "crontab.txt"
    calls = tmp_path / "crontab.calls"
    stub = bindir / "crontab"
    stub.write_text(
        "#!/bin/sh\n"
        "# stand-in for crontab(1): -l prints the table, - replaces it from stdin\n"
        f'TAB="{tab}"\n'
        f'echo "$*" >> "{calls}"\n'
        'case "$1" in\n'
        '  -l) if [ -f "$TAB" ]; then cat "$TAB"; else echo "no crontab for $(id -un)" >&2; exit 1; fi ;;\n'
        '  -) cat > "$TAB.new" && mv "$TAB.new" "$TAB" ;;\n'
        '  *) echo "usage: crontab [-l | -]" >&2; exit 1 ;;\n'
        "esac\n"
    )
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}")
    return tab


def crontab_writes(tmp_path: Path) -> int:
    calls = tmp_path / "crontab.calls"
    return calls.read_text().splitlines().count("-") if calls.exists() else 0


@pytest.fixture
def fake_trainer(tmp_path, monkeypatch):
    """Point ftlaunch at tests/fake_trainer.py; call the returned function to script the attempts."""
    wrapper = tmp_path / "fake-llamafactory-cli"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "fake_trainer.py"} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(wrapper))
    monkeypatch.setenv("FAKE_TRAINER_COUNTER", str(tmp_path / "counter"))

    def script(*attempts: dict) -> None:
        monkeypatch.setenv("FAKE_TRAINER_SCRIPT", json.dumps(list(attempts)))

    script({"ok": True, "steps": 4})
    return script


@pytest.fixture
def project(tmp_path) -> Path:
    """A config with output_dir and a local dataset (dataset_info.json + one file)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    (data / "tiny.json").write_text(json.dumps([{"instruction": "hi", "input": "", "output": "hello"}]))
    cfg = {
        "stage": "sft",
        "do_train": True,
        "dataset": "tiny",
        "dataset_dir": str(data),
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
    }
    return write_yaml(tmp_path / "c.yaml", cfg)


def cli(*args: str) -> object:
    return CliRunner().invoke(main, ["schedule", *args])


def add(name: str, project: Path, *extra: str, cron: str = "0 2 * * *"):
    return cli("add", name, str(project), "--cron", cron, "--gpu", "A10G", *extra)


def record(home: Path, name: str) -> dict:
    return json.loads((home / "schedules" / f"{name}.json").read_text())


def snapshot(tmp_path: Path, home: Path) -> dict:
    """Everything `schedule` may change: the crontab, the registry, the runs, the outputs."""
    tab = tmp_path / "crontab.txt"
    files = {}
    for root in (home / "schedules", home / "runs", tmp_path / "out"):
        if root.exists():
            for p in sorted(root.rglob("*")):
                files[str(p)] = p.read_bytes() if p.is_file() else None
    return {"crontab": tab.read_bytes() if tab.exists() else None, "files": files}


def clock_from(start: datetime) -> Iterator[datetime]:
    t = start
    while True:
        yield t
        t += timedelta(days=1)


# ---------------------------------------------------------------- cron expressions (pure)


@pytest.mark.parametrize(
    "expr,after,expected",
    [
        ("0 2 * * *", "2026-03-01 12:34", ["2026-03-02 02:00", "2026-03-03 02:00"]),
        ("*/15 9-17 * * mon-fri", "2026-03-06 17:50", ["2026-03-09 09:00", "2026-03-09 09:15"]),  # Fri -> Mon
        ("@weekly", "2026-03-01 00:00", ["2026-03-08 00:00", "2026-03-15 00:00"]),
        ("@hourly", "2026-12-31 23:59", ["2027-01-01 00:00", "2027-01-01 01:00"]),
        ("30 4 1,15 * *", "2026-03-02 00:00", ["2026-03-15 04:30", "2026-04-01 04:30"]),
        ("0 0 29 feb *", "2026-01-01 00:00", ["2028-02-29 00:00", "2032-02-29 00:00"]),
        ("5/20 * * * *", "2026-03-01 12:45", ["2026-03-01 13:05", "2026-03-01 13:25"]),
        ("0 0 * * 7", "2026-03-01 00:00", ["2026-03-08 00:00", "2026-03-15 00:00"]),  # 7 is Sunday too
        # both day fields restricted: either matches (Vixie cron): the 13th, or any Friday
        ("0 0 13 * 5", "2026-03-01 00:00", ["2026-03-06 00:00", "2026-03-13 00:00", "2026-03-20 00:00"]),
        # a day field starting with * restricts nothing on its own: both must match
        ("0 0 */2 * 1", "2026-03-01 00:00", ["2026-03-09 00:00", "2026-03-23 00:00"]),
    ],
)
def test_next_fire(expr, after, expected):
    c = parse_cron(expr)
    t = datetime.strptime(after, "%Y-%m-%d %H:%M")
    got = []
    for _ in expected:
        t = next_fire(c, t)
        got.append(t.strftime("%Y-%m-%d %H:%M"))
    assert got == expected


@pytest.mark.parametrize(
    "expr,words",
    [
        ("0 2 * *", "4 field(s)"),
        ("0 2 * * * *", "6 field(s)"),
        ("61 * * * *", "minute: 61 is out of range 0-59"),
        ("0 24 * * *", "hour: 24"),
        ("0 2 * * 8", "day of week: 8"),
        ("*/0 * * * *", "step '0'"),
        ("5-1 * * * *", "runs backwards"),
        ("0 2 * foo *", "month: 'foo' is not a number or a name"),
        ("0 0 31 2 *", "never fires"),
        ("@reboot", "not a time"),
        ("@fortnightly", "unknown macro"),
        ("0,,5 * * * *", "empty item"),
    ],
)
def test_bad_cron_expressions_say_why(expr, words):
    with pytest.raises(ScheduleError) as e:
        parse_cron(expr)
    assert words in e.value.message and e.value.exit_code == 2


def test_every_problem_is_listed_at_once():
    with pytest.raises(ScheduleError) as e:
        parse_cron("99 99 * * *")
    assert "minute: 99" in e.value.message and "hour: 99" in e.value.message


def test_systemd_calendar_matches_cron_semantics():
    assert on_calendar(parse_cron("0 2 * * *")) == ["*-*-* 02:00:00"]
    assert on_calendar(parse_cron("*/30 9 * * mon-fri")) == ["Mon,Tue,Wed,Thu,Fri *-*-* 09:00,30:00"]
    assert on_calendar(parse_cron("0 0 13 * fri")) == ["*-*-13 00:00:00", "Fri *-*-* 00:00:00"]
    if shutil.which("systemd-analyze"):
        for expr in ("0 2 * * *", "*/15 9-17 * * mon-fri", "0 0 13 * 5", "30 4 1,15 jan,jul *"):
            for cal in on_calendar(parse_cron(expr)):
                r = subprocess.run(["systemd-analyze", "calendar", cal], capture_output=True, text=True)
                assert r.returncode == 0, (cal, r.stderr)


# ---------------------------------------------------------------- crontab text (pure)


def test_crontab_text_add_remove_is_byte_identical():
    line = "0 2 * * * /venv/bin/python -m ftlaunch schedule run nightly >> /h/n.log 2>&1 # ftlaunch-schedule:nightly"
    added = add_entry(FOREIGN, "nightly", line)
    assert added.startswith(FOREIGN) and added.endswith(line + "\n")
    assert entries(added) == {"nightly": line + "\n"}  # the commented-out copy is not ours
    assert remove_entry(added, "nightly") == (FOREIGN, 1)
    assert remove_entry(FOREIGN, "nightly") == (FOREIGN, 0)
    with pytest.raises(ScheduleError, match="already has an entry"):
        add_entry(added, "nightly", line)
    # an entry for "night" is not one for "nightly", nor the reverse
    other = line.replace("schedule:nightly", "schedule:night")
    both = add_entry(added, "night", other)
    assert remove_entry(both, "night") == (added, 1)
    # a table without a final newline gets one (cron needs it), and nothing else changes
    assert add_entry("MAILTO=x", "nightly", line) == f"MAILTO=x\n{line}\n"
    assert add_entry("", "nightly", line) == line + "\n"


def test_version_names_and_prune_choice():
    t = datetime(2026, 3, 1, 2, 0, 5, tzinfo=UTC)
    assert version_name("nightly", t) == "nightly-20260301T020005Z"
    assert version_name("nightly", t, {"nightly-20260301T020005Z"}) == "nightly-20260301T020005Z-2"
    h = [
        HistoryEntry.from_json({"t": "", **e})
        for e in [
            {"status": "succeeded", "output_dir": "/o/a"},
            {"status": "failed", "output_dir": "/o/b"},
            {"status": "skipped", "reason": "overlap"},
            {"status": "succeeded", "output_dir": "/o/c"},
            {"status": "succeeded", "output_dir": "/o/d", "pruned": True},
            {"status": "succeeded", "output_dir": "/o/e"},
            {"status": "succeeded", "output_dir": "/o/f"},
        ]
    ]
    assert choose_prune(h, 2, "/o/f") == ["/o/a", "/o/c"]
    assert choose_prune(h, 1, "/o/c") == ["/o/a", "/o/e"]  # never the latest, wherever it points
    assert choose_prune(h, None, "/o/f") == []
    assert choose_prune(h, 10, "/o/f") == []


# ---------------------------------------------------------------- add / remove through the CLI


@needs_train_stack
def test_add_remove_round_trip_leaves_foreign_lines_byte_identical(project, scratch_crontab, isolated_home):
    scratch_crontab.write_text(FOREIGN)
    r = add("nightly", project, "--keep", "3")
    assert r.exit_code == 0, r.output
    assert said("added schedule nightly", r.output)
    r = add("weekly", project, cron="@weekly")
    assert r.exit_code == 0, r.output
    text = scratch_crontab.read_text()
    assert text.startswith(FOREIGN)
    assert set(entries(text)) == {"nightly", "weekly"}
    r = cli("remove", "nightly")
    assert r.exit_code == 0 and said("crontab line removed", r.output), r.output
    assert set(entries(scratch_crontab.read_text())) == {"weekly"}
    assert scratch_crontab.read_text().startswith(FOREIGN)
    assert cli("remove", "weekly").exit_code == 0
    assert scratch_crontab.read_bytes() == FOREIGN.encode()
    assert not list((isolated_home / "schedules").glob("*.json"))


@needs_train_stack
def test_add_into_an_empty_crontab(project, scratch_crontab):
    assert not scratch_crontab.exists()  # `crontab -l` says "no crontab for ...", exit 1
    assert add("nightly", project).exit_code == 0
    assert list(entries(scratch_crontab.read_text())) == ["nightly"]
    assert cli("remove", "nightly").exit_code == 0
    assert scratch_crontab.read_text() == ""


@needs_train_stack
def test_cron_line_uses_absolute_paths_and_carries_no_secrets(project, scratch_crontab, isolated_home, monkeypatch):
    secrets = {"HF_TOKEN": "hf_SeCrEtToKeN123", "WANDB_API_KEY": "wandb-secret-456"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_ENDPOINT", "https://user:pw-secret-789@mirror.example")
    assert add("nightly", project).exit_code == 0
    line = entries(scratch_crontab.read_text())["nightly"].rstrip("\n")
    assert line.startswith("0 2 * * * ")
    assert f"FTLAUNCH_HOME={isolated_home}" in line
    assert f"{os.path.abspath(sys.executable)} -P -m ftlaunch schedule run nightly" in line
    assert f">> {isolated_home / 'schedules' / 'nightly.log'} 2>&1" in line
    assert line.endswith("# ftlaunch-schedule:nightly")
    printed = add("other", project, "--print").output
    everything = scratch_crontab.read_text() + printed + "".join(p.read_text() for p in isolated_home.rglob("*.json"))
    for value in [*secrets.values(), "pw-secret-789"]:
        assert value not in everything
    assert "HF_TOKEN" not in everything and "WANDB" not in everything


@needs_train_stack
def test_print_registers_and_prints_but_installs_nothing(project, scratch_crontab, tmp_path, isolated_home):
    scratch_crontab.write_text(FOREIGN)
    r = add("nightly", project, "--print")
    assert r.exit_code == 0, r.output
    assert scratch_crontab.read_bytes() == FOREIGN.encode() and crontab_writes(tmp_path) == 0
    out = r.stdout
    assert "schedule run nightly" in out and "# ftlaunch-schedule:nightly" in out
    assert "[Timer]\nOnCalendar=*-*-* 02:00:00\n" in out and "ExecStart=" in out
    assert said("nothing installed", r.stderr)
    assert record(isolated_home, "nightly")["installed"] == "manual"
    assert cli("remove", "nightly").exit_code == 0
    assert scratch_crontab.read_bytes() == FOREIGN.encode() and crontab_writes(tmp_path) == 0


@needs_train_stack
def test_bad_input_gets_a_clear_error_and_changes_nothing(project, scratch_crontab, tmp_path, isolated_home):
    scratch_crontab.write_text(FOREIGN)
    assert add("nightly", project).exit_code == 0
    before = snapshot(tmp_path, isolated_home)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    broken = write_yaml(tmp_path / "broken.yaml", {"stage": "sft", "bogus_key": 1, "output_dir": str(tmp_path)})
    cases = [
        (add("n2", project, cron="0 25 * * *"), 2, "hour: 25 is out of range"),
        (add("n2", project, cron="every night"), 2, "2 field(s), not 5"),
        (add("nightly", project), 2, "schedule 'nightly' already exists"),
        (add("../evil", project), 2, "is not allowed"),
        (cli("remove", "nosuch"), 6, "no schedule 'nosuch'"),
        (cli("run", "nosuch"), 6, "no schedule 'nosuch'"),
        (add("n2", project, f"output_dir={blocker}/out"), 3, "is not a directory"),
        (add("n2", broken), 3, "bogus_key"),
        (cli("add", "n2", str(tmp_path / "missing.yaml"), "--cron", "0 2 * * *"), 3, "does not exist"),
    ]
    for r, code, words in cases:
        assert r.exit_code == code, (words, r.output)
        assert said(words, r.output), (words, r.output)
        assert "Traceback" not in r.output
        assert snapshot(tmp_path, isolated_home) == before, words


@needs_train_stack
def test_read_only_output_dir_is_refused(project, tmp_path, isolated_home):
    if os.geteuid() == 0:  # root writes through permission bits: a regular file in the way stops anyone
        ro = tmp_path / "ro-file"
        ro.write_text("x")
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
    r = add("n2", project, f"output_dir={ro}/out")
    assert r.exit_code == 3 and (said("not writable", r.output) or said("cannot be created", r.output)), r.output
    assert not (isolated_home / "schedules").exists() or not list((isolated_home / "schedules").glob("*.json"))


def test_unwritable_home_is_refused(project, tmp_path, monkeypatch, scratch_crontab):
    blocker = tmp_path / "home-file"
    blocker.write_text("x")
    monkeypatch.setenv("FTLAUNCH_HOME", str(blocker / "ftl"))
    r = add("nightly", project)
    assert r.exit_code == 12 and said("FTLAUNCH_HOME", r.output), r.output
    assert not scratch_crontab.exists()


@needs_train_stack
def test_missing_crontab_executable_says_use_print(project, monkeypatch, isolated_home):
    monkeypatch.setenv("PATH", "/nonexistent")
    r = add("nightly", project)
    assert r.exit_code == 1 and said("no `crontab` executable", r.output) and said("--print", r.output)
    assert not (isolated_home / "schedules" / "nightly.json").exists()


@needs_train_stack
def test_a_refused_crontab_takes_the_record_back(project, scratch_crontab, isolated_home, tmp_path):
    (tmp_path / "bin" / "crontab").write_text(
        '#!/bin/sh\ncase "$1" in -l) exit 0;; -) echo "crontab: errors in crontab file" >&2; exit 1;; esac\n'
    )
    r = add("nightly", project)
    assert r.exit_code == 1 and said("refused", r.output)
    assert not (isolated_home / "schedules" / "nightly.json").exists()


# ---------------------------------------------------------------- runs: versions, latest, pruning


def test_versions_latest_and_pruning(project, fake_trainer, tmp_path, isolated_home):
    fake_trainer(
        {"ok": True},
        {"ok": True},
        {"config_error": "Undefined dataset foo in dataset_info.json."},
        {"ok": True},
        {"ok": True},
    )
    env = dict(os.environ)
    spec = ScheduleSpec("nightly", str(project), "0 2 * * *", keep=2, run=RunOptions(gpu="A10G"), cwd=str(tmp_path))
    add_schedule(spec, env, install=False)
    clock = clock_from(datetime(2026, 3, 1, 2, 0, tzinfo=UTC))
    out = tmp_path / "out"
    results = []
    for i in range(5):
        results.append(run_schedule("nightly", env, poll=0.05, clock=lambda: next(clock)))
        if i == 2:  # the failure leaves latest where it was and keeps its own dir
            assert os.readlink(out / "latest") == "nightly-20260302T020000Z"
    assert [r.status for r in results] == ["succeeded", "succeeded", "failed", "succeeded", "succeeded"]
    assert [r.exit_code for r in results] == [0, 0, 1, 0, 0]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["latest", "nightly-20260303T020000Z", "nightly-20260304T020000Z", "nightly-20260305T020000Z"]
    assert os.readlink(out / "latest") == "nightly-20260305T020000Z"
    assert (out / "latest" / "trainer_log.jsonl").exists()
    rec = record(isolated_home, "nightly")
    assert [h["status"] for h in rec["history"]] == ["succeeded", "succeeded", "failed", "succeeded", "succeeded"]
    assert [bool(h.get("pruned")) for h in rec["history"]] == [True, True, False, False, False]
    assert rec["last"]["final_loss"] == 0.25 and rec["latest"] == "nightly-20260305T020000Z"
    # every run is an ordinary run, named after the schedule; the failed one keeps its log
    r = CliRunner().invoke(main, ["runs", "--json"])
    runs = json.loads(r.stdout)
    assert [x["name"] for x in runs] == ["nightly"] * 5
    failed = next(x for x in runs if x["status"] == "failed")
    assert "Undefined dataset foo" in (Path(failed["run_dir"]) / "train.log").read_text()


def test_a_supervisor_that_refuses_is_recorded_and_notified(project, fake_trainer, tmp_path, isolated_home):
    from ftlaunch.errors import BusyError
    from ftlaunch.run.outdir import acquire_output_lock

    env = dict(os.environ)
    add_schedule(
        ScheduleSpec("nightly", str(project), "@daily", run=RunOptions(gpu="A10G"), notify="true"),
        env,
        install=False,
    )
    when = datetime(2026, 3, 1, 2, 0, tzinfo=UTC)
    held = acquire_output_lock(env, str(tmp_path / "out" / "nightly-20260301T020000Z"), "someone-else")
    sent = []
    try:
        with pytest.raises(BusyError):
            run_schedule("nightly", env, clock=lambda: when, notifier=lambda t, s, e: sent.append(s))
    finally:
        held.close()
    last = record(isolated_home, "nightly")["last"]
    assert last["status"] == "failed" and last["exit_code"] == 7 and "in use" in last["message"]
    assert [s["status"] for s in sent] == ["failed"]


def test_run_through_the_cli_and_list(project, fake_trainer, scratch_crontab, isolated_home):
    assert add("nightly", project).exit_code == 0
    r = cli("list", "--json")
    (row,) = json.loads(r.stdout)
    assert row["result"] is None and row["next"] and row["cron"] == "0 2 * * *"
    r = cli("run", "nightly")
    assert r.exit_code == 0, r.output
    assert said("schedule nightly: run", r.stderr) and "succeeded" in r.stderr
    (row,) = json.loads(cli("list", "--json").stdout)
    assert row["result"] == "succeeded" and row["run_id"] and row["last_run"]
    assert datetime.fromisoformat(row["next"]) > datetime.now().astimezone()
    table = cli("list").stdout
    assert "nightly" in table and "succeeded" in table


def test_two_runs_at_once_the_second_skips_with_code_7(project, fake_trainer, tmp_path, isolated_home, monkeypatch):
    gate = tmp_path / "gate"
    slow = tmp_path / "slow-llamafactory-cli"
    slow.write_text(
        f'#!/bin/sh\nwhile [ ! -e "{gate}" ]; do sleep 0.05; done\n'
        f'exec {sys.executable} {ROOT / "tests" / "fake_trainer.py"} "$@"\n'
    )
    slow.chmod(0o755)
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(slow))
    assert add("nightly", project).exit_code == 0
    first = subprocess.Popen(
        [sys.executable, "-c", ENTRY, "schedule", "run", "nightly"],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while record(isolated_home, "nightly").get("last", {}).get("status") != "running":
            assert first.poll() is None, first.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        second = cli("run", "nightly")
        assert second.exit_code == 7, second.output
        assert time.monotonic() - t0 < 5  # at once, not after the first
        assert said("already running", second.output) and said("skipped", second.output)
        skip = record(isolated_home, "nightly")["history"][-1]
        assert skip["status"] == "skipped" and skip["reason"] == "overlap"
    finally:
        gate.touch()
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out
    rec = record(isolated_home, "nightly")
    assert [h["status"] for h in rec["history"]] == ["succeeded", "skipped"]
    assert rec["last"]["status"] == "succeeded"
    assert len(list((isolated_home / "runs").iterdir())) == 1  # the skip made no run


def test_only_if_changed_skips_until_the_dataset_changes(project, fake_trainer, tmp_path, isolated_home):
    assert add("nightly", project, "--only-if-changed").exit_code == 0
    assert cli("run", "nightly").exit_code == 0
    r = cli("run", "nightly")
    assert r.exit_code == 0 and said("unchanged", r.stderr)
    rec = record(isolated_home, "nightly")
    assert rec["last"]["status"] == "skipped" and rec["last"]["reason"] == "unchanged"
    assert len(list((isolated_home / "runs").iterdir())) == 1
    (tmp_path / "data" / "tiny.json").write_text(json.dumps([{"instruction": "new", "input": "", "output": "row"}]))
    assert cli("run", "nightly").exit_code == 0
    assert record(isolated_home, "nightly")["last"]["status"] == "succeeded"
    assert len(list((isolated_home / "runs").iterdir())) == 2
    # a config change counts too
    cfg = yaml.safe_load(project.read_text())
    write_yaml(project, {**cfg, "learning_rate": 3.0e-5})
    assert cli("run", "nightly").exit_code == 0
    assert len(list((isolated_home / "runs").iterdir())) == 3


def test_a_record_keeps_what_it_does_not_know_and_refuses_another_version(project, fake_trainer, isolated_home):
    assert add("nightly", project).exit_code == 0
    path = isolated_home / "schedules" / "nightly.json"
    raw = json.loads(path.read_text())
    assert ScheduleRecord.from_json(raw, "x").to_json() == raw  # the JSON it always was
    # keys a newer minor version wrote, at the top and in a history entry, survive a run
    raw["future_key"] = {"a": 1}
    raw["history"] = [{"t": "2026-01-01T00:00:00+00:00", "status": "skipped", "reason": "overlap", "note": "x"}]
    path.write_text(json.dumps(raw))
    assert cli("run", "nightly").exit_code == 0
    rec = record(isolated_home, "nightly")
    assert rec["future_key"] == {"a": 1} and rec["history"][0]["note"] == "x"
    assert [h["status"] for h in rec["history"]] == ["skipped", "succeeded"]
    # another version is refused by run and list, and never rewritten
    rec["version"] = 2
    path.write_text(json.dumps(rec))
    before = path.read_bytes()
    r = cli("run", "nightly")
    assert r.exit_code == 12 and said("unknown version", r.output), r.output
    (row,) = json.loads(cli("list", "--json").stdout)
    assert row["result"] == "unreadable" and "unknown version" in row["message"]
    assert path.read_bytes() == before


def test_history_statuses_are_a_closed_set():
    assert EntryStatus.of_run("succeeded") is EntryStatus.SUCCEEDED
    assert EntryStatus.of_run("recovering") is EntryStatus.RUNNING  # not an end: `list` checks the run
    with pytest.raises(StateError, match="cannot read"):
        ScheduleRecord.from_json({"version": 1, "name": "n", "cron": "@daily", "config": "c", "history": [
            {"t": "", "status": "exploded"}
        ]}, "x")  # fmt: skip


def test_a_config_broken_after_add_fails_the_run_and_says_so(project, fake_trainer, tmp_path, isolated_home, receiver):
    assert add("nightly", project, "--notify", receiver.url).exit_code == 0
    (tmp_path / "data" / "dataset_info.json").unlink()
    r = cli("run", "nightly")
    assert r.exit_code == 3 and said("dataset_info.json does not exist", r.output), r.output
    last = record(isolated_home, "nightly")["last"]
    assert last["status"] == "failed" and last["exit_code"] == 3
    (msg,) = receiver.received
    assert msg["status"] == "failed" and msg["run_id"] is None and "dataset_info.json" in msg["message"]


# ---------------------------------------------------------------- notifications


class _Receiver:
    def __init__(self) -> None:
        self.received: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.headers["Content-Type"] == "application/json"
                outer.received.append(json.loads(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook/s3cr3t"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    r = _Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


def test_notifies_success_and_failure_by_http(project, fake_trainer, receiver, isolated_home):
    fake_trainer({"ok": True, "steps": 4}, {"config_error": "Undefined dataset foo."})
    assert add("nightly", project, "--notify", receiver.url).exit_code == 0
    assert cli("run", "nightly").exit_code == 0
    assert cli("run", "nightly").exit_code == 1
    ok, bad = receiver.received
    assert set(ok) >= {"status", "run_id", "schedule", "duration_s", "final_loss", "output_dir"}
    assert ok["status"] == "succeeded" and ok["schedule"] == "nightly" and ok["final_loss"] == 0.25
    assert Path(ok["output_dir"]).parent == Path(record(isolated_home, "nightly")["output_dir"])
    assert bad["status"] == "failed" and bad["exit_code"] == 1 and bad["run_id"] != ok["run_id"]
    assert "s3cr3t" not in cli("list", "--json").stdout  # a webhook's path is its secret
    assert (isolated_home / "schedules" / "nightly.json").stat().st_mode & 0o777 == 0o600
    events = (isolated_home / "runs" / ok["run_id"] / "events.jsonl").read_text()
    assert '"notified"' in events and "s3cr3t" not in events


def test_a_notifier_that_is_down_never_fails_the_run(project, fake_trainer, isolated_home):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    assert add("nightly", project, "--notify", f"http://127.0.0.1:{port}/hook").exit_code == 0
    r = cli("run", "nightly")
    assert r.exit_code == 0, r.output
    assert said("notification failed", r.stderr)
    last = record(isolated_home, "nightly")["last"]
    assert last["status"] == "succeeded" and "Connection refused" in last["notify_error"]


def test_notify_by_command_gets_the_summary_on_stdin_and_in_env(project, fake_trainer, tmp_path, isolated_home):
    got = tmp_path / "got.json"
    cmd = f'cat > {got}; echo "$FTLAUNCH_STATUS $FTLAUNCH_SCHEDULE" > {got}.env; exit 3'
    assert add("nightly", project, "--notify", cmd).exit_code == 0
    assert cli("run", "nightly").exit_code == 0  # the command's own failure is recorded, not fatal
    summary = json.loads(got.read_text())
    assert summary["status"] == "succeeded" and summary["run_id"]
    assert (tmp_path / "got.json.env").read_text().strip() == "succeeded nightly"
    assert "exited 3" in record(isolated_home, "nightly")["last"]["notify_error"]


def test_each_scheduled_run_notifies_from_its_supervisor_as_train_does(project, fake_trainer, tmp_path, isolated_home):
    """`schedule add --notify-cmd/--notify-on` (the options `train` takes) reach every run's supervisor;
    a schedule added without them keeps the record as before (no new keys)."""
    assert add("plain", project).exit_code == 0
    assert not {"notify_cmd", "notify_on"} & set(record(isolated_home, "plain"))
    got = tmp_path / "events.jsonl"
    r = add("nightly", project, "--notify-cmd", f"cat >> {got}; echo >> {got}", "--notify-on", "started,succeeded")
    assert r.exit_code == 0, r.output
    rec = record(isolated_home, "nightly")
    assert rec["notify_cmd"].startswith("cat >> ") and rec["notify_on"] == ["started", "succeeded"]
    assert cli("run", "nightly").exit_code == 0

    def events() -> list[str] | None:
        lines = [json.loads(x) for x in got.read_text().splitlines() if x.strip()] if got.exists() else []
        kinds = [m.get("event") for m in lines]
        return kinds if "succeeded" in kinds else None

    kinds = wait_for(events, "the succeeded notification")
    assert kinds[0] == "started" and set(kinds) == {"started", "succeeded"}
    assert add("bad", project, "--notify-on", "finished").exit_code == 3  # an unknown event is named


def test_a_scheduled_run_notifies_the_file_without_flags_and_a_wrong_file_fails_it_before_it_starts(
    project,
    fake_trainer,
    tmp_path,
    isolated_home,
):
    got = tmp_path / "got.txt"
    assert add("nightly", project).exit_code == 0  # no --notify-cmd: the file's destinations
    path = isolated_home / "notify.yaml"
    path.write_text(f"destinations:\n  - cmd: echo $FTLAUNCH_EVENT >> {got}\n    on: [started, succeeded]\n")
    assert cli("run", "nightly").exit_code == 0
    wait_for(lambda: got.exists() and "succeeded" in got.read_text(), "the file's command")
    assert got.read_text().split() == ["started", "succeeded"]
    runs = sorted(p.name for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    path.write_text("destinations:\n  - cmd: echo hi\n    on: [finished]\n")
    r = cli("run", "nightly")
    assert r.exit_code == 19, r.output
    assert sorted(p.name for p in (isolated_home / "runs").iterdir() if not p.name.startswith(".")) == runs
    last = record(isolated_home, "nightly")["last"]
    assert last["status"] == "failed" and "destinations (entry 1): on: unknown event(s) finished" in last["message"]


# ---------------------------------------------------------------- what cron runs


@pytest.mark.skipif(not INTEGRATED, reason="ftlaunch.cli.main does not register `schedule` yet")
def test_the_installed_line_runs_under_crons_bare_environment(project, fake_trainer, scratch_crontab, isolated_home):
    assert add("nightly", project).exit_code == 0
    line = entries(scratch_crontab.read_text())["nightly"]
    command = line.split(None, 5)[5].replace("\\%", "%")  # what cron hands to /bin/sh
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "SHELL": "/bin/sh"}
    env.update({k: os.environ[k] for k in ("FAKE_TRAINER_SCRIPT", "FAKE_TRAINER_COUNTER")})
    r = subprocess.run(["/bin/sh", "-c", command], env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert record(isolated_home, "nightly")["last"]["status"] == "succeeded"
    assert "succeeded" in (isolated_home / "schedules" / "nightly.log").read_text()


@pytest.mark.e2e
def test_e2e_scheduled_run_trains_the_tiny_model(tiny, tmp_path, isolated_home, scratch_crontab):
    out = tmp_path / "models"
    data = shutil.copytree(tiny / "data", tmp_path / "data")  # the session's tiny data stays untouched
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out, save_steps=1000, dataset_dir=str(data)))
    r = cli("add", "tiny", str(cfg), "--cron", "@daily", "--keep", "1", "--only-if-changed")
    assert r.exit_code == 0, r.output
    for _ in range(2):  # two real runs: the second one is not skipped only because we touch the data
        run = subprocess.run(
            [sys.executable, "-c", ENTRY, "schedule", "run", "tiny"],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        info = data / "dataset_info.json"
        info.write_text(info.read_text() + "\n")
    versions = [p for p in out.iterdir() if p.name.startswith("tiny-")]
    assert len(versions) == 1  # --keep 1 pruned the first
    assert (out / "latest").resolve() == versions[0].resolve()
    assert (out / "latest" / "model.safetensors").exists()
    rec = record(isolated_home, "tiny")
    assert [h["status"] for h in rec["history"]] == ["succeeded", "succeeded"]
    assert isinstance(rec["last"]["final_loss"], float)
