"""The two warnings that reach notification destinations from outside the supervisor's loop (issue 35):
the disk forecast when a run is started (`disk_forecast`: the run as configured fills the disk at step
N) and a change of a deciding package taken at an attempt's start (`env_changed`, accepted). Both are
handed to the detached notify child (run/notify.notice): the start and the supervisor never wait."""

from __future__ import annotations

import json
from pathlib import Path

from ftlaunch.run import notify as nt
from ftlaunch.run.state import StartFacts
from ftlaunch.run.store import read_events

from ..conftest import needs_train_stack
from ..fake_trainer import write_config
from ..helpers import wait_for
from .test_environment import edit_recorded, failed_with_a_checkpoint
from .test_notify import child_taking
from .test_reliability import cli, fake  # noqa: F401  (the scripted trainer, in-process)

FILLS = "the disk fills at step 12: 1 of 3 checkpoints of 1.8 MB fit in 2.4 MB free on /mnt/small (tmpfs)"


def box_cmd(box: Path) -> str:
    """A --notify-cmd keeping each message in BOX/EVENT.json and when it came in BOX/EVENT.t (one file
    each: the detached child and the supervisor's thread may deliver at the same time)."""
    box.mkdir(exist_ok=True)
    return f"cat > {box}/$FTLAUNCH_EVENT.json; date +%s.%N > {box}/$FTLAUNCH_EVENT.t"


def messages(box: Path) -> dict[str, dict]:
    """What the box_cmd got, by event: the message and when it came (``arrived``)."""
    got = {}
    for path in box.glob("*.t") if box.exists() else ():
        if path.read_text().strip():
            got[path.stem] = {**json.loads(path.with_suffix(".json").read_text()), "arrived": float(path.read_text())}
    return got


def test_the_forecast_names_the_step_and_goes_only_where_it_was_chosen(tmp_path, isolated_home):
    spawned: list[dict] = []
    Child = child_taking(spawned)  # noqa: N806
    run_dir = isolated_home / "runs" / "r1"
    run_dir.mkdir(parents=True)
    nt.keep_spec(run_dir, nt.NotifySpec(cmd="true", on=frozenset({"disk_forecast"})))
    disk = {"verdict": {"kind": "warn", "fill_step": 12}, "filesystem": "/mnt/small (tmpfs)"}
    facts = StartFacts(disk=disk, warnings=(FILLS,))
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    assert nt.notice_forecast(run_dir, env, facts, spawn=Child)
    (job,) = spawned
    assert job["event"] == "disk_forecast" and job["seen_at"]
    assert job["details"] == {"message": FILLS, "fill_step": 12, "filesystem": "/mnt/small (tmpfs)"}
    assert not nt.notice_forecast(run_dir, env, StartFacts(disk=disk), spawn=Child)  # no warning: nothing said
    nt.keep_spec(run_dir, nt.NotifySpec(cmd="true", on=frozenset({"failed"})))
    assert not nt.notice_forecast(run_dir, env, facts, spawn=Child) and len(spawned) == 1  # not chosen


def test_a_run_started_with_the_forecast_warning_notifies_it(tmp_path, fake, isolated_home, monkeypatch):  # noqa: F811
    from ftlaunch.run import disk

    monkeypatch.setattr(disk, "disk_check", lambda *a, **k: StartFacts(warnings=(FILLS,)))
    box = tmp_path / "box"
    fake({"ok": True, "steps": 4})
    r = cli(
        "train", str(write_config(tmp_path)), "--gpu", "A10G", "--foreground",
        "--notify-cmd", box_cmd(box), "--notify-on", "disk_forecast,succeeded",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    wait_for(lambda: set(messages(box)) == {"disk_forecast", "succeeded"}, "forecast and succeeded")
    forecast = messages(box)["disk_forecast"]
    run_id = next(p.name for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    assert forecast["run_id"] == run_id and forecast["details"]["message"] == FILLS
    assert "log_tail" not in forecast  # a warning, not a failure
    assert forecast["text"].startswith("ftlaunch: run out disk_forecast\n") and "fills at step 12" in forecast["text"]
    latency = forecast["arrived"] - forecast["seen_at"]
    print(f"\ndisk_forecast: the start handed it on -> the command had it {latency:.2f} s")


@needs_train_stack
def test_a_resume_that_takes_a_changed_environment_notifies_it(tmp_path, fake, isolated_home):  # noqa: F811
    run_dir = failed_with_a_checkpoint(tmp_path, fake, isolated_home)
    now = json.loads((run_dir / "environment" / "attempt-2.json").read_text())["packages"]
    edit_recorded(run_dir, 2, transformers="4.49.0")
    fake({"train": True, "steps": 8, "save_steps": 4})
    box = tmp_path / "box"
    r = cli(
        "resume", run_dir.name, "--foreground", "--allow-env-change",
        "--notify-cmd", box_cmd(box), "--notify-on", "env_changed,succeeded",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    wait_for(lambda: set(messages(box)) == {"env_changed", "succeeded"}, "env_changed, succeeded")
    m = messages(box)["env_changed"]
    print(f"\nenv_changed: the attempt's check handed it on -> the command had it {m['arrived'] - m['seen_at']:.2f} s")
    d = m["details"]
    assert m["run_id"] == run_dir.name and d["attempt"] == 3 and d["accepted"] is True
    assert d["deciding"] == [{"what": "transformers", "before": "4.49.0", "after": now["transformers"]}]
    assert f"transformers 4.49.0 -> {now['transformers']}" in d["changes"]
    delivered = wait_for(
        lambda: [e for e in read_events(run_dir) if e["event"] == "notified" and e["notice"] == "env_changed"], "it"
    )
    assert delivered[0]["ok"] and delivered[0]["target"] == "command cat ***"
