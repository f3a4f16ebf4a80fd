"""`ftlaunch bundle -o PATH` on what PATH really is (issue 40 item 7): `-` piped into a real reader
(and one that goes away), a real FIFO read by a thread, a symlink (followed: the link stays a link),
/dev/null and /dev/full as the character devices they are, a tiny tmpfs filled up and then remounted
read-only, /proc and /sys. Never a traceback, never a FIFO or device replaced by a file, never a
half-written bundle (nor a temp file) left at the path."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import write_state

from ..helpers import bind_unix, said

RUN_ID = "20260101-000000-abcd"


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def members(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return [m.name for m in tar.getmembers()]


@pytest.fixture
def run_dir(isolated_home) -> Path:
    """A failed run's folder (state, a log, events): what `bundle` reads, without a trainer."""
    d = isolated_home / "runs" / RUN_ID
    d.mkdir(parents=True)
    write_state(d, RunState(id=RUN_ID, name="out-test", status=RunStatus.FAILED, message="boom"))
    (d / "train.log").write_text("".join(f"step {i} loss 1.0\n" for i in range(200)))
    (d / "events.jsonl").write_text('{"event": "created", "t": "2026-01-01T00:00:00Z"}\n')
    return d


@pytest.fixture
def big_run(run_dir) -> Path:
    """The run with 512 KiB of incompressible stacks: a bundle larger than a pipe's buffer or a
    64 KiB filesystem."""
    (run_dir / "stacks").mkdir()
    noise = os.urandom(256 * 1024).hex()
    (run_dir / "stacks" / "attempt-1.txt").write_text("\n".join(noise[i : i + 64] for i in range(0, len(noise), 64)))
    return run_dir


