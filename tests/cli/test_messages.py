"""Messages that say what happened and what to do (issue 24, part 3): each test does what the user
did, through the command line, and reads the message, the hint and the exit code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from click.testing import CliRunner

from ftlaunch.cli.main import main

from ..conftest import needs_train_stack, tiny_config, write_yaml
from ..fake_trainer import install, write_config
from ..helpers import said
from ..run.test_races import wait_for


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def ftl(*args: str, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """The real command line in a child process (the supervisor it starts outlives it)."""
    return subprocess.run(
        [sys.executable, "-m", "ftlaunch", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def fake_env(tmp_path: Path, script: list[dict]) -> dict:
    env = dict(os.environ)
    env.update(
        FTLAUNCH_LLAMAFACTORY_CLI=str(install(tmp_path)),
        FAKE_TRAINER_SCRIPT=json.dumps(script),
        FAKE_TRAINER_COUNTER=str(tmp_path / "counter"),
    )
    return env


# ---------------------------------------------------------------- a lost run


def test_a_lost_run_says_it_is_lost_and_that_resume_continues_it(tmp_path):
    """The trainer crashed, the supervisor wrote "retrying ..." and started attempt 2, then the
    machine went down (supervisor and trainer SIGKILLed): status must not still say "retrying"."""
    env = fake_env(tmp_path, [{"crash": "boom"}, {"sleep": 120}])
    r = ftl("train", str(write_config(tmp_path)), "--gpu", "A10G", "--json", env=env)
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)
    state_path = Path(run["run_dir"]) / "state.json"

    def attempt_two_running() -> dict | None:
        st = json.loads(state_path.read_text())
        ok = st.get("attempt") == 2 and st.get("trainer_pid") and "retrying" in (st["message"] or "")
        # attempt 2's own trainer: until it starts, state may still name attempt 1's (dead) one
        return st if ok and psutil.pid_exists(st["trainer_pid"]) else None

    st = wait_for(attempt_two_running)
    for pid in (st["pid"], st["trainer_pid"]):  # a reboot, in effect: nothing more is recorded
        with contextlib.suppress(ProcessLookupError):  # the trainer may die with its supervisor
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: ftl("status", run["id"], "--json", env=env).returncode == 1)

    s = ftl("status", run["id"], "--json", env=env)
    view = json.loads(s.stdout)
    assert view["status"] == "lost"
    assert "retrying" not in view["message"]
    assert f"its supervisor (pid {st['pid']}) is gone" in view["message"]
    assert f"`ftlaunch resume {run['id']}` continues it from the start" in view["message"]
    assert "retrying" in view["last_message"]  # what the dead supervisor last said is kept apart
    table = ftl("status", run["id"], env=env)
    assert table.returncode == 1 and said("lost: its supervisor", table.stdout) and "retrying" not in table.stdout


# ---------------------------------------------------------------- --hardware JSON


def test_a_hardware_file_that_is_no_machine_is_refused_naming_what_it_holds(tmp_path):
    cfg = write_config(tmp_path)
    plan_json = tmp_path / "plan.json"
    r = cli("plan", str(cfg), "--gpu", "T4", "--json")
    assert r.exit_code == 0, r.output
    plan_json.write_text(r.output)  # `plan --json` output, mistaken for a machine
    r = cli("plan", str(cfg), "--hardware", str(plan_json))
    assert r.exit_code == 4, r.output
    assert said("has no 'gpus' list: it holds `ftlaunch plan --json` output, not a machine", r.output)
    assert said("ftlaunch env --json > hw.json", r.output)
    other = tmp_path / "other.json"
    other.write_text('{"foo": 1}')
    r = cli("plan", str(cfg), "--hardware", str(other))
    assert r.exit_code == 4 and said("has no 'gpus' list: it holds no machine (keys: foo)", r.output), r.output
    no_memory = tmp_path / "hw.json"
    no_memory.write_text('{"gpus": [{"index": 0, "name": "NVIDIA A10"}]}')  # was KeyError('total_mib')
    r = cli("estimate", str(cfg), "--hardware", str(no_memory))
    assert r.exit_code == 4 and said("gpus[0].total_mib is missing", r.output), r.output
    assert not isinstance(r.exception, KeyError)


# ---------------------------------------------------------------- output_dir behind a broken link


def test_an_output_dir_that_is_a_symlink_loop_is_named_as_one(tmp_path, isolated_home):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    env = fake_env(tmp_path, [{"ok": True}])
    r = ftl("train", str(write_config(tmp_path, output_dir=str(tmp_path / "a"))), "--gpu", "A10G", env=env)
    assert r.returncode == 3, r.stderr
    loop = f"{tmp_path / 'a'} -> {tmp_path / 'b'} -> {tmp_path / 'a'}"
    assert said(f"output_dir {tmp_path / 'a'} is a symlink loop ({loop})", r.stderr), r.stderr
    assert said("point output_dir at a real folder", r.stderr) and not said("File exists", r.stderr)
    assert not (isolated_home / "runs").exists() or not any((isolated_home / "runs").iterdir())  # no run made
    (tmp_path / "d").symlink_to(tmp_path / "gone" / "x")
    r = ftl("train", str(write_config(tmp_path, output_dir=str(tmp_path / "d"))), "--gpu", "A10G", env=env)
    assert r.returncode == 3 and said(f"is a symlink to {tmp_path / 'gone' / 'x'}, which does not exist", r.stderr)


# ---------------------------------------------------------------- --gpu


def test_an_unknown_card_is_unknown_not_ambiguous(tmp_path):
    cfg = write_config(tmp_path)
    r = cli("plan", str(cfg), "--gpu", "RTX9090")
    assert r.exit_code == 4, r.output
    assert "ambiguous" not in r.output and "RTX2080TIx9090" not in r.output
    assert said("--gpu 'RTX9090' is not in the catalog (closest: RTX4090, RTX3090", r.output)
    assert said("pass --hardware FILE", r.output)
    r = cli("plan", str(cfg), "--gpu", "V100")  # a true prefix of two cards stays ambiguous
    assert r.exit_code == 4 and said("could be V100-16GB or V100-32GB", r.output)
    assert cli("plan", str(cfg), "--gpu", "RTX4090x2", "--json").exit_code == 0


# ---------------------------------------------------------------- a YAML scalar


@pytest.mark.parametrize(
    ("text", "shown"), [("just a string\n", "'just a string'"), ("42\n", "42"), ("true\n", "True")]
)
def test_a_config_holding_a_plain_scalar_says_so(tmp_path, text, shown):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    r = cli("plan", str(cfg), "--gpu", "T4")
    assert r.exit_code == 3, r.output
    assert said(f"c.yaml holds a YAML scalar ({shown}), not a mapping of keys", r.output)
    assert said("lines of `key: value`", r.output)
    assert not said("unknown key", r.output) and "Traceback" not in r.output


# ---------------------------------------------------------------- FTLAUNCH_HOME a file


@pytest.mark.parametrize("below", [False, True])
def test_every_reader_refuses_an_ftlaunch_home_that_is_a_file(tmp_path, monkeypatch, below):
    blocker = tmp_path / "home-file"
    blocker.write_text("x")
    monkeypatch.setenv("FTLAUNCH_HOME", str(blocker / "ftl" if below else blocker))
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(install(tmp_path)))  # train: no preflight to wait for
    commands = [
        ["runs"],
        ["runs", "--json"],
        ["status"],
        ["status", "nightly", "--json"],
        ["logs"],
        ["stop"],
        ["resume"],
        ["plot"],
        ["schedule", "list"],
        ["schedule", "list", "--json"],
        ["train", str(write_config(tmp_path)), "--gpu", "A10G", "--no-simulate"],
    ]
    for args in commands:
        r = cli(*args)
        assert r.exit_code == 12, (args, r.output)
        what = f"FTLAUNCH_HOME={blocker / 'ftl'} cannot be made: {blocker}" if below else f"FTLAUNCH_HOME={blocker}"
        assert said(f"{what} is a file, not a directory", r.output), (args, r.output)
        assert said(f"set FTLAUNCH_HOME to a directory (made if missing), or move {blocker} away", r.output)
        assert not said("0 run(s)", r.output) and not said("no runs", r.output)


# ---------------------------------------------------------------- one name, several runs


def test_a_name_several_runs_share_is_an_error_listing_them(tmp_path):
    env = fake_env(tmp_path, [{"ok": True, "steps": 2}])
    ids = []
    for i in range(3):
        cfg = write_config(tmp_path, output_dir=str(tmp_path / f"out{i}"))
        r = ftl("train", str(cfg), "--gpu", "A10G", "--name", "nightly", "--foreground", "--json", env=env)
        assert r.returncode == 0, r.stderr
        ids.append(json.loads(r.stdout)["id"])
    r = ftl("status", "nightly", env=env)
    assert r.returncode == 6, r.stderr  # the code of an ambiguous id prefix
    assert said("run name 'nightly' matches 3 runs, oldest first:", r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.startswith("  - ")]
    assert [line.split()[1] for line in lines] == ids
    assert all("succeeded, started" in line and "output_dir" in line for line in lines)
    assert said(f"name one by its id (or a unique prefix of it), e.g. {ids[-1]} for the latest", r.stderr)
    for args in (["logs", "nightly"], ["plot", "nightly"], ["resume", "nightly"]):
        assert ftl(*args, env=env).returncode == 6, args
    assert json.loads(ftl("status", ids[0], "--json", env=env).stdout)["id"] == ids[0]
    assert json.loads(ftl("status", "--json", env=env).stdout)["id"] == ids[-1]  # no RUN: still the latest


# ---------------------------------------------------------------- plot --out


def trainer_log(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"current_steps": i, "total_steps": 4, "loss": 2.0 / i, "epoch": i / 4} for i in range(1, 5)]
    (folder / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def read_only_folder(tmp_path: Path):
    """A folder this process cannot write in: a read-only tmpfs for root (which writes through
    permission bits), mode 0500 otherwise. None where neither can be had."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o500)
        return ro
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True)
    return ro if r.returncode == 0 else None


