# ruff: noqa: F811  (the imported `fake` fixture is taken as a parameter)
"""Issue 31's smaller points in the guard's own files: a divergence message never says "left in place:
none" while a partial checkpoint is left; an environment record of another version, empty or torn is
never taken as an unchanged environment (resume refuses, exit 18, unless --allow-env-change)."""

from __future__ import annotations

import json
import os

import pytest

from ftlaunch.errors import EnvChangedError, ExitCode
from ftlaunch.run import health as h
from ftlaunch.run.environment import (
    UnreadableRecord,
    at_attempt_start,
    attempt_path,
    parse_record,
    recorded,
    refuse_resume,
)
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import read_events, write_state

from ..conftest import needs_train_stack
from .test_environment import failed_with_a_checkpoint
from .test_healthy_end import every, watch
from .test_reliability import cli, fake, starts  # noqa: F401  (fake: the scripted trainer, a fixture)

# ---------------------------------------------------------------- "left in place: none" with a partial left


def test_a_partial_checkpoint_left_by_the_stop_is_set_aside_and_said(tmp_path):
    w, out, values, _ = watch(tmp_path)  # complete checkpoints 10, 20, 30, 40
    partial = out / "checkpoint-50"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # cut short by the stop
    w.feed(every(1, 4))
    w.feed([{"current_steps": 5, "loss": float("nan")}])  # diverged before every checkpoint: none is clean
    d = w.after(out, values, weights_only=False)
    assert d.action is h.Response.GIVE_UP and d.message.endswith("; every checkpoint is kept; left in place: none")
    assert not list(out.glob("checkpoint-*"))  # what the message says
    (moved,) = out.glob("incomplete-checkpoint-50-*")
    assert f"checkpoint-50 -> {moved.name} (incomplete: " in d.message
    ev = [e for e in read_events(w.run_dir) if e["event"] == "checkpoint_set_aside"]
    assert f"checkpoint-50 -> {moved.name}" in ev[-1]["moved"]


def test_an_older_partial_checkpoint_is_named_as_left_where_it_is(tmp_path):
    w, out, values, _ = watch(tmp_path, policy="stop")
    (out / "checkpoint-5").mkdir()  # older than every complete one: llamafactory never picks it
    w.feed(every(1, 34))
    w.feed([{"current_steps": 35, "loss": float("nan")}])
    d = w.after(out, values, weights_only=False)
    assert d.action is h.Response.STOP
    assert "; incomplete, left as they are: checkpoint-5; every checkpoint is kept; left in place: " in d.message
    left = d.message.rsplit("left in place: ", 1)[1].split(", ")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted([*left, "checkpoint-5"])


# ---------------------------------------------------------------- environment records that cannot be read

