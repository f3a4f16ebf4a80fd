"""$FTLAUNCH_HOME/notify.yaml: the destinations of every run given none of its own (issue 35), read at
each start, so a resumed or cron'd run notifies without flags. A wrong file is refused before anything
is written (exit 19, the file and each key named, no value quoted); a destination's token is in no
state, event, log, plan, bundle or printout."""

from __future__ import annotations

import json
import secrets
import socket
import tarfile
import textwrap

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import ExitCode, NotifyConfigError
from ftlaunch.run.notify import EVENTS, NotifySpec, Route, parse_file
from ftlaunch.run.store import read_events

from ..fake_trainer import write_config
from ..helpers import said, wait_for
from .test_notify import Hook, files_holding, run_dir_of
from .test_reliability import fake  # noqa: F401  (the scripted trainer, in-process)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def dead_url(path: str) -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    return f"http://127.0.0.1:{port}/{path}"


def test_the_file_as_destinations_each_with_its_events():
    text = textwrap.dedent(
        """\
        on: [failed, stalled]
        destinations:
          - url: https://hooks.example.org/T0K3N
            on: started, succeeded
          - url: mailto://u:pw@smtp.example.org?to=me@example.org
          - cmd: jq -r .event >> ~/ftl-events.txt
            on: all
        """
    )
    spec = parse_file(text, "notify.yaml", apprise_ok=True)
    assert spec.routes == (
        Route("https://hooks.example.org/T0K3N", frozenset({"started", "succeeded"})),
        Route("mailto://u:pw@smtp.example.org?to=me@example.org", frozenset({"failed", "stalled"})),
        Route("cmd:jq -r .event >> ~/ftl-events.txt", frozenset(EVENTS)),
    )
    assert [spec.wants(i, "started") for i in range(3)] == [True, False, True]
    assert spec.events() == frozenset(EVENTS)
    assert "u:pw" in spec.secret_values()[1] and spec.secret_values()[2].startswith("jq ")
    assert NotifySpec.from_json(spec.to_json()) == spec
    assert parse_file("", "notify.yaml", True) == NotifySpec() == parse_file("destinations: []", "n", True)
    # the run's own destinations keep their --notify-on; FTLAUNCH_NOTIFY's URLs come first, with the run's events
    both = NotifySpec(on=frozenset({"failed"}), routes=spec.routes).with_env({"FTLAUNCH_NOTIFY": "https://b/2"})
    assert both.destinations()[0] == "https://b/2" and both.wants(0, "failed") and not both.wants(0, "started")
    assert both.wants(1, "started")


def test_a_wrong_file_lists_every_problem_by_key_and_quotes_no_value():
    text = textwrap.dedent(
        """\
        destinatons: []
        on: [failed, exploded]
        destinations:
          - url: https://hooks.example.org/T0K3N
            cmd: echo hi
          - url: hooks.example.org/S3CR3T
          - url: slack://TA/TB/S3CR3T
          - cmd: ""
          - "https://x/y"
          - url: https://ok.example.org/x
            on: [started, stall]
            when: always
        """
    )
    with pytest.raises(NotifyConfigError) as e:
        parse_file(text, "/home/u/.ftl/notify.yaml", apprise_ok=False)
    err = e.value
    assert err.exit_code == ExitCode.NOTIFY_CONFIG == 19
    assert err.message.startswith("/home/u/.ftl/notify.yaml: 9 problems:")
    expected = [
        "unknown key(s) destinatons (known: destinations, on)",
        "on: unknown event(s) exploded (choose among: started,",
        "destinations (entry 1): give one of url, cmd (not both)",
        "destinations (entry 2): url: ***: not a URL (scheme://...)",
        "destinations (entry 3): url: slack://***: needs apprise",
        "destinations (entry 4): cmd: expected a non-empty string",
        "destinations (entry 5): expected a mapping with `url:` or `cmd:`",
        "destinations (entry 6): unknown key(s) when (known: url, cmd, on)",
        "destinations (entry 6): on: unknown event(s) stall",
    ]
    assert [next(p for p in err.problems if p.startswith(x)) for x in expected]
    assert "T0K3N" not in err.message and "S3CR3T" not in err.message and "destinations:" in (err.hint or "")
    with pytest.raises(NotifyConfigError) as e:
        parse_file("destinations:\n  - url: https://x/T0K3N\n   on: [x]\n", "n.yaml", True)
    assert e.value.message.startswith("n.yaml: not YAML at line 3") and "T0K3N" not in e.value.message
    with pytest.raises(NotifyConfigError) as e:
        parse_file("- https://x/y\n", "n.yaml", True)
    assert "expected a mapping with `destinations:`" in e.value.message


