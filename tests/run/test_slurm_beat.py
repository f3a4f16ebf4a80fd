"""The Slurm batch step's heartbeat (ftlaunch/run/slurm/beat.py), its pure verdict and its file (fast
lane; the real cluster's case is tests/run/test_slurm_faults5.py)."""

from __future__ import annotations

from ftlaunch.run.slurm.beat import SILENT_S, beat, read_beat, silent_for

NOW = 1_000_000.0


def test_a_beat_of_this_job_older_than_the_limit_with_no_state_written_since_is_silent():
    last = {"job": "7", "t": NOW - SILENT_S - 5}
    assert silent_for(last, "7", NOW - 60, NOW) == SILENT_S + 5


def test_a_recent_beat_or_a_recent_state_write_is_alive():
    assert silent_for({"job": "7", "t": NOW - 3}, "7", None, NOW) is None
    assert silent_for({"job": "7", "t": NOW - 100}, "7", NOW - 2, NOW) is None  # the supervisor spoke


def test_no_beat_or_another_jobs_beat_says_nothing():
    assert silent_for(None, "7", None, NOW) is None  # a job of an older ftlaunch
    assert silent_for({"job": "6", "t": NOW - 500}, "7", None, NOW) is None  # the run's earlier job
    assert silent_for({"job": "7", "t": "x"}, "7", None, NOW) is None


def test_the_file_is_written_whole_and_read_back(tmp_path):
    assert read_beat(tmp_path) is None
    beat(tmp_path, "12", now=NOW)
    assert read_beat(tmp_path) == {"job": "12", "t": NOW}
    (tmp_path / "slurm-beat.json").write_text("{not json")
    assert read_beat(tmp_path) is None
