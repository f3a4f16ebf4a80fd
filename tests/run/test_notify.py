"""Notifications from the supervisor (ftlaunch.run.notify), from real runs of the scripted trainer
(tests/fake_trainer.py) to a real HTTP server on 127.0.0.1 and a real command; a dead destination; the
destination's token in no file, log or printout but secrets.json (0600)."""

from __future__ import annotations

import json
import secrets
import socket
import stat
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import ConfigError
from ftlaunch.run import notify as nt
from ftlaunch.run.notify import EVENTS, NOTIFY_KEY, NotifySpec, parse_on, redact_target, url_problems
from ftlaunch.run.store import read_events

from ..fake_trainer import configs_seen, write_config
from ..helpers import said, wait_for
from .test_reliability import fake  # noqa: F401  (the scripted trainer, in-process)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


class Hook:
    """A webhook on 127.0.0.1: every JSON body POSTed, with the time it arrived."""

    def __init__(self) -> None:
        self.got: list[tuple[float, str, dict]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hook.got.append((time.time(), self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[str]:
        return [m["event"] for _, _, m in self.got]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def files_holding(value: str, *roots: Path) -> list[str]:
    return sorted(p.name for root in roots for p in root.rglob("*") if p.is_file() and value.encode() in p.read_bytes())


def child_taking(jobs: list[dict]) -> type:
    """A `spawn` for the notifier's detached child that keeps the jobs handed to it (nothing runs)."""

    class Child:
        def __init__(self, *a: object, **k: object) -> None:
            self.stdin = self

        def write(self, data: bytes) -> None:
            jobs.extend(json.loads(data))

        def close(self) -> None:
            pass

    return Child


def run_dir_of(home: Path) -> Path:
    return next(p for p in (home / "runs").iterdir() if not p.name.startswith("."))


# ---------------------------------------------------------------- the pure parts


def test_events_destinations_and_how_they_are_shown():
    assert parse_on(None) == frozenset(EVENTS) == parse_on("all")
    assert parse_on("failed, stalled") == {"failed", "stalled"}
    with pytest.raises(ConfigError) as e:
        parse_on("failed,exploded")
    assert "exploded" in e.value.message and "oom_recovered" in (e.value.hint or "")
    assert redact_target("https://hooks.slack.com/services/T0/B0/XYZ") == "https://hooks.slack.com/***"
    assert redact_target("json://user:pw@host:8080/path") == "json://***"
    assert redact_target("cmd:curl -d @- https://x/tok") == "command curl ***"
    assert url_problems(["https://x/y", "json://h/p"], apprise_ok=True) == []
    problems = url_problems(["nonsense", "slack://T/B/C"], apprise_ok=False)
    assert len(problems) == 2 and "ftlaunch[notify]" in problems[1] and "T/B/C" not in " ".join(problems)
    spec = NotifySpec(urls=("https://a/1",), on=frozenset({"failed"}))
    assert NotifySpec.from_json(spec.to_json()) == spec and not NotifySpec()
    both = spec.with_env({"FTLAUNCH_NOTIFY": "https://b/2, json://c/3"})
    assert both.urls == ("https://a/1", "https://b/2", "json://c/3") and both.on == {"failed"}


# ---------------------------------------------------------------- real runs


def test_an_oom_recovery_and_success_reach_a_local_webhook_and_a_command_with_no_secret_shown(
    tmp_path,
    fake,  # noqa: F811
    isolated_home,
    hook,
):
    token = secrets.token_hex(16)
    url = f"http://127.0.0.1:{hook.port}/hook/{token}"
    got_cmd = tmp_path / "cmd.jsonl"
    fake({"oom": True}, {"ok": True, "steps": 4})
    cfg = write_config(tmp_path)
    r = cli(
        "train", str(cfg), "--gpu", "A10G", "--foreground",
        "--notify", url,
        "--notify-cmd", f'cat >> {got_cmd}; echo " $FTLAUNCH_EVENT" >> {got_cmd}',
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert [c["per_device_train_batch_size"] for c in configs_seen(tmp_path)] == [2, 1]
    wait_for(lambda: "succeeded" in hook.events(), "the webhook's succeeded")
    assert hook.events() == ["started", "oom_recovered", "succeeded"]
    assert {path for _, path, _ in hook.got} == {f"/hook/{token}"}
    run_dir = run_dir_of(isolated_home)
    by = {m["event"]: m for _, _, m in hook.got}
    done = by["succeeded"]
    assert done["run_id"] == run_dir.name and done["status"] == "succeeded"
    assert (done["step"], done["total_steps"]) == (4, 4) and done["loss_trend"] and done["recent_losses"][-1] == 0.25
    assert done["output_dir"] == str(tmp_path / "out") and done["config"] == str(cfg) and done["machine"]
    assert by["oom_recovered"]["details"]["changes"]["per_device_train_batch_size"] == "2 -> 1"
    assert "log_tail" not in done
    assert done["text"].startswith("ftlaunch: run out succeeded\n") and "step 4/4" in done["text"]  # Slack's shape
    latencies = [arrived - m["seen_at"] for arrived, _, m in hook.got]
    print(f"\nnotification latency (supervisor saw it -> the webhook had it): max {max(latencies) * 1000:.0f} ms")
    assert max(latencies) < 5
    # the command got the same messages on stdin and FTLAUNCH_EVENT
    wait_for(
        lambda: got_cmd.exists() and got_cmd.read_text().count("$") == 0 and "succeeded\n" in got_cmd.read_text(), "cmd"
    )
    text = got_cmd.read_text()
    assert text.count('"event": "started"') == 1 and text.rstrip().endswith("succeeded")
    # every delivery in the events, the destination shown as ***
    notified = wait_for(
        lambda: (
            [e for e in read_events(run_dir) if e["event"] == "notified"]
            if len([e for e in read_events(run_dir) if e["event"] == "notified"]) == 6
            else None
        ),
        "6 notified events",
    )
    assert all(e["ok"] and e["tries"] == 1 for e in notified)
    assert {e["target"] for e in notified} == {f"http://127.0.0.1:{hook.port}/***", "command cat ***"}
    # the token: only in secrets.json (0600), never in a file, log, event, message or printout
    shown = "".join(cli(*a).output for a in (("status", "--json"), ("status",), ("runs", "--json"), ("logs",)))
    assert token not in shown + r.output + json.dumps(hook.events()) + text
    assert files_holding(token, isolated_home, tmp_path / "out") == ["secrets.json"]
    secrets_file = run_dir / "secrets.json"
    assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600
    assert json.loads(secrets_file.read_text())[NOTIFY_KEY]["urls"] == [url]
    assert "ftlaunch_notify" not in configs_seen(tmp_path)[-1]  # never the trainer's


def test_a_failure_says_its_class_and_log_and_only_chosen_events_go(tmp_path, fake, isolated_home, hook, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FTLAUNCH_NOTIFY", f"http://127.0.0.1:{hook.port}/env")
    fake({"config_error": "unknown key: bogus_key"})
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", "--notify-on", "failed")
    assert r.exit_code != 0
    wait_for(lambda: hook.got, "the failed message")
    time.sleep(0.3)
    assert hook.events() == ["failed"]
    m = hook.got[0][2]
    assert m["status"] == "failed" and m["failure_kind"] == "config_error"
    assert any("unknown key: bogus_key" in ln for ln in m["log_tail"])
    assert said("ftlaunch: run failed (config_error)", f"ftlaunch: run failed ({m['failure_kind']})")


def test_a_dead_destination_adds_under_a_second_and_is_retried(tmp_path, fake, isolated_home, monkeypatch):  # noqa: F811
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: every try is refused
    spent: list[float] = []
    for name in ("event", "close"):
        original = getattr(nt.Notifier, name)

        def timed(self, *a, _original=original, **k):
            t0 = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                spent.append(time.perf_counter() - t0)

        monkeypatch.setattr(nt.Notifier, name, timed)
    fake({"ok": True, "steps": 4})
    r = cli(
        "train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", "--notify", f"http://127.0.0.1:{port}/x"
    )
    assert r.exit_code == 0, r.output
    print(f"\nthe supervisor's time in notification code with a dead destination: {sum(spent) * 1000:.0f} ms")
    assert sum(spent) < 1.0
    run_dir = run_dir_of(isolated_home)

    def failed_deliveries():
        got = [e for e in read_events(run_dir) if e["event"] == "notified"]
        return got if len(got) == 2 else None

    got = wait_for(failed_deliveries, "both deliveries given up (the detached child retries the last)")
    assert all(not e["ok"] and e["tries"] == nt.RETRIES and "Connection refused" in e["error"] for e in got)
    assert {e["notice"] for e in got} == {"started", "succeeded"}


def test_a_stall_says_where_the_stacks_are_and_the_end_says_stalled(tmp_path, hook):
    """The real supervisor, a scripted trainer that hangs at step 2 every time (stall budget 1)."""
    from ftlaunch.run.state import Budget
    from ftlaunch.run.store import update_state
    from ftlaunch.run.supervisor import Supervisor

    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"train": True, "steps": 12, "save_steps": 4, "hang_at": 2}])
    update_state(run_dir, stall_timeout=1.0, budget=Budget(stall_max=1, crash_max=1))
    nt.keep_spec(run_dir, NotifySpec(urls=(f"http://127.0.0.1:{hook.port}/s",), on=frozenset({"stalled"})))
    assert Supervisor(run_dir, env, poll=0.05, stop_grace=2).run() == 15
    wait_for(lambda: len(hook.got) == 3, "2 stalls and the end")
    stalls, end = [m for _, _, m in hook.got[:2]], hook.got[2][2]
    for m in stalls:
        assert Path(m["details"]["stacks"]).parent == run_dir / "stacks" and "after step 2" in m["details"]["message"]
        assert any("hanging" in ln for ln in m["log_tail"])
    assert (end["event"], end["status"], end["details"]["exit_code"]) == ("stalled", "stalled", 15)


def test_a_kill_9_of_the_supervisor_is_told_once_by_the_next_status(tmp_path, fake, isolated_home, hook):  # noqa: F811
    import os
    import signal

    import psutil

    from ftlaunch.run.store import read_state

    fake({"train": True, "steps": 300, "save_steps": 50, "step_sleep": 0.2})
    url = f"http://127.0.0.1:{hook.port}/lost"
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--json", "--notify", url, "--notify-on", "lost")
    assert r.exit_code == 0, r.output
    run_id = json.loads(r.stdout)["id"]
    run_dir = isolated_home / "runs" / run_id
    try:
        pid = wait_for(lambda: read_state(run_dir).status.value == "running" and read_state(run_dir).pid, "running")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "gone")
        assert "lost" in cli("status", run_id).output
        assert "lost" in cli("runs").output
        wait_for(lambda: hook.got, "the lost notice")
        time.sleep(0.5)
        assert hook.events() == ["lost"]  # once, however many commands found it
        m = hook.got[0][2]
        assert m["status"] == "lost" and m["details"]["supervisor_pid"] == pid and m["run_id"] == run_id
        assert "resume" in (m["message"] or "")
    finally:
        cli("stop", run_id, "--grace", "5")


def test_plan_status_runs_and_an_http_notify_never_import_apprise(tmp_path, isolated_home):
    """An `apprise` that stops the interpreter when imported, first on the path: it is never loaded."""
    import os
    import subprocess
    import sys

    trap = tmp_path / "trap"
    trap.mkdir()
    (trap / "apprise.py").write_text("raise SystemExit('apprise was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(trap)}
    cfg = str(write_config(tmp_path))

    def py(*args: str) -> str:
        r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
        return r.stdout + r.stderr

    assert "apprise was imported" in py("-c", "import apprise")  # the trap works
    for args in (["plan", cfg, "--gpu", "A10G"], ["runs"], ["runs", "--json"], ["status"], ["bundle", "--help"]):
        assert "apprise was imported" not in py("-m", "ftlaunch", *args), args
    probe = "import ftlaunch.run.notify as n, sys; n.url_problems(['https://x'], True); print('apprise' in sys.modules)"
    assert py("-c", probe).strip() == "False"


def test_resume_with_notify_tells_the_new_destination(tmp_path, fake, isolated_home, hook):  # noqa: F811
    fake({"config_error": "unknown key: bogus_key"}, {"ok": True, "steps": 4})
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground")
    assert r.exit_code != 0 and not hook.got
    url = f"http://127.0.0.1:{hook.port}/resumed"
    r = cli("resume", "--foreground", "--notify", url, "--notify-on", "started,succeeded")
    assert r.exit_code == 0, r.output
    wait_for(lambda: "succeeded" in hook.events(), "succeeded")
    assert hook.events() == ["started", "succeeded"] and hook.got[0][2]["details"]["attempt"] == 2
    assert url not in r.output


def test_a_message_in_flight_when_the_supervisor_ends_is_not_sent_twice(tmp_path):
    """close() hands on a try still under way as in flight: the try goes through and is recorded by the
    supervisor's thread; the detached child, which waits for that record, sends nothing again."""
    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"ok": True}])
    got = tmp_path / "got.txt"
    spec = NotifySpec(cmd=f"echo sent >> {got}")
    nt.keep_spec(run_dir, spec)
    release, handed = threading.Event(), []

    def slow(target, msg, env, limit):
        release.wait(10)
        return nt.deliver(target, msg, env, limit)

    n = nt.Notifier(run_dir, spec, env, send=slow, close_wait=0.05, spawn=child_taking(handed))
    n.event("started")
    wait_for(lambda: any(getattr(j, "sending", False) for j in n._pending), "the try under way")
    n.close()
    assert [(j["msg"]["event"], j["in_flight"]) for j in handed] == [("started", True)]
    release.set()
    wait_for(lambda: [e for e in read_events(run_dir) if e["event"] == "notified"], "the thread's record")
    t0 = time.monotonic()
    nt._finish_jobs(run_dir, env, handed)  # the child: finds the record, sends nothing
    assert time.monotonic() - t0 < 1 and got.read_text() == "sent\n"
    assert len([e for e in read_events(run_dir) if e["event"] == "notified"]) == 1


def test_the_message_takes_the_step_of_the_last_record_past_the_throttled_state():
    rec = (
        b'{"current_steps": 7, "total_steps": 40, "loss": 6.1}\n{"current_steps": 8, "total_steps": 40, "loss": 6.2}\n'
    )
    assert nt.latest_step(rec, 7, 40, 6.1) == (8, 40, 6.2)  # the state lags a step: the record's
    assert nt.latest_step(rec, 8, 40, 6.2) == (8, 40, 6.2) == nt.latest_step(rec, None, None, None)
    assert nt.latest_step(rec, 12, 40, 5.0) == (12, 40, 5.0)  # a resumed attempt below the state's step
    marked = rec + b'{"ftlaunch_attempt": 2, "resume_from": "checkpoint-4"}\n'
    assert nt.latest_step(marked, 7, 40, 6.1) == (7, 40, 6.1)  # a new attempt, no step of its own yet
    assert nt.latest_step(b"", None, None, None) == (None, None, None)
