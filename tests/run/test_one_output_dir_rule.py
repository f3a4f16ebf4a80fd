"""One rule for "a trainer lives in this output_dir" (issue 31, case 6): `schedule run` started a trainer
beside a live orphan of a plain `train` of the same config, because it looked at its own schedule's runs
only and the output_dir lock is per version folder. A schedule's run now refuses (exit 7) beside any
live trainer of the same base output_dir, and `train` and `resume` beside a schedule's.

Real processes, as tests/run/test_orphans.py: detached supervisors, the trainer is tests/fake_trainer.py
kept alive with {"sleep": N}, kill -9 of a supervisor or of `schedule run` leaves it an orphan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ftlaunch.run.orphans import runs_of_output_dir
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import write_state

from ..fake_trainer import install, write_config
from .test_orphans import ftl, gone, leave_nothing_running, refused, trainers  # noqa: F401 (autouse fixture)
from .test_races import state, stop, wait_for


def setup(tmp_path: Path, script: list[dict]) -> tuple[Path, dict]:
    """The fake trainer, and a config `train` plans (a dataset and a model named, nothing downloaded)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}}))
    (data / "d.json").write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}]))
    cfg = write_config(tmp_path, model_name_or_path="Qwen/Qwen2.5-0.5B", dataset="d", dataset_dir=str(data))
    env = {
        **os.environ,
        "FTLAUNCH_HOME": str(tmp_path / "home"),
        "FTLAUNCH_LLAMAFACTORY_CLI": str(install(tmp_path)),
        "FAKE_TRAINER_SCRIPT": json.dumps(script),
        "FAKE_TRAINER_COUNTER": str(tmp_path / "counter"),
        "HF_HUB_OFFLINE": "1",
    }
    return cfg, env


def runs(tmp_path: Path) -> list[Path]:
    root = tmp_path / "home" / "runs"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def detached_train(tmp_path: Path, cfg: Path, env: dict) -> tuple[Path, int]:
    """A detached `train` whose trainer is up (and has printed, so a dead supervisor's pipe is safe)."""
    r = ftl(env, "train", str(cfg), "--gpu", "A10G", "--json")
    assert r.returncode == 0, r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    trainer = wait_for(lambda: state(run_dir).get("trainer_pid"))
    wait_for(lambda: "fake trainer attempt" in (run_dir / "train.log").read_text())
    return run_dir, trainer


