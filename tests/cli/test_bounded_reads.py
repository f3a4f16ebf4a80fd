"""Bounded reads (issue 40, item 4): every file a user gives or could have placed is read only when it
is a regular file of at most its limit (ftlaunch.files.read_user_bytes; the table in docs/limits.md).
Each case is what a user did, through the real command line in a child process (a read without end
would hang an in-process test): it ends within seconds, with the exit code of the file's kind, names
the file, and leaves no run folder. Before: `--hardware /dev/zero` grew to 22 GB; a FIFO as the config
blocked forever; notify.yaml -> /dev/zero was a MemoryError, or a supervisor killed without a word."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftlaunch.errors import ConfigError, ExitCode, HardwareError, StateError
from ftlaunch.files import HARDWARE_LIMIT, read_user_bytes, read_user_text

from ..fake_trainer import install, write_config
from ..helpers import bind_unix, said

SECONDS = 30  # far above what each case takes (< 1 s of work): a read without end runs into it


def ftl(*args: str, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real command line in a child process, ended by SECONDS at the latest (TimeoutExpired: failed)."""
    return subprocess.run(
        [sys.executable, "-m", "ftlaunch", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=SECONDS
    )


@pytest.fixture
def env(tmp_path, isolated_home) -> dict:
    e = dict(os.environ)
    e.update(
        FTLAUNCH_LLAMAFACTORY_CLI=str(install(tmp_path)),
        FAKE_TRAINER_SCRIPT=json.dumps([{"ok": True}]),
        FAKE_TRAINER_COUNTER=str(tmp_path / "counter"),
    )
    return e


def no_run_folder(home: Path) -> bool:
    runs = home / "runs"
    return not runs.is_dir() or not [p for p in runs.iterdir() if not p.name.startswith(".")]


def refused(r: subprocess.CompletedProcess, code: ExitCode, *words: str) -> bool:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert all(said(w, r.stderr) for w in words), r.stderr
    return True


# ---------------------------------------------------------------- through the command line


def test_hardware_dev_zero_is_refused_at_once(tmp_path, env, isolated_home):
    cfg = write_config(tmp_path)
    t0 = time.monotonic()
    r = ftl("plan", str(cfg), "--hardware", "/dev/zero", env=env)
    assert refused(r, ExitCode.HARDWARE, "hardware file /dev/zero is a character device, not a regular file")
    assert time.monotonic() - t0 < SECONDS
    r = ftl("train", str(cfg), "--hardware", "/dev/zero", env=env)
    assert refused(r, ExitCode.HARDWARE, "/dev/zero") and no_run_folder(isolated_home)


def test_a_20_mb_hardware_file_is_refused_by_its_size(tmp_path, env, isolated_home):
    big = tmp_path / "hw.json"
    with open(big, "wb") as f:
        f.truncate(20 * 1024 * 1024)  # a sparse 20 MB: the size alone refuses it, nothing is read
    r = ftl("train", str(write_config(tmp_path)), "--hardware", str(big), env=env)
    assert refused(r, ExitCode.HARDWARE, f"hardware file {big} is 20 MiB, over the 1 MiB")
    assert no_run_folder(isolated_home)


def test_a_fifo_as_the_config_never_blocks(tmp_path, env, isolated_home):
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)  # nothing ever writes to it: opening it for reading alone would block forever
    for command in ("plan", "train"):
        r = ftl(command, str(fifo), "--gpu", "A10G", env=env)
        assert refused(r, ExitCode.CONFIG, f"config file {fifo} is a FIFO (named pipe), not a regular file")
    assert no_run_folder(isolated_home)


def test_a_config_over_its_limit_and_a_device_named_by_it(tmp_path, env, isolated_home):
    big = tmp_path / "big.yaml"
    big.write_text("stage: sft\n" + "# padding\n" * 120_000)  # 1.2 MB of a valid YAML config
    r = ftl("plan", str(big), "--gpu", "A10G", env=env)
    assert refused(r, ExitCode.CONFIG, f"config file {big} is 1.14 MiB, over the 1 MiB")
    ds = write_config(tmp_path, deepspeed="/dev/zero")
    r = ftl("train", str(ds), "--gpu", "A10G", env=env)
    assert refused(r, ExitCode.CONFIG, "deepspeed: /dev/zero is a character device")
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "dataset_info.json")
    r = ftl("train", str(write_config(tmp_path, dataset="a", dataset_dir=str(data))), "--gpu", "A10G", env=env)
    assert refused(r, ExitCode.CONFIG, f"{data / 'dataset_info.json'} is a FIFO (named pipe)")
    r = ftl("plan", str(write_config(tmp_path)), "--gpu", "A10G", "--model-config", "/dev/zero", env=env)
    assert refused(r, ExitCode.CONFIG, "--model-config /dev/zero is a character device")
    assert no_run_folder(isolated_home)


def test_notify_yaml_to_dev_zero_or_huge_stops_train_before_anything(tmp_path, env, isolated_home):
    isolated_home.mkdir(parents=True, exist_ok=True)
    notify = isolated_home / "notify.yaml"
    notify.symlink_to("/dev/zero")
    cfg = write_config(tmp_path)
    r = ftl("train", str(cfg), "--gpu", "A10G", env=env)
    assert refused(r, ExitCode.NOTIFY_CONFIG, f"{notify}: the file is a character device, not a regular file")
    notify.unlink()
    notify.write_text("destinations:\n" + "  - url: https://hooks.example.org/T0K3N\n" * 10_000)  # 420 KB
    r = ftl("train", str(cfg), "--gpu", "A10G", env=env)
    assert refused(r, ExitCode.NOTIFY_CONFIG, f"{notify}: the file is", "over the 256 KiB")
    assert "T0K3N" not in r.stderr + r.stdout
    assert no_run_folder(isolated_home)


