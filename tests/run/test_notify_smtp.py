"""apprise (the ``notify`` extra) delivering the supervisor's notifications as e-mail to a real SMTP
server (aiosmtpd on 127.0.0.1, a free port, AUTH LOGIN/PLAIN without TLS) from real runs of the
scripted trainer: the subject and body carry the run and the event; the SMTP password and HF_TOKEN
are in no mail, file, event, log or printout (secrets.json, 0600, holds the destination)."""

from __future__ import annotations

import email
import email.policy
import json
import secrets
import socket
import time
from datetime import datetime
from email.message import EmailMessage
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.run.store import read_events

from ..fake_trainer import write_config
from ..helpers import wait_for
from .test_reliability import fake  # noqa: F401  (the scripted trainer, in-process)

pytest.importorskip("apprise", reason="the notify extra is not installed: pip install 'ftlaunch[notify]'")
controller = pytest.importorskip("aiosmtpd.controller", reason="aiosmtpd (a dev dependency) is not installed")
smtp = pytest.importorskip("aiosmtpd.smtp", reason="aiosmtpd (a dev dependency) is not installed")


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Mailbox:
    """An SMTP server on 127.0.0.1 that takes one login and keeps every mail with the time it arrived."""

    def __init__(self, user: str, password: str) -> None:
        self.user, self.password = user, password
        self.got: list[tuple[float, EmailMessage, bytes]] = []
        self.logins: list[bytes] = []
        box = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):  # noqa: N802
                raw = envelope.original_content or envelope.content
                box.got.append((time.time(), email.message_from_bytes(raw, policy=email.policy.default), raw))
                return "250 OK"

        def auth(server, session, envelope, mechanism, data):
            ok = isinstance(data, smtp.LoginPassword) and (data.login, data.password) == (
                user.encode(),
                password.encode(),
            )
            box.logins.append(data.login if isinstance(data, smtp.LoginPassword) else b"?")
            return smtp.AuthResult(success=ok)

        self.port = free_port()
        self.ctl = controller.Controller(
            Handler(), hostname="127.0.0.1", port=self.port, authenticator=auth, auth_require_tls=False
        )
        self.ctl.start()

    def subjects(self) -> list[str]:
        return [str(m["Subject"]) for _, m, _ in self.got]

    def body(self, i: int) -> str:
        return self.got[i][1].get_body(preferencelist=("plain",)).get_content()

    def close(self) -> None:
        self.ctl.stop()


@pytest.fixture
def mailbox():
    box = Mailbox("ftl", "pw-" + secrets.token_hex(8))
    yield box
    box.close()


def test_a_failed_run_is_mailed_through_apprise_with_its_run_and_event_and_no_secret(
    tmp_path,
    fake,  # noqa: F811
    isolated_home,
    mailbox,
    monkeypatch,
):
    hf_token = "hf_" + secrets.token_hex(16)
    monkeypatch.setenv("HF_TOKEN", hf_token)
    password = mailbox.password
    url = f"mailto://ftl:{password}@127.0.0.1:{mailbox.port}?from=ftl@example.org&to=me@example.org&mode=insecure"
    # the trainer prints HF_TOKEN into its log, then fails: the log's tail goes into the mail, redacted
    fake({"print_env": "HF_TOKEN", "config_error": "unknown key: bogus_key"})
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", "--notify", url)
    assert r.exit_code != 0
    wait_for(lambda: len(mailbox.got) == 2, "two mails (started, failed)")
    run_dir = next(p for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    run_id = run_dir.name
    # the failed run's end may overtake its start when the start's delivery was under way at the end
    assert sorted(mailbox.subjects()) == ["ftlaunch: run out failed (config_error)", "ftlaunch: run out started"]
    first = mailbox.subjects()[0].endswith("started")
    started, failed = mailbox.body(0 if first else 1), mailbox.body(1 if first else 0)
    assert f"run {run_id} on " in started and "status " in started
    assert f"run {run_id} on " in failed and "status failed" in failed
    assert "unknown key: bogus_key" in failed and "last lines of the log:" in failed
    assert "printed ***" in failed  # HF_TOKEN was in the log's last lines: redacted
    assert mailbox.logins and set(mailbox.logins) == {b"ftl"}  # it logged in with the URL's user
    for _, msg, raw in mailbox.got:
        assert hf_token.encode() not in raw and password.encode() not in raw
        assert msg["From"] == "ftl@example.org" and msg["To"] == "me@example.org"
    # delivery latency: the supervisor's event -> the SMTP server had the mail
    events = read_events(run_dir)
    seen = {e["event"]: datetime.fromisoformat(e["t"]).timestamp() for e in events if e["event"] == "failed"}
    smtp_latency = mailbox.got[1 if first else 0][0] - seen["failed"]
    notified = wait_for(
        lambda: (got := [e for e in read_events(run_dir) if e["event"] == "notified"]) and len(got) == 2 and got,
        "2 notified events",
    )
    print(
        f"\nSMTP through apprise: failed event -> mail on the server {smtp_latency * 1000:.0f} ms; "
        f"notifier's latency (seen -> delivered) {[e['latency_s'] for e in notified]} s"
    )
    assert smtp_latency < 5
    assert all(e["ok"] and e["tries"] == 1 and e["target"] == "mailto://***" for e in notified)
    # the password and the token: in no file but secrets.json, and in no printout
    shown = "".join(cli(*a).output for a in (("status", "--json"), ("status",), ("runs", "--json"), ("logs",)))
    for secret in (password, hf_token):
        assert secret not in shown + r.output
        held = sorted(
            p.name for p in Path(isolated_home).rglob("*") if p.is_file() and secret in p.read_text("latin-1")
        )
        assert held == (["secrets.json"] if secret == password else []), (secret[:3], held)
    assert json.loads((run_dir / "secrets.json").read_text())["ftlaunch_notify"]["urls"] == [url]


def test_a_mail_that_cannot_be_delivered_says_apprises_reason_and_no_part_of_the_url(
    tmp_path,
    fake,  # noqa: F811
    isolated_home,
):
    password = "pw-" + secrets.token_hex(8)
    url = f"mailto://ftl:{password}@127.0.0.1:{free_port()}?from=ftl@example.org&to=me@example.org&mode=insecure"
    fake({"ok": True, "steps": 4})
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", "--notify", url)
    assert r.exit_code == 0, r.output
    run_dir = next(p for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    given_up = wait_for(
        lambda: (got := [e for e in read_events(run_dir) if e["event"] == "notified"]) and len(got) == 2 and got,
        "both messages given up",
    )
    for e in given_up:
        assert not e["ok"] and e["tries"] == 3 and e["target"] == "mailto://***"
        # apprise's own words (2.3.0: 'Connection error while submitting email to "***"'), the URL's parts masked
        assert e["error"].startswith("apprise could not deliver to mailto://***: ") and "error" in e["error"].lower()
        assert "127.0.0.1" not in e["error"] and password not in e["error"]
    held = sorted(p.name for p in Path(isolated_home).rglob("*") if p.is_file() and password in p.read_text("latin-1"))
    assert held == ["secrets.json"]