def scheduled(tmp_path: Path, env: dict) -> tuple[subprocess.Popen, Path, int]:
    """`schedule run nightly` in the foreground (it is its run's supervisor), its trainer up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftlaunch", "schedule", "run", "nightly"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    before = set(runs(tmp_path))
    run_dir = wait_for(lambda: next((p for p in runs(tmp_path) if p not in before), None))
    trainer = wait_for(lambda: (run_dir / "state.json").exists() and state(run_dir).get("trainer_pid"))
    wait_for(lambda: "fake trainer attempt" in (run_dir / "train.log").read_text())
    return proc, run_dir, trainer


def add_schedule(cfg: Path, env: dict) -> None:
    r = ftl(env, "schedule", "add", "nightly", str(cfg), "--cron", "0 2 * * *", "--gpu", "A10G", "--print")
    assert r.returncode == 0, r.stderr


def skipped_overlap(tmp_path: Path) -> bool:
    history = json.loads((tmp_path / "home" / "schedules" / "nightly.json").read_text())["history"]
    return history[-1]["status"] == "skipped" and history[-1]["reason"] == "overlap"


def said(r: subprocess.CompletedProcess) -> str:
    return " ".join(r.stderr.split())


# ---------------------------------------------------------------- the rule, on recorded states


def test_the_runs_of_an_output_dir_are_those_into_it_and_those_of_its_base(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("FTLAUNCH_HOME", str(home))
    base, other = tmp_path / "saves", tmp_path / "elsewhere"

    def run(run_id: str, out: Path, schedule: str | None = None) -> None:
        d = home / "runs" / run_id
        d.mkdir(parents=True)
        write_state(d, RunState(id=run_id, status=RunStatus.RUNNING, output_dir=str(out), schedule=schedule))

    run("a-plain", base)
    run("b-nightly", base / "nightly-20261201T020000Z", "nightly")
    run("c-weekly", base / "weekly-20261129T020000Z", "weekly")
    run("d-nested-plain", base / "my-own-dir")  # a plain run into a folder under the base is its own place
    run("e-elsewhere", other)
    env = dict(os.environ)

    def ids(path: Path, **kw) -> list[str]:
        return sorted(d.name for d, _ in runs_of_output_dir(env, str(path), **kw))

    assert ids(base) == ["a-plain", "b-nightly", "c-weekly"]  # `train` into the base sees the schedules' runs
    every = ["a-plain", "b-nightly", "c-weekly"]
    assert ids(base / "nightly-20261202T020000Z", scheduled=True) == every  # a new version dir, before its run
    assert ids(base / "nightly-20261201T020000Z") == every  # `resume` of a scheduled run: known by its state
    assert ids(base / "my-own-dir") == ["d-nested-plain"] and ids(other) == ["e-elsewhere"]
    assert ids(tmp_path / "saves" / ".." / "saves") == ids(base)  # compared as absolute paths


# ---------------------------------------------------------------- real processes


def test_schedule_run_refuses_beside_the_orphan_of_a_plain_train_of_its_config(tmp_path):
    """Issue 31 case 6 as reported: a plain `train` whose supervisor was killed -9, then `schedule run`."""
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    add_schedule(cfg, env)
    run_dir, orphan = detached_train(tmp_path, cfg, env)
    supervisor = state(run_dir)["pid"]
    os.kill(supervisor, 9)
    wait_for(lambda: gone(supervisor))
    for _ in range(2):
        r = ftl(env, "schedule", "run", "nightly")
        refused(r, run_dir, orphan)
        assert "and its supervisor is gone" in said(r)
        assert trainers(tmp_path) == [orphan] and runs(tmp_path) == [run_dir] and skipped_overlap(tmp_path)
    assert stop(run_dir, env).returncode == 0 and trainers(tmp_path) == []


def test_train_and_resume_refuse_beside_a_schedules_orphan(tmp_path):
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    add_schedule(cfg, env)
    # an earlier plain run of the config, ended: `resume` of it must not start beside the orphan either
    first, _ = detached_train(tmp_path, cfg, env)
    assert stop(first, env).returncode == 0
    proc, run_dir, orphan = scheduled(tmp_path, env)
    proc.kill()  # kill -9 of `schedule run`, its trainer training on in <output_dir>/nightly-<time>
    proc.wait()
    r = ftl(env, "train", str(cfg), "--gpu", "A10G")
    refused(r, run_dir, orphan)
    r = ftl(env, "resume", first.name, "--no-follow")
    refused(r, run_dir, orphan)
    assert trainers(tmp_path) == [orphan] and len(runs(tmp_path)) == 2
    assert stop(run_dir, env).returncode == 0 and trainers(tmp_path) == []


def test_a_live_schedule_run_and_a_live_train_of_one_config_never_run_together(tmp_path):
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    add_schedule(cfg, env)
    proc, run_dir, trainer = scheduled(tmp_path, env)
    try:
        r = ftl(env, "train", str(cfg), "--gpu", "A10G")  # the schedule holds its base output_dir
        assert r.returncode == 7 and "is in use by schedule nightly's run" in said(r), said(r)
        assert trainers(tmp_path) == [trainer]
    finally:
        proc.kill()
        proc.wait()
    assert stop(run_dir, env).returncode == 0 and trainers(tmp_path) == []
    plain, trainer = detached_train(tmp_path, cfg, env)  # now a supervised plain run: the schedule waits
    r = ftl(env, "schedule", "run", "nightly")
    assert r.returncode == 7 and f"is in use by run {plain.name}" in said(r), said(r)
    assert trainers(tmp_path) == [trainer] and skipped_overlap(tmp_path)
    assert stop(plain, env).returncode == 0 and trainers(tmp_path) == []


def test_a_supervised_trainer_of_the_same_base_is_named_as_training_not_as_an_orphan(tmp_path):
    """A `resume` of a scheduled run takes its version dir's lock only: a live, supervised trainer found
    there by the rule is said to be training, with `stop` as the way out, never as an orphan."""
    cfg, env = setup(tmp_path, [{"sleep": 60}])
    add_schedule(cfg, env)
    proc, run_dir, trainer = scheduled(tmp_path, env)
    proc.kill()
    proc.wait()
    r = ftl(env, "resume", run_dir.name, "--no-follow")  # ends its own orphan, restarts it supervised
    assert r.returncode == 0, r.stderr
    new = wait_for(lambda: [p for p in trainers(tmp_path) if p != trainer])
    r = ftl(env, "train", str(cfg), "--gpu", "A10G")
    assert r.returncode == 7 and f"run {run_dir.name} is training there" in said(r), said(r)
    assert f"ftlaunch stop {run_dir.name}" in said(r) and "supervisor is gone" not in said(r)
    assert trainers(tmp_path) == new
    assert stop(run_dir, env).returncode == 0 and trainers(tmp_path) == []