def test_train_with_a_wrong_file_exits_19_naming_it_and_writes_nothing(tmp_path, fake, isolated_home):  # noqa: F811
    isolated_home.mkdir(parents=True)
    path = isolated_home / "notify.yaml"
    path.write_text("destinations:\n  - url: https://hooks.example.org/T0K3N\n    on: [failed, explode]\n")
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground")
    assert r.exit_code == 19, r.output
    assert said(f"{path}: destinations (entry 1): on: unknown event(s) explode", r.output)
    assert "T0K3N" not in r.output
    runs = isolated_home / "runs"
    assert not runs.exists() or not [p for p in runs.iterdir()]  # no run, not even a hidden half of one
    assert not (tmp_path / "out").exists() and not (tmp_path / "counter").exists()  # nor a trainer start
    # --notify given: the file is not read (the run's own destinations win)
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", "--notify-cmd", "true")
    assert r.exit_code == 0, r.output


def test_a_run_without_flags_notifies_the_file_and_no_token_is_shown_anywhere(
    tmp_path,
    fake,  # noqa: F811
    isolated_home,
    hook,
    monkeypatch,
):
    token, dead_token = secrets.token_hex(16), secrets.token_hex(16)
    got_cmd = tmp_path / "cmd.txt"
    url, dead, cmd = (
        f"http://127.0.0.1:{hook.port}/hook/{token}",
        dead_url(dead_token),
        f"echo $FTLAUNCH_EVENT >> {got_cmd}",
    )
    isolated_home.mkdir(parents=True)
    (isolated_home / "notify.yaml").write_text(
        textwrap.dedent(
            f"""\
            destinations:
              - url: {url}
                on: [started, succeeded]
              - url: {dead}
                on: [succeeded]
              - cmd: {cmd}
                on: succeeded
            """
        )
    )
    fake({"config_error": "unknown key: bogus_key"}, {"ok": True, "steps": 4})
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground")
    assert r.exit_code != 0
    wait_for(lambda: hook.got, "started")
    run_dir = run_dir_of(isolated_home)
    # the file's events only: started to the hook, `failed` chosen by none
    wait_for(lambda: [e for e in read_events(run_dir) if e["event"] == "notified"], "the started delivery")
    assert hook.events() == ["started"] and not got_cmd.exists()
    # resumed without flags: the file is read again at this start
    r = cli("resume", "--foreground")
    assert r.exit_code == 0, r.output
    wait_for(lambda: "succeeded" in hook.events(), "succeeded")
    assert hook.events() == ["started", "started", "succeeded"] and hook.got[1][2]["details"]["attempt"] == 2
    wait_for(lambda: got_cmd.exists() and got_cmd.read_text().strip(), "the command")
    assert got_cmd.read_text() == "succeeded\n"
    failed = wait_for(
        lambda: [e for e in read_events(run_dir) if e["event"] == "notified" and not e["ok"]], "the dead one given up"
    )
    assert failed[0]["tries"] == 3 and "Connection refused" in failed[0]["error"]
    # each destination's `notified` event is written once its delivery ends (the command's after it ran)
    targets = {f"http://127.0.0.1:{hook.port}/***", failed[0]["target"], "command echo ***"}
    wait_for(
        lambda: {e["target"] for e in read_events(run_dir) if e["event"] == "notified"} == targets,
        "a notified event from each destination",
    )
    # the tokens: in notify.yaml only, never in a run's file (state, events, logs, plans), printout or bundle
    bundle = tmp_path / "b.tar.gz"
    assert cli("bundle", run_dir.name, "-o", str(bundle)).exit_code == 0
    with tarfile.open(bundle) as tar:
        packed = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
    shown = "".join(cli(*a).output for a in (("status", "--json"), ("status",), ("runs", "--json"), ("logs",)))
    for t in (token, dead_token):
        assert t not in shown + r.output and t.encode() not in packed
        assert files_holding(t, isolated_home, tmp_path / "out") == ["notify.yaml"]
    kept = run_dir / "secrets.json"  # the file is read at each start, never copied into the run
    assert not kept.exists() or "ftlaunch_notify" not in json.loads(kept.read_text())
    # planted in stacks/ (as a trainer's dump could hold them): the bundle masks the file's destinations
    # and FTLAUNCH_NOTIFY's URLs, which the run never kept either
    env_url = f"https://hooks.example.org/{secrets.token_hex(16)}"
    monkeypatch.setenv("FTLAUNCH_NOTIFY", env_url)
    (run_dir / "stacks").mkdir(exist_ok=True)
    (run_dir / "stacks" / "planted.txt").write_text(f"{url} {dead} {env_url} {cmd}\n")
    assert cli("bundle", run_dir.name, "-o", str(bundle)).exit_code == 0
    with tarfile.open(bundle) as tar:
        planted = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("planted.txt"))).read()
    assert planted.strip() == b"*** *** *** ***"


