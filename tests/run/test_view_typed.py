"""RunView (run/view.py): typed fields for the CLI and the scheduler, to_json the `status --json` shape."""

from __future__ import annotations

from ftlaunch.run.procs import Liveness
from ftlaunch.run.state import FailureKind, RunState, RunStatus
from ftlaunch.run.store import write_state
from ftlaunch.run.view import RunView, all_runs, run_view


def test_a_dead_supervisors_run_is_lost_typed_and_its_json_keeps_the_plain_strings(tmp_path):
    run_dir = tmp_path / "runs" / "R1"
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("")
    write_state(run_dir, RunState(id="R1", status=RunStatus.RUNNING, pid=2**22 + 7, pid_start=1.0,
                                  failure_kind=FailureKind.CRASH, message="retrying...",
                                  progress={"step": 3, "total_steps": 9, "loss": 1.25}))  # fmt: skip
    v = run_view(run_dir, now=1000.0)
    assert v.status is RunStatus.LOST and v.supervisor_alive is Liveness.DEAD and v.loss == 1.25
    assert v.last_message == "retrying..." and v.message.startswith("lost:")
    d = v.to_json()
    assert (d["status"], d["supervisor_alive"], d["failure_kind"]) == ("lost", "dead", "crash")
    assert all(type(d[k]) is str for k in ("status", "supervisor_alive", "trainer_alive", "failure_kind"))
    assert list(d)[:3] == ["id", "name", "status"] and list(d)[-4:] == [
        "tokens_per_second", "wall_seconds", "gpu_hours", "gpu_hours_projected",
    ]  # fmt: skip
    assert d["no_progress_attempts"] == 0 and d["stall_phase"] is None and len(d) == 44
    assert d["supervisor_last_word"] is None  # no supervisor left one (issue 31)


def test_an_unreadable_run_is_a_view_with_its_four_keys(tmp_path):
    home = tmp_path / "home"
    bad = home / "runs" / "R2"
    bad.mkdir(parents=True)
    (bad / "state.json").write_text("{not json")
    rows = all_runs({"FTLAUNCH_HOME": str(home)})
    assert [type(r) for r in rows] == [RunView] and rows[0].status is RunStatus.UNREADABLE
    assert list(rows[0].to_json()) == ["id", "status", "message", "run_dir"]
    assert rows[0].to_json()["status"] == "unreadable" and "unreadable" in rows[0].message
