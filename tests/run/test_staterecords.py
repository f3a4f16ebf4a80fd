"""The typed sub-records of a run's state (ftlaunch.run.staterecords) read and write the JSON state.json
has always held: a state written by main before them (tests/data/state-main-ed0dbf5, every sub-record
filled by main's own producers; tests/data/state-main-f945884, a queued Slurm run) reads typed and is
written back as it was, key for key."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from ftlaunch.run.state import RunState
from ftlaunch.run.staterecords import (
    DiskRecord,
    EngineJob,
    EnvironmentRecord,
    HealthRecord,
    ProgressRecord,
    SlurmAsk,
    StallRecord,
)
from ftlaunch.run.store import read_state, update_state, write_state

DATA = Path(__file__).resolve().parents[1] / "data"
EVERY = DATA / "state-main-ed0dbf5" / "every-record.state.json"
QUEUED = DATA / "state-main-f945884" / "slurm-queued.state.json"
RECORD_KEYS = ("progress", "stall", "health", "diverged", "disk", "environment", "slurm", "slurm_job")


def _run_with(tmp_path: Path, fixture: Path) -> Path:
    run_dir = tmp_path / json.loads(fixture.read_text())["id"]
    run_dir.mkdir()
    shutil.copy(fixture, run_dir / "state.json")
    return run_dir


@pytest.mark.parametrize("fixture", [EVERY, QUEUED], ids=["every-record", "slurm-queued"])
def test_a_state_of_main_is_written_back_as_it_was(tmp_path, fixture):
    run_dir = _run_with(tmp_path, fixture)
    before = json.loads(fixture.read_text())
    write_state(run_dir, read_state(run_dir))
    after = json.loads((run_dir / "state.json").read_text())
    assert after == before
    for key in RECORD_KEYS:  # each sub-record keeps its keys in their order, nulls included
        if key in before:
            assert list(after[key]) == list(before[key]), key


def test_every_sub_record_reads_typed(tmp_path):
    st = read_state(_run_with(tmp_path, EVERY))
    assert isinstance(st.progress, ProgressRecord) and st.progress.step == 12 and st.progress.total_steps == 100
    assert st.progress.throughput == 5123.4 and st.progress.tokens_per_second is None  # not stored by main
    assert isinstance(st.stall, StallRecord) and st.stall.phase == "loading" and st.stall.load_s == 8.5
    assert st.stall.last_progress_at == 1790000010.0 and st.stall.allowance_s == 1800.0
    assert isinstance(st.health, HealthRecord) and st.health.health == "finite" and st.health.first_bad is None
    assert isinstance(st.diverged, HealthRecord) and st.diverged.health == "diverged"
    assert st.diverged.first_bad == {"step": 14, "signal": "nonfinite_loss", "values": {"loss": "nan"}}
    assert st.diverged.last_good_step == 13
    assert isinstance(st.disk, DiskRecord) and st.disk.checkpoint_bytes == 1234 and st.disk.verdict["kind"] == "ok"
    assert isinstance(st.environment, EnvironmentRecord) and st.environment.hash == "abc123"
    assert st.environment.attempt == 2 and st.environment.changed and st.environment.changed["accepted"] is True
    assert isinstance(st.slurm, SlurmAsk) and st.slurm.nodes == 2 and st.slurm.partition == "gpu"
    assert st.job == EngineJob("slurm", "4242", st.slurm, st.slurm_job)
    assert st.job.env and st.job.env["SLURM_JOB_NODELIST"] == "n[1-2]" and st.job.submitted


def test_the_job_of_an_old_state_is_read_from_its_slurm_keys(tmp_path):
    st = read_state(_run_with(tmp_path, QUEUED))  # no "engine" key: written before engines were recorded
    assert st.job.engine == "slurm" and st.job.id == "4242" and st.job.asked and st.job.asked.nodes == 2
    assert st.job.env is None
    assert RunState(id="a").job == EngineJob("local") and not RunState(id="a").job.submitted
    assert RunState(id="r", engine="ray").job == EngineJob("ray")  # Ray keeps its submissions in ray.json


def test_a_record_reads_as_the_mapping_it_replaces():
    p = ProgressRecord.of({"step": 3, "loss": None})
    assert p == {"step": 3, "loss": None} and p["step"] == 3 and p.get("loss") is None and dict(p) == p.to_json()
    assert ProgressRecord.of(p) is p and ProgressRecord.of(None) is None
    assert p.with_(tokens_per_second=12.5).to_json() == {"step": 3, "loss": None, "tokens_per_second": 12.5}
    with pytest.raises(TypeError):
        ProgressRecord.of([1, 2])
    assert ProgressRecord.of({"step": True, "total_steps": "9"}).step is None  # a bool or a string is no step


def test_a_state_field_given_a_mapping_holds_its_record():
    st = RunState(id="x", progress={"step": 1}, stall={"idle_s": math.nan, "phase": "training"})
    assert isinstance(st.progress, ProgressRecord) and isinstance(st.stall, StallRecord)
    assert st.stall == {"idle_s": None, "phase": "training"}  # a non-finite number reads as absent
    assert st.to_json()["progress"] == {"step": 1} and type(st.to_json()["progress"]) is dict


def test_update_state_takes_records_and_plain_objects(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    write_state(run_dir, RunState(id="r"))
    update_state(run_dir, progress={"step": 2}, environment=EnvironmentRecord({"hash": "h", "attempt": 1}))
    st = read_state(run_dir)
    assert st.progress and st.progress.step == 2 and st.environment and st.environment.hash == "h"
    raw = json.loads((run_dir / "state.json").read_text())
    assert raw["progress"] == {"step": 2} and raw["environment"] == {"hash": "h", "attempt": 1}