def test_the_supervisor_notes_a_file_gone_wrong_after_the_start_was_checked_and_runs_on(
    tmp_path,
    fake,  # noqa: F811
    isolated_home,
    hook,
    monkeypatch,
):
    """The file is checked by `train`, then broken before the supervisor reads it: the run is not hurt,
    FTLAUNCH_NOTIFY's URLs still notify, and the events say why the file's did not."""
    from ftlaunch.run import notify as nt

    monkeypatch.setenv("FTLAUNCH_NOTIFY", f"http://127.0.0.1:{hook.port}/env")
    isolated_home.mkdir(parents=True)
    path = isolated_home / "notify.yaml"
    path.write_text("destinations: []\n")
    original = nt.Notifier.for_run.__func__

    def broken_first(cls, run_dir, env, **kw):
        path.write_text("destinations: 3\n")
        return original(cls, run_dir, env, **kw)

    monkeypatch.setattr(nt.Notifier, "for_run", classmethod(broken_first))
    fake({"ok": True, "steps": 4})
    r = cli("train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground", "--notify-on", "succeeded")
    assert r.exit_code == 0, r.output
    wait_for(lambda: hook.got, "succeeded through FTLAUNCH_NOTIFY")
    assert hook.events() == ["succeeded"]
    noted = [e for e in read_events(run_dir_of(isolated_home)) if e["event"] == "notify_config_error"]
    assert len(noted) == 1 and "destinations: expected a list" in noted[0]["message"]


def test_an_unreadable_file_is_named_and_a_home_that_is_a_file_is_left_to_exit_12(tmp_path):
    from ftlaunch.run.notify import load_file

    home = tmp_path / "home"
    (home / "notify.yaml").mkdir(parents=True)
    with pytest.raises(NotifyConfigError) as e:
        load_file({"FTLAUNCH_HOME": str(home)})
    assert e.value.message.startswith(f"{home / 'notify.yaml'}: the file is a directory, not a regular file")
    (tmp_path / "file").write_text("")
    assert load_file({"FTLAUNCH_HOME": str(tmp_path / "file")}) == NotifySpec()