def _limit_memory() -> None:  # the supervisor child: a read without end fails at 2 GB, not the machine's RAM
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_a_supervisor_that_meets_notify_yaml_to_dev_zero_says_so_and_runs_on(tmp_path, env, isolated_home):
    """The file went bad after `train` checked it: the supervisor (started on its own, as a Slurm job's
    first step starts it) leaves its word in events.jsonl and the run ends as it would have. Before, its
    read grew until the kernel killed it: `lost (pid None)`, an empty supervisor.log."""
    env["FAKE_TRAINER_SCRIPT"] = json.dumps([{"config_error": "bad key"}])
    r = ftl("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", env=env)
    assert r.returncode != 0
    run_dir = next(p for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    (isolated_home / "notify.yaml").symlink_to("/dev/zero")
    env["FAKE_TRAINER_SCRIPT"] = json.dumps([{"ok": True}])
    sup = subprocess.run(
        [sys.executable, "-m", "ftlaunch.run.supervisor", str(run_dir)],
        env=env,
        capture_output=True,
        timeout=SECONDS * 2,
        preexec_fn=_limit_memory,
    )
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    word = [e for e in events if e["event"] == "notify_config_error"]
    assert word and said(f"{isolated_home / 'notify.yaml'}: the file is a character device", word[-1]["message"])
    assert sup.returncode == 0, sup.stderr
    assert json.loads((run_dir / "state.json").read_text())["status"] == "succeeded"


def test_a_foreign_state_json_is_refused_not_read_without_end(tmp_path, env, isolated_home):
    r = ftl("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", env=env)
    assert r.returncode == 0, r.stderr
    run_dir = next(p for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    (run_dir / "state.json").unlink()
    (run_dir / "state.json").symlink_to("/dev/zero")
    r = ftl("status", run_dir.name, env=env)
    assert refused(r, ExitCode.STATE, f"run {run_dir.name}: state.json is a character device")
    (run_dir / "state.json").unlink()
    os.mkfifo(run_dir / "state.json")
    r = ftl("runs", env=env)
    assert r.returncode == 0 and run_dir.name in r.stdout and "unreadable" in r.stdout


# ---------------------------------------------------------------- the reader itself


def test_the_reader_refuses_each_kind_and_follows_a_symlink(tmp_path):
    def read(path, limit=HARDWARE_LIMIT):
        return read_user_bytes(path, limit=limit, what=f"test file {path}", error=HardwareError)

    good = tmp_path / "good.json"
    good.write_text('{"gpus": []}')
    (tmp_path / "link").symlink_to(good)
    assert read(tmp_path / "link") == b'{"gpus": []}'
    sock = socket.socket(socket.AF_UNIX)
    bind_unix(sock, tmp_path / "s")  # a long TMPDIR is past AF_UNIX's 107 bytes
    try:
        kinds = {tmp_path: "a directory", tmp_path / "s": "a socket", Path("/dev/null"): "a character device"}
        for path, kind in kinds.items():
            with pytest.raises(HardwareError, match=f"is {kind}, not a regular file") as e:
                read(path)
            assert str(path) in e.value.message and e.value.exit_code == ExitCode.HARDWARE
    finally:
        sock.close()
    with pytest.raises(FileNotFoundError):  # missing: the caller says what that means (often nothing)
        read(tmp_path / "absent")


def test_a_file_that_lies_about_its_size_is_still_bounded():
    """/proc files say 0 bytes: the read itself stops at limit + 1."""
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(StateError, match="holds more than 64 bytes") as e:
        read_user_bytes("/proc/self/status", limit=64, what="/proc/self/status", error=StateError)
    assert "at most 64 bytes" in (e.value.hint or "")
    assert len(read_user_bytes("/proc/self/status", limit=1 << 20, what="x", error=StateError)) > 64


def test_text_that_is_not_utf8_names_the_byte(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"stage: s\xe9ft\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text: byte 0xe9 at offset 8"):
        read_user_text(bad, limit=100, what=f"config file {bad}", error=ConfigError)
    with pytest.raises(ConfigError, match="is 12 bytes, over the 10 bytes"):
        read_user_text(bad, limit=10, what=f"config file {bad}", error=ConfigError)


def test_files_in_ftlaunch_home_that_someone_else_put_there(tmp_path, isolated_home):
    """learned.json (planning goes on without it and says so) and a run's ray.json, a FIFO each."""
    from ftlaunch.plan.memory import store
    from ftlaunch.run.ray.record import read_record

    isolated_home.mkdir(parents=True, exist_ok=True)
    os.mkfifo(isolated_home / "learned.json")
    with pytest.raises(StateError, match="learned.json is a FIFO"):
        store.load({"FTLAUNCH_HOME": str(isolated_home)})
    os.mkfifo(tmp_path / "ray.json")
    with pytest.raises(StateError, match="ray.json is a FIFO"):
        read_record(tmp_path)