@needs_train_stack
def test_plot_to_a_path_that_cannot_be_written_says_so(tmp_path):
    out_dir = trainer_log(tmp_path / "saves")
    (tmp_path / "a-file").write_text("x")
    r = cli("plot", str(out_dir), "--out", str(tmp_path / "a-file" / "deep" / "p.png"))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert said(f"cannot write {tmp_path / 'a-file' / 'deep' / 'p.png'}: {tmp_path / 'a-file'} is a file", r.output)
    assert said("choose --out elsewhere", r.output)
    ro = read_only_folder(tmp_path)
    if ro is None:
        pytest.skip("no read-only folder can be made here (root without mount)")
    try:
        r = cli("plot", str(out_dir), "--out", str(ro / "p.png"))
        assert r.exit_code == 2, r.output
        assert said(f"cannot write {ro / 'p.png'}:", r.output) and said("choose --out elsewhere", r.output)
        assert said("read-only file system", r.output) or said("permission denied", r.output), r.output
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], capture_output=True)
    assert cli("plot", str(out_dir), "--out", str(tmp_path / "ok.png")).exit_code == 0


# ---------------------------------------------------------------- estimate, FTLAUNCH_HOME read-only


@pytest.mark.e2e
def test_estimate_with_a_read_only_home_warns_and_still_estimates(tiny, tmp_path, monkeypatch):
    """An estimate keeps nothing it needs: it counts in the system's temp folder instead, skips the
    histogram, says both, and prints the estimate (exit 0)."""
    ro = read_only_folder(tmp_path)
    if ro is None:
        pytest.skip("no read-only folder can be made here (root without mount)")
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, tmp_path / "out"))
    env = {**os.environ, "FTLAUNCH_HOME": str(ro)}
    try:
        r = ftl("estimate", str(cfg), "--json", env=env, timeout=300)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], capture_output=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["total_tokens"] > 0 and out["optimizer_steps"] > 0 and out["histogram"] is None
    assert said(f"warning: cannot write {ro / 'scratch'}", r.stderr), r.stderr
    assert said("the estimate is printed without it", r.stderr) and "Traceback" not in r.stderr
    assert yaml.safe_load(cfg.read_text())["output_dir"] == str(tmp_path / "out")
