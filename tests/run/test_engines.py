"""The engine seam (ftlaunch.run.engines): the registry, the protocol, and `start_run` as the one launch
path whatever the engine (LLaMA-Factory's preflight, the disk forecast and the simulation of a tight
plan run before any engine launches), with a stand-in engine, the Slurm engine over a stand-in sbatch,
and the state of a Slurm run written by main before engines were recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main as cli
from ftlaunch.errors import ConfigError
from ftlaunch.run import engines
from ftlaunch.run.engines import Created, Engine, EngineStatus, Started
from ftlaunch.run.engines.local import Local
from ftlaunch.run.engines.slurm import Slurm
from ftlaunch.run.options import RunOptions, SupervisorSettings
from ftlaunch.run.preflight import Verdict
from ftlaunch.run.slurm.sbatch import SlurmRequest
from ftlaunch.run.state import RunState, RunStatus, StartFacts
from ftlaunch.run.store import read_events, read_state

from ..conftest import ROOT, write_yaml
from ..helpers import said

OLD_SLURM_STATE = ROOT / "tests" / "data" / "state-main-f945884" / "slurm-queued.state.json"


# ---------------------------------------------------------------- the registry


def test_the_registry_names_local_then_slurm_and_refuses_an_unknown_engine():
    assert engines.names()[:2] == ("local", "slurm")
    assert engines.get("local") is Local and engines.get("slurm") is Slurm
    with pytest.raises(ConfigError) as e:
        engines.get("nope")
    assert "no engine 'nope'" in e.value.message and "local, slurm" in (e.value.hint or "")


def test_every_engine_implements_the_protocol():
    for name in engines.names():
        assert isinstance(engines.get(name)(), Engine), name


def test_importing_the_registry_loads_no_engine_and_no_heavy_package():
    code = (
        "import sys, ftlaunch, ftlaunch.run.engines as e; "
        "bad = [m for m in sys.modules if m.startswith(('ftlaunch.run.engines.local', 'ftlaunch.run.engines.slurm', "
        "'ftlaunch.run.supervisor', 'torch', 'ray'))]; print(bad)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_an_engine_module_is_imported_only_when_named(monkeypatch):
    loaded = []

    def _fake():
        loaded.append("fake")
        return Recorder

    monkeypatch.setitem(engines.ENGINES, "fake", _fake)  # what adding an engine is: one loader, one row
    assert "fake" in engines.names() and loaded == []
    assert engines.get("fake") is Recorder and loaded == ["fake"]
    assert isinstance(engines.of_state(RunState(id="x", engine="fake")), Recorder)


def test_the_engine_of_a_state_reads_old_runs_by_their_slurm_keys():
    assert RunState(id="a").engine_name() == "local"
    assert RunState(id="b", slurm_job_id="12").engine_name() == "slurm"
    assert RunState(id="c", slurm={"nodes": 2}).engine_name() == "slurm"  # submitted, no job id yet
    assert RunState(id="d", engine="slurm").engine_name() == "slurm"
    assert isinstance(engines.of_state(RunState(id="e")), Local)


def test_a_run_of_an_engine_this_ftlaunch_does_not_know_is_unreadable_never_acted_on(tmp_path):
    from ftlaunch.errors import StateError
    from ftlaunch.run.store import write_state
    from ftlaunch.run.view import all_runs

    state = RunState(id="20990101-000000-abcd", engine="k8s", status=RunStatus.RUNNING)
    with pytest.raises(StateError) as e:
        engines.of_state(state)
    assert "engine 'k8s'" in e.value.message and "not touching it" in e.value.message
    run_dir = tmp_path / "home" / "runs" / state.id
    run_dir.mkdir(parents=True)
    write_state(run_dir, state)
    views = all_runs({"FTLAUNCH_HOME": str(tmp_path / "home")})
    assert [v.status.value for v in views] == ["unreadable"]


def test_a_slurm_state_written_by_main_before_engines_still_reads(tmp_path):
    data = json.loads(OLD_SLURM_STATE.read_text())
    assert "engine" not in data and data["slurm_job_id"] == "4242"  # as f945884 wrote it
    state = RunState.from_json(data)
    assert state.engine is None and state.engine_name() == "slurm" and state.status is RunStatus.QUEUED
    assert state.to_json() == {k: v for k, v in data.items() if v is not None}  # nothing added on a rewrite
    engine = engines.of_state(state)
    assert isinstance(engine, Slurm)
    # Slurm does not answer here (no squeue on PATH): the recorded status stands (fail closed)
    seen = engine.status(state, {"PATH": str(tmp_path)})
    assert seen == EngineStatus(RunStatus.QUEUED)


# ---------------------------------------------------------------- start_run with any engine


@dataclass(frozen=True)
class Recorder:
    """A stand-in engine: records what it was handed."""

    launched: list = field(default_factory=list)
    name: ClassVar[str] = "fake"

    def request(self, req):
        return req

    def adapt(self, p):
        return p

    def launch(self, created: Created, env):
        if created.lock is not None:
            created.lock.close()
        self.launched.append(created)
        return Started(created.run_dir, job="fake-1")

    def status(self, state, env):
        return EngineStatus(state.status)

    def stop(self, run_dir, state, env, grace):
        return None

    def resume(self, run_dir, state, env, **kw):
        return None


@pytest.fixture
def run_env(tmp_path, isolated_home, monkeypatch):
    trainer = tmp_path / "llamafactory-cli"
    trainer.write_text("#!/bin/sh\nexit 0\n")
    trainer.chmod(0o755)
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(trainer))
    cfg = {
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 10,
    }
    env = {"FTLAUNCH_HOME": str(isolated_home), "PATH": "/usr/bin:/bin", "FTLAUNCH_LLAMAFACTORY_CLI": str(trainer)}
    return {"config": write_yaml(tmp_path / "c.yaml", cfg), "env": env, "home": isolated_home, "tmp": tmp_path}


@pytest.fixture
def checks(monkeypatch):
    """What start_run checks, stood in: the parser's verdict (ok unless told), the disk forecast, and
    the simulation, each recorded."""
    seen: dict = {"preflight": [], "disk": [], "simulate": [], "verdict": Verdict("ok")}

    def preflight(p, env, **kw):
        seen["preflight"].append(p)
        return seen["verdict"]

    def disk_check(p, params, model_config, say):
        seen["disk"].append(p)
        return StartFacts(disk={"checkpoint_bytes": 1234, "verdict": {"kind": "ok"}})

    def simulate(p, simulate, model_config, say):
        seen["simulate"].append((p, simulate))
        return p

    monkeypatch.setattr("ftlaunch.run.preflight.preflight", preflight)
    monkeypatch.setattr("ftlaunch.run.disk.disk_check", disk_check)
    monkeypatch.setattr("ftlaunch.run.launch.simulate_if_tight", simulate)
    return seen


def _start(run_env, engine, **kw):
    from ftlaunch.run.launch import start_run

    opts = RunOptions(gpu="none")
    req = opts.plan_request(str(run_env["config"]), (), strict=True)
    return start_run(req, run_env["env"], SupervisorSettings(), engine=engine, **kw)


def test_start_run_checks_forecasts_and_simulates_before_any_engine_launches(run_env, checks):
    engine = Recorder()
    started = _start(run_env, engine, simulate=True)
    assert started.job == "fake-1" and len(engine.launched) == 1
    assert len(checks["preflight"]) == len(checks["disk"]) == len(checks["simulate"]) == 1
    assert checks["simulate"][0][1] is True
    state = read_state(started.run_dir)
    assert state.engine == "fake" and state.disk == {"checkpoint_bytes": 1234, "verdict": {"kind": "ok"}}


def test_a_config_the_parser_refuses_never_reaches_the_engine(run_env, checks):
    checks["verdict"] = Verdict("refused", "Please specify `dataset`.")
    engine = Recorder()
    with pytest.raises(ConfigError) as e:
        _start(run_env, engine)
    assert e.value.exit_code == 3 and engine.launched == []
    assert not list((run_env["home"] / "runs").glob("*"))  # nothing created


@pytest.fixture
def sbatch(run_env):
    """A stand-in sbatch on PATH: it notes each submission and prints a job id."""
    bindir = run_env["tmp"] / "bin"
    bindir.mkdir()
    marker = run_env["tmp"] / "submitted"
    (bindir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {marker}\necho 777\n')
    (bindir / "sbatch").chmod(0o755)
    run_env["env"]["PATH"] = f"{bindir}:/usr/bin:/bin"
    return marker


def test_the_slurm_engine_plans_all_nodes_and_spreads_a_cpu_plan(run_env, checks, sbatch):
    engine = Slurm(job=SlurmRequest(2, 0), cwd=run_env["tmp"])
    started = _start(run_env, engine, simulate=True)
    assert started.job == "777" and sbatch.read_text().count("job.sbatch") == 1
    checked = checks["preflight"][0]
    assert checked.world_size == 2 and checked.config["ddp_backend"] == "gloo"  # the adapted plan is checked
    assert len(checks["simulate"]) == 1
    state = read_state(started.run_dir)
    assert state.engine == "slurm" and state.slurm_job_id == "777" and state.status is RunStatus.QUEUED
    assert state.disk and state.disk["checkpoint_bytes"] == 1234  # the node's supervisor guards saves with it
    assert "submitted" in [e["event"] for e in read_events(started.run_dir)]


def test_a_slurm_config_the_parser_refuses_is_never_submitted(run_env, checks, sbatch):
    checks["verdict"] = Verdict("refused", "Please specify `dataset`.")
    with pytest.raises(ConfigError) as e:
        _start(run_env, Slurm(job=SlurmRequest(2, 0), cwd=run_env["tmp"]))
    assert e.value.exit_code == 3 and not sbatch.exists()
    assert not list((run_env["home"] / "runs").glob("*"))


def test_a_submission_sbatch_refuses_removes_the_run(run_env, checks, sbatch):
    (Path(run_env["env"]["PATH"].split(":")[0]) / "sbatch").write_text(
        "#!/bin/sh\necho 'invalid partition' >&2\nexit 1\n"
    )
    with pytest.raises(Exception) as e:
        _start(run_env, Slurm(job=SlurmRequest(1, 0), cwd=run_env["tmp"]))
    assert getattr(e.value, "exit_code", None) == 13
    assert not list((run_env["home"] / "runs").glob("*"))


# ---------------------------------------------------------------- the CLI


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--slurm", "--engine", "local"], "--slurm is --engine slurm"),
        (["--engine", "slurm", "--foreground"], "runs as a batch job"),
        (["--engine", "local", "--nodes", "2"], "go with --slurm"),
        (["--engine", "nope"], "'nope' is not one of"),
    ],
)
def test_train_refuses_engine_options_that_do_not_go_together(run_env, args, words):
    r = CliRunner().invoke(cli, ["train", str(run_env["config"]), "--gpu", "none", *args])
    assert r.exit_code == 2 and said(words, r.output), r.output


def test_engine_slurm_and_its_alias_submit_the_same_way(run_env, checks, sbatch, monkeypatch):
    monkeypatch.setenv("PATH", run_env["env"]["PATH"])
    monkeypatch.chdir(run_env["tmp"])
    ids = []
    for flag in (["--engine", "slurm"], ["--slurm"]):
        r = CliRunner().invoke(
            cli, ["train", str(run_env["config"]), *flag, "--gpu", "none", "--nodes", "2", "--json", "--fresh"]
        )
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["slurm_job_id"] == "777"
        ids.append(out["id"])
        assert read_state(Path(out["run_dir"])).engine == "slurm"
    assert ids[0] != ids[1]