GOOD = {"version": 1, "attempt": 1, "python": "/x/python", "packages": {"torch": "2.8.0"}}
BAD = {
    "another version": (json.dumps({**GOOD, "version": 99}), "format version 99"),
    "empty": ("", "it is empty"),
    "torn": (json.dumps(GOOD)[:30], "it is torn"),
    "not a record": ("[1, 2]", "not a record (a JSON list)"),
    "no packages": (json.dumps({"version": 1}), "no package list"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_an_unreadable_record_is_never_taken_as_unchanged(tmp_path, kind):
    text, why = BAD[kind]
    with pytest.raises(UnreadableRecord) as exc:
        parse_record(text)
    assert why in exc.value.message
    run_dir = tmp_path / "run"
    attempt_path(run_dir, 1).parent.mkdir(parents=True)
    attempt_path(run_dir, 1).write_text(json.dumps(GOOD))
    attempt_path(run_dir, 2).write_text(text)  # the newest: an older good one is not used in its place
    with pytest.raises(UnreadableRecord):
        recorded(run_dir)
    assert recorded(run_dir, before=2).packages == {"torch": "2.8.0"}
    state = RunState(id="run", status=RunStatus.FAILED)
    with pytest.raises(EnvChangedError) as refused:
        refuse_resume(run_dir, dict(os.environ), state, "checkpoint-4")
    assert refused.value.exit_code == ExitCode.ENV_CHANGED and why in refused.value.message
    assert "is unknown" in refused.value.message and "--allow-env-change" in (refused.value.hint or "")
    refuse_resume(run_dir, dict(os.environ), state, None)  # nothing to resume from: nothing to compare


def test_a_supervisor_attempt_says_it_and_records_its_own(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_state(run_dir, RunState(id="run", status=RunStatus.RUNNING))
    attempt_path(run_dir, 1).parent.mkdir(parents=True)
    attempt_path(run_dir, 1).write_text(BAD["another version"][0])
    assert at_attempt_start(run_dir, 2, dict(os.environ), resuming=True, say=lambda _: None) is None
    ev = [e for e in read_events(run_dir) if e["event"] == "environment_unreadable"]
    assert len(ev) == 1 and ev[0]["attempt"] == 2 and "format version 99" in ev[0]["message"]
    assert recorded(run_dir).attempt == 2  # the next restart compares with this one


@needs_train_stack
@pytest.mark.parametrize("kind", ["another version", "torn"])
def test_resume_refuses_across_an_unreadable_record_unless_allowed(tmp_path, fake, isolated_home, kind):
    run_dir = failed_with_a_checkpoint(tmp_path, fake, isolated_home)
    attempt_path(run_dir, 2).write_text(BAD[kind][0])
    fake({"train": True, "steps": 8, "save_steps": 4})
    r = cli("resume", run_dir.name, "--foreground")
    assert r.exit_code == 18, r.output
    flat = " ".join(r.output.split())
    assert BAD[kind][1] in flat and "checkpoint-4" in flat and "--allow-env-change" in flat
    assert starts(tmp_path) == 2  # nothing started
    r = cli("resume", run_dir.name, "--foreground", "--allow-env-change")
    assert r.exit_code == 0, r.output
    assert starts(tmp_path) == 3 and recorded(run_dir).attempt == 3


# ---------------------------------------------------------------- the ETA while recovering


def test_the_resume_point_keeps_the_furthest_step_until_it_is_passed():
    from ftlaunch.run import progress as prog

    before = {"step": 37, "total_steps": 40, "loss": 1.2}
    p = prog.resume_point(before, 30)
    assert (p.step, p.total_steps, p.furthest, p.loss) == (30, 40, 37, None)
    assert prog.furthest_step(p.to_dict()) == 37  # a restart that fails while loading still recovers to 37
    recs = [{"current_steps": s, "total_steps": 40, "loss": 1.0} for s in (31, 32)]
    assert prog.latest_progress(recs, furthest=37).furthest == 37
    assert prog.furthest_step(prog.latest_progress(recs, furthest=37).to_dict()) == 37
    recs.append({"current_steps": 38, "total_steps": 40, "loss": 1.0})
    assert prog.latest_progress(recs, furthest=37).furthest is None  # passed: running again
    assert prog.resume_point(None, 0) == prog.Progress(step=0)


def test_status_while_recovering_shows_the_resume_point_and_an_eta_from_it_never_0m00s(tmp_path):
    import threading
    import time

    from ftlaunch.run.state import RunStatus
    from ftlaunch.run.supervisor import Supervisor
    from ftlaunch.run.view import run_view

    from .test_recovery import make_run

    train = {"train": True, "steps": 24, "save_steps": 4, "step_sleep": 0.2}  # ~5 steps/s
    run_dir, env = make_run(tmp_path, [{**train, "crash_after_saves": 1}, {"sleep": 8, **train}])
    seen: list[tuple[float, int | None, float | None]] = []
    done = threading.Event()

    def watch_status() -> None:  # `status` while the supervisor (this thread: its signals) runs
        while not done.is_set():
            v = run_view(run_dir)
            if v.status is RunStatus.RECOVERING and "fake trainer attempt 2" in (run_dir / "train.log").read_text():
                seen.append((time.monotonic(), v.step, v.eta_seconds))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_status, daemon=True)
    watcher.start()
    try:
        codes = [Supervisor(run_dir, env, poll=0.05).run()]
    finally:
        done.set()
        watcher.join(timeout=10)
    assert codes == [0]
    loading = [(t, step, eta) for t, step, eta in seen if t - seen[0][0] < 7.5]  # the 8 s load of attempt 2
    assert len(loading) > 10 and all(step == 4 for _, step, _ in loading), loading
    # 20 steps left from checkpoint-4 at the first attempt's ~5 steps/s: ~4 s, refreshed every second
    # (it was counted down from the first attempt's step to 0m00s after ~4 s of loading)
    # Never a countdown to 0m00s. Under heavy load the supervisor may read the first attempt's four
    # steps in one poll, and then has no rate to count with: no ETA ("-"), never a wrong one.
    etas = [eta for _, _, eta in loading]
    assert all(eta is None or eta >= 1.5 for eta in etas), loading
