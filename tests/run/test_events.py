"""The names of a run's events are its file format (ftlaunch.run.events): every run of before wrote
them, and `status`, `runs`, the estimate's history and the notifier read them back. Pinned here, name
by name: a member renamed, dropped or given another value fails, and an old events.jsonl still reads."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from ftlaunch.run.events import Event
from ftlaunch.run.state import RunStatus
from ftlaunch.run.store import read_events

ROOT = Path(__file__).resolve().parents[2] / "ftlaunch"

PINNED = {
    "CREATED": "created",
    "OUTPUT_DIR_CLAIMED": "output_dir_claimed",
    "STATE_REBUILT": "state_rebuilt",
    "CONFIG_EDITED": "config_edited",
    "REPLANNED": "replanned",
    "RESUMED": "resumed",
    "STOP_REQUESTED": "stop_requested",
    "ORPHAN_STOPPED": "orphan_stopped",
    "CHECKPOINT_LR_REWRITTEN": "checkpoint_lr_rewritten",
    "ATTEMPT_STARTED": "attempt_started",
    "CHECKPOINT_SET_ASIDE": "checkpoint_set_aside",
    "STOPPING": "stopping",
    "RECOVERED": "recovered",
    "CHECKPOINT": "checkpoint",
    "PARTIAL_CHECKPOINT_REMOVED": "partial_checkpoint_removed",
    "GPU_WAIT": "gpu_wait",
    "EXITED": "exited",
    "RETRY": "retry",
    "UNWRITTEN": "unwritten",
    "END_JUDGED": "end_judged",
    "ROLLED_BACK": "rolled_back",
    "ENVIRONMENT": "environment",
    "ENVIRONMENT_CHANGED": "environment_changed",
    "ENVIRONMENT_UNREADABLE": "environment_unreadable",
    "SUCCEEDED": "succeeded",
    "FAILED": "failed",
    "STOPPED": "stopped",
    "LOST": "lost",
    "DIVERGED": "diverged",
    "STALLED": "stalled",
    "NO_PROGRESS": "no_progress",
    "DISK_FULL": "disk_full",
    "ENV_CHANGED": "env_changed",
    "ENDED": "ended",
    "NOTIFIED": "notified",
    "NOTIFY_CONFIG_ERROR": "notify_config_error",
    "LOST_NOTICED": "lost_noticed",
    "SUBMITTED": "submitted",
    "RESUBMITTED": "resubmitted",
    "SLURM_JOB_STARTED": "slurm_job_started",
    "SLURM_NOT_RESUMED": "slurm_not_resumed",
    "MASTER_ADDR": "master_addr",
    "SLURM_SIGNAL": "slurm_signal",
    "REQUEUED": "requeued",
    "REQUEUE_FAILED": "requeue_failed",
    "REQUEUED_BY_SLURM": "requeued_by_slurm",
    "ENDED_BY_SLURM": "ended_by_slurm",
    "SCANCEL": "scancel",
    "RAY_SUBMITTED": "ray_submitted",
    "RAY_JOB_ENDED": "ray_job_ended",
    "RAY_RESUBMIT_FAILED": "ray_resubmit_failed",
    "ENGINE_UNREACHABLE": "engine_unreachable",
    "ENGINE_REACHABLE": "engine_reachable",
    "FOLLOWER_GAVE_UP": "follower_gave_up",
}


def test_every_event_name_is_pinned():
    assert {m.name: m.value for m in Event} == PINNED


def test_a_runs_end_is_the_event_of_its_status():
    for status in RunStatus:
        if status.is_terminal():
            assert Event.ended_as(status) == status.value


def test_an_event_reads_back_equal_to_its_member(tmp_path):
    """What readers rely on: the JSON holds the plain name, and the name read back equals the member."""
    line = json.dumps({"t": "2026-01-01T00:00:00.000+00:00", "event": Event.STOP_REQUESTED, "job_id": "7"})
    assert '"event": "stop_requested"' in line
    (tmp_path / "events.jsonl").write_text(line + "\n")
    (ev,) = read_events(tmp_path)
    assert ev["event"] == Event.STOP_REQUESTED and Event(ev["event"]) is Event.STOP_REQUESTED


def _compared_names(source: str) -> list[tuple[int, str]]:
    """String literals an event's name is compared with: ``e.get("event") == "x"``, ``e["event"] == "x"``."""

    def is_event(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event"
        return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "event"

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and is_event(node.left):
            out += [(node.lineno, c.value) for c in node.comparators if isinstance(c, ast.Constant)]
    return out


def test_every_name_a_reader_matches_is_an_event():
    """A reader that still matches a name as a string (modules outside the journal's reach) matches
    one the journal writes: a typo would never match, silently."""
    known = {m.value for m in Event}
    bad = {
        path.relative_to(ROOT).as_posix(): [
            (n, name) for n, name in _compared_names(path.read_text()) if name not in known
        ]
        for path in sorted(ROOT.rglob("*.py"))
    }
    assert not {k: v for k, v in bad.items() if v}
    assert _compared_names('ok = e.get("event") == "nope"') == [(1, "nope")]
