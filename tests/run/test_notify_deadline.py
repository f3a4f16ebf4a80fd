"""Deliveries with a deadline (issue 40, item 5): a real slow TCP server that answers one byte every 2 s
forever, as an HTTP and an apprise destination, and as the destination the detached notify child is
handed; real `--notify-cmd` commands whose children would leak, and one holding a marker secret that
must be in no process's command line."""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ftlaunch.run import notify as nt
from ftlaunch.run.notify import NotifySpec
from ftlaunch.run.store import read_events

from ..helpers import wait_for


class Drip:
    """A destination that accepts, reads what it is sent, and answers one byte every ``every`` seconds
    forever (a status line, then a header that never ends): every read gets a byte before a per-read
    timeout, so only a deadline over the whole request ends it. Notes when a client shuts its end."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.accepted: list[float] = []
        self.client_closed: list[float] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(time.monotonic())
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        answer = iter(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1_000_000)
        next_at = time.monotonic()
        with conn:
            while not self.stop.is_set():
                ready, _, _ = select.select([conn], [], [], max(0.0, min(0.2, next_at - time.monotonic())))
                try:
                    if ready:
                        if not conn.recv(65536):
                            break  # the client shut its end
                        continue
                    if time.monotonic() >= next_at:
                        conn.sendall(bytes([next(answer)]))
                        next_at = time.monotonic() + self.every
                except OSError:
                    break
            else:
                return
            self.client_closed.append(time.monotonic())

    def close(self) -> None:
        self.stop.set()
        self.server.close()


@pytest.fixture
def drip():
    d = Drip()
    yield d
    d.close()


def alive_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are not zombies (read from /proc)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(p.name))
    return out


def cmdlines_holding(marker: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            continue
    return found


def in_thread(fn, *args):
    """``fn(*args)`` in a thread: (the thread, a list that gets (its result, seconds it took))."""
    out: list = []

    def run() -> None:
        t0 = time.monotonic()
        out.append((fn(*args), time.monotonic() - t0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


MSG = {"event": "failed", "run_id": "r1", "status": "failed", "output_dir": "/o"}


def test_a_server_dripping_a_byte_every_2s_is_given_up_at_the_deadline(drip):
    """urllib's timeout (5 s) is per read: each byte resets it. The deadline (3 s) ends the whole
    request, and the try's connection is shut (its thread does not linger on the socket)."""
    t0 = time.monotonic()
    err = nt.deliver(f"http://127.0.0.1:{drip.port}/hook?token=T0K3N", MSG, {}, 3.0)
    took = time.monotonic() - t0
    print(f"\na dripping destination, deadline 3 s: given up after {took:.2f} s")
    assert err is not None and "deadline" in err and 3.0 <= took < 3.0 + 3.0
    assert drip.accepted and len(drip.accepted) == 1
    wait_for(lambda: drip.client_closed, "the server to see the connection shut", timeout=30)
    assert drip.client_closed[0] - t0 < 3.0 + 5.0
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "ftlaunch-notify-try"], "the try's thread")


def test_an_apprise_delivery_is_bounded_too(drip):
    apprise = pytest.importorskip("apprise")
    assert apprise.Apprise().add("json://127.0.0.1:9/warm")  # its plugins loaded: the deadline is the try's
    t0 = time.monotonic()
    err = nt.deliver(f"json://127.0.0.1:{drip.port}/hook", MSG, {}, 3.0)
    took = time.monotonic() - t0
    assert err is not None and "deadline" in err and 3.0 <= took < 3.0 + 3.0
    wait_for(lambda: drip.accepted, "apprise's connection")


def test_retries_and_their_backoff_end_at_the_deadline(tmp_path):
    """A destination that fails at once, a backoff longer than the deadline: one try, given up at 1 s."""
    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"ok": True}])
    spec = NotifySpec(urls=("http://127.0.0.1:9/x",))
    n = nt.Notifier(run_dir, spec, env, send=lambda *a: "refused", backoff=30.0, deadline=1.0)
    t0 = time.monotonic()
    assert n.attempt(nt._Job(0, {"event": "started", "seen_at": time.time()})) is False
    assert time.monotonic() - t0 < 1.0 + 1.5
    (e,) = [e for e in read_events(run_dir) if e["event"] == "notified"]
    assert (e["ok"], e["tries"]) == (False, 1) and e["error"] == "refused; given up: its deadline passed"