def test_an_empty_o_is_a_usage_error(run_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("bundle", RUN_ID, "-o", "")
    assert r.exit_code == 2 and said("'-o' / '--output': is empty", r.output)
    assert list(tmp_path.glob("*.tar.gz")) == []


def _binary(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftlaunch", *args]


def test_dash_streams_the_bundle_to_a_piped_reader_and_says_so_on_stderr(big_run, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = subprocess.run(_binary("bundle", RUN_ID, "-o", "-"), cwd=cwd, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    names = members(p.stdout)
    assert (
        f"ftlaunch-bundle-{RUN_ID}/stacks/attempt-1.txt" in names and f"ftlaunch-bundle-{RUN_ID}/MANIFEST.txt" in names
    )
    assert said(f"wrote stdout ({len(p.stdout):,} bytes", p.stderr.decode())
    assert list(cwd.iterdir()) == []  # no file named "-" nor a default bundle


def test_a_reader_that_goes_away_is_one_line_and_exit_20(big_run, tmp_path):
    proc = subprocess.Popen(_binary("bundle", RUN_ID, "-o", "-"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(10)[:2] == b"\x1f\x8b"  # gzip's magic: the stream started
    proc.stdout.close()  # the reader goes away with most of 512 KiB unread
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 20, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert said("cannot write stdout: its reader went away before the end (broken pipe)", err)


def test_a_fifo_is_written_through_to_its_reader_and_stays_a_fifo(run_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fifo = out / "bundle.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    r = cli("bundle", RUN_ID, "-o", str(fifo))
    reader.join(timeout=60)
    assert r.exit_code == 0, r.output
    assert said("through a FIFO", r.output)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert f"ftlaunch-bundle-{RUN_ID}/state.json" in members(got[0])
    assert [p.name for p in out.iterdir()] == ["bundle.fifo"]  # no temp file beside it


def test_a_symlink_is_followed_and_stays_a_link(run_dir, tmp_path):
    target = tmp_path / "real" / "b.tar.gz"
    target.parent.mkdir()
    target.write_bytes(b"an older bundle")
    link = tmp_path / "link.tar.gz"
    link.symlink_to(target)
    r = cli("bundle", RUN_ID, "-o", str(link))
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert f"ftlaunch-bundle-{RUN_ID}/state.json" in members(target.read_bytes())
    # a link to nothing yet: what it names is made
    dangling = tmp_path / "dangling.tar.gz"
    dangling.symlink_to(tmp_path / "real" / "new.tar.gz")
    assert cli("bundle", RUN_ID, "-o", str(dangling)).exit_code == 0
    assert dangling.is_symlink() and members((tmp_path / "real" / "new.tar.gz").read_bytes())
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["b.tar.gz", "new.tar.gz"]


def test_dev_null_is_written_through_and_dev_full_says_full(run_dir):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    r = cli("bundle", RUN_ID, "-o", "/dev/null")
    assert r.exit_code == 0 and said("through a character device", r.output), r.output
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISCHR(os.stat("/dev/full").st_mode)
    r = cli("bundle", RUN_ID, "-o", "/dev/full")
    assert r.exit_code == 17, r.output
    assert said("cannot write /dev/full: its filesystem is full", r.output) and "Traceback" not in r.output
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("/proc/ftlaunch-bundle.tar.gz", "its folder /proc takes no new files"),
        ("/proc/self/ftlaunch-bundle.tar.gz", "its folder /proc/self takes no new files"),
        ("/sys/ftlaunch-bundle.tar.gz", "cannot write /sys/ftlaunch-bundle.tar.gz:"),  # EACCES, or EROFS
        ("{tmp}/a-file/b.tar.gz", "{tmp}/a-file is a file, not a folder"),
        ("{tmp}", "is a directory"),  # click's own check: exit 2
    ],
)
def test_os_errors_are_one_line_naming_the_path(run_dir, tmp_path, where, says):
    (tmp_path / "a-file").write_text("x")
    where, says = where.format(tmp=tmp_path), says.format(tmp=tmp_path)
    r = cli("bundle", RUN_ID, "-o", where)
    assert r.exit_code == (2 if where == str(tmp_path) else 20), r.output
    assert said(says, r.output) and "Traceback" not in r.output
    if r.exit_code == 20:
        assert said(f"cannot write {where}:", r.output)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs (root only: skipped with the reason elsewhere), unmounted at the end."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_filesystem_leaves_the_old_bundle_whole_and_no_temp_file(big_run, tiny_fs):
    old = tiny_fs / "b.tar.gz"
    old.write_bytes(b"the bundle of yesterday")
    r = cli("bundle", RUN_ID, "-o", str(old))
    assert r.exit_code == 17, r.output
    assert said(f"cannot write {old}: its filesystem is full after", r.output)
    assert said(f"{old} is as it was", r.output) and "Traceback" not in r.output
    assert old.read_bytes() == b"the bundle of yesterday"
    assert [p.name for p in tiny_fs.iterdir()] == ["b.tar.gz"]
    # read-only: refused at once, named as such
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    r = cli("bundle", RUN_ID, "-o", str(tiny_fs / "new.tar.gz"))
    assert r.exit_code == 20 and said(f"cannot write {tiny_fs}/new.tar.gz: its filesystem is read-only", r.output)


def test_a_regular_file_is_replaced_whole(run_dir, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert cli("bundle", RUN_ID).exit_code == 0  # the default name, in the working folder
    made = cwd / f"ftlaunch-bundle-{RUN_ID}.tar.gz"
    first = members(made.read_bytes())
    r = cli("bundle", RUN_ID, "-o", made.name)
    assert r.exit_code == 0 and said(f"wrote {made.name} (", r.output), r.output
    assert members(made.read_bytes()) == first
    assert [p.name for p in cwd.iterdir()] == [made.name]


def test_a_block_device_and_a_socket_are_refused_untouched(run_dir, tmp_path):
    """As root `-o /dev/sda` would write over a disk: refused before it is opened. The node made here
    names a loop device that is not there (opening it would fail anyway)."""
    import socket

    blk = tmp_path / "blk"
    try:
        os.mknod(blk, stat.S_IFBLK | 0o600, os.makedev(7, 250))
    except OSError as exc:
        pytest.skip(f"cannot make a block device node here (needs root): {exc}")
    r = cli("bundle", RUN_ID, "-o", str(blk))
    assert r.exit_code == 20 and said(f"cannot write {blk}: it is a block device", r.output), r.output
    assert stat.S_ISBLK(os.lstat(blk).st_mode)
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        bind_unix(s, sock_path)  # a long TMPDIR is past AF_UNIX's 107 bytes
        r = cli("bundle", RUN_ID, "-o", str(sock_path))
    assert r.exit_code == 20 and said("it is a socket", r.output), r.output


def test_dash_to_a_terminal_is_refused(run_dir, tmp_path):
    """gzip's rule: compressed bytes are never written to a terminal (a real pseudo-terminal here)."""
    import pty

    master, slave = pty.openpty()
    try:
        p = subprocess.run(
            _binary("bundle", RUN_ID, "-o", "-"), stdout=slave, stderr=subprocess.PIPE, cwd=tmp_path, timeout=120
        )
    finally:
        os.close(slave)
        os.close(master)
    assert p.returncode == 2, p.stderr.decode()
    assert said("would write compressed bytes to a terminal", p.stderr.decode())