def test_the_detached_child_ends_by_the_deadline(tmp_path, drip):
    """The supervisor's try under way when it ends is handed to the detached child with its deadline
    (4 s from the first try): the child gives up by then and exits; one `notified` record, failed."""
    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"ok": True}])
    spec = NotifySpec(urls=(f"http://127.0.0.1:{drip.port}/hook?token=T0K3N",))
    nt.keep_spec(run_dir, spec)
    children: list[subprocess.Popen] = []

    def spawn(*a, **k):
        children.append(subprocess.Popen(*a, **k))
        return children[-1]

    n = nt.Notifier(run_dir, spec, env, close_wait=0.05, spawn=spawn, deadline=4.0)
    t0 = time.time()
    n.event("started")
    wait_for(lambda: drip.accepted, "the supervisor's try connected")
    n.close()
    (child,) = children
    try:
        until = t0 + 4.0
        wait_for(lambda: child.poll() is not None, "the notify child's exit")
        gone = time.time()
        print(f"\nthe detached child exited {gone - until:+.2f} s from the deadline")
        assert child.returncode == 0 and gone < until + 8.0  # its start under load, the record
        got = [e for e in read_events(run_dir) if e["event"] == "notified"]
        assert len(got) == 1 and not got[0]["ok"] and "deadline" in got[0]["error"]
        assert "T0K3N" not in json.dumps(got)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_hanging_command_is_killed_with_its_whole_group(tmp_path):
    """`sh -c 'sleep 1000 & sleep 1000; wait'`: past the deadline, every process of its group is gone
    (before, only the shell was killed and its children lived on)."""
    pidfile = tmp_path / "pgid"
    cmd = f"echo $$ > {pidfile}; sh -c 'sleep 1000 & sleep 1000; wait'"
    t, out = in_thread(nt.deliver, f"cmd:{cmd}", MSG, {"PATH": "/usr/bin:/bin"}, 3.0)
    pgid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), "the command's start"))
    wait_for(lambda: len(alive_in_group(pgid)) >= 4, "sh, sh -c and the two sleeps in one group")
    t.join(30)
    ((err, took),) = out
    print(f"\na hanging command, deadline 3 s: killed with its group after {took:.2f} s")
    assert "deadline" in err and "process group was killed" in err and took < 3.0 + 3.0
    wait_for(lambda: not alive_in_group(pgid), "no process of the command's group alive", timeout=10)


def test_what_a_command_leaves_running_is_ended_with_it(tmp_path):
    pidfile = tmp_path / "pgid"
    cmd = f"echo $$ > {pidfile}; sleep 1000 > /dev/null 2>&1 &"
    t0 = time.monotonic()
    assert nt.deliver(f"cmd:{cmd}", MSG, {"PATH": "/usr/bin:/bin"}, 30.0) is None
    assert time.monotonic() - t0 < 10
    pgid = int(pidfile.read_text())
    wait_for(lambda: not alive_in_group(pgid), "the backgrounded sleep ended", timeout=10)


def test_a_commands_text_is_in_no_process_command_line(tmp_path):
    """The command (and its secret) goes through a 0600 file: while it runs, no /proc/*/cmdline and
    no environment of its processes holds the marker; the message still reaches its stdin."""
    marker = f"SECRET-{secrets.token_hex(8)}"
    script_path, got, release = tmp_path / "script", tmp_path / "got.json", tmp_path / "release"
    cmd = f"curl_token={marker}; echo $0 > {script_path}; cat > {got}; while [ ! -e {release} ]; do sleep 0.05; done"
    t, out = in_thread(nt.deliver, f"cmd:{cmd}", MSG, {"PATH": "/usr/bin:/bin"}, 60.0)
    try:
        wait_for(lambda: got.exists() and got.stat().st_size and script_path.exists(), "the command running")
        script = Path(script_path.read_text().strip())
        assert stat.S_IMODE(script.stat().st_mode) == 0o600
        pgid = os.getpgid(int(wait_for(lambda: shell_running(script), "the command's shell")))
        assert cmdlines_holding(marker) == []
        for pid in alive_in_group(pgid):
            try:
                assert marker.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
            except FileNotFoundError:
                pass
        assert json.loads(got.read_text())["event"] == "failed"
    finally:
        release.touch()
        t.join(30)
    assert out[0][0] is None and not script.exists()


def shell_running(script: Path) -> int | None:
    """The pid of the shell running ``script`` (its command line: /bin/sh SCRIPT)."""
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "cmdline").read_bytes().split(b"\0")[:2] == [b"/bin/sh", bytes(script)]:
                return int(p.name)
        except OSError:
            continue
    return None
