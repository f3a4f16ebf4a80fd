"""One owner of the run folder's files (issue 26 item 4) and the typed joints of the launch use case
(item 3): names, formats and modes unchanged, every other module goes through run/store.py."""

from __future__ import annotations

import ast
import json
import stat
from pathlib import Path

import pytest

from ftlaunch.plan.config import dump_yaml, read_header
from ftlaunch.run.health import OnDiverge
from ftlaunch.run.options import RunOptions, SupervisorSettings
from ftlaunch.run.outdir import DirUse, Existing, output_dir_verdict
from ftlaunch.run.policy import RecoveryPolicy, Retries
from ftlaunch.run.state import RunState, RunStatus, StartFacts
from ftlaunch.run.store import (
    RunFolder,
    drop_trainer_config,
    read_config,
    read_plan,
    read_secrets,
    set_aside_state,
    write_config,
    write_secrets,
    write_trainer_config,
)

ROOT = Path(__file__).resolve().parents[2] / "ftlaunch"
# What runs made by earlier versions hold: a rename here would orphan every existing run.
LAYOUT = {
    "source": "source.yaml",
    "config": "config.yaml",
    "trainer_config": ".trainer-config.yaml",
    "secrets": "secrets.json",
    "plan_text": "plan.txt",
    "plan": "plan.json",
    "hardware": "hardware.json",
    "train_log": "train.log",
    "supervisor_log": "supervisor.log",
    "state": "state.json",
    "state_lock": ".state.lock",
    "events": "events.jsonl",
    "records": "trainer_records.jsonl",
    "environment": "environment",
    "stacks": "stacks",
    "job_script": "job.sbatch",
    "srun_trainer": "srun-trainer.sh",
    "progress_png": "progress.png",
}


def test_the_folder_names_every_file_as_before(tmp_path):
    f = RunFolder(tmp_path)
    assert {k: getattr(f, k).relative_to(tmp_path).as_posix() for k in LAYOUT} == LAYOUT
    assert f.environment_of(3).relative_to(tmp_path).as_posix() == "environment/attempt-3.json"
    assert f.stacks_of(2, "20260101T000000").name == "attempt-2-20260101T000000.txt"


def test_no_module_but_the_store_spells_a_run_folder_file():
    """Each name is written once, in run/store.py: a string literal naming one elsewhere is a second owner."""
    names = set(LAYOUT.values()) - {"environment", "stacks"}  # also event and field names: not checked
    found = []
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "run" / "store.py":
            continue
        docstrings = _docstrings(ast.parse(path.read_text()))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                if (node.lineno, node.col_offset) not in docstrings:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert found == [
        "run/state.py:" + str(_line_of(ROOT / "run" / "state.py", 'where: str = "state.json"')) + " state.json"
    ]  # only the default label of a state read outside any folder (RunState.from_json)


def _docstrings(tree: ast.AST) -> set[tuple[int, int]]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add((first.value.lineno, first.value.col_offset))
    return out


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_config_round_trip_keeps_values_header_and_format(tmp_path):
    header = {"ftlaunch": 1, "changes": 2}
    values = {"output_dir": "/tmp/o", "per_device_train_batch_size": 4, "template": "qwen"}
    write_config(tmp_path, values, header)
    text = RunFolder(tmp_path).config.read_text()
    assert text == dump_yaml(values, header)  # the format config.yaml always had
    assert read_config(tmp_path) == (values, header) and read_header(text) == header
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no temp file left behind


def test_secrets_are_0600_and_plain_json_and_the_trainer_copy_too(tmp_path):
    write_secrets(tmp_path, {"hub_token": "hf_x"})
    path = RunFolder(tmp_path).secrets
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == '{"hub_token": "hf_x"}' and read_secrets(tmp_path) == {"hub_token": "hf_x"}
    write_secrets(tmp_path, {})  # nothing secret: nothing written, the old file stays
    assert read_secrets(tmp_path) == {"hub_token": "hf_x"}
    copy = write_trainer_config(tmp_path, {"ms_hub_token": "m"}, None)
    assert copy == RunFolder(tmp_path).trainer_config and stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert copy.read_text() == dump_yaml({"ms_hub_token": "m"})
    drop_trainer_config(RunFolder(tmp_path).config)  # config.yaml is never dropped
    write_config(tmp_path, {"a": 1}, None)
    drop_trainer_config(RunFolder(tmp_path).config)
    drop_trainer_config(copy)
    assert not copy.exists() and RunFolder(tmp_path).config.exists()


def test_unreadable_plan_is_empty_and_a_corrupt_state_is_set_aside(tmp_path):
    assert read_plan(tmp_path) == {}
    RunFolder(tmp_path).plan.write_text("[1]")
    assert read_plan(tmp_path) == {}
    RunFolder(tmp_path).plan.write_text('{"micro_batch": 2}')
    assert read_plan(tmp_path) == {"micro_batch": 2}
    RunFolder(tmp_path).state.write_text("{torn")
    set_aside_state(tmp_path, t=1700000000)
    assert not RunFolder(tmp_path).state.exists()
    assert (tmp_path / "state.json.corrupt-1700000000").read_text() == "{torn"


def test_supervisor_settings_are_one_value_with_the_enum():
    policy = RecoveryPolicy(Retries(oom=1), recover=False, on_diverge=OnDiverge.STOP, stall_timeout=60.0)
    opts = RunOptions(run_name="n", policy=policy)
    assert opts.supervisor_settings() == SupervisorSettings(name="n", policy=policy)
    stored = json.loads(json.dumps(opts.to_dict()))  # a schedule record holds the word
    assert stored["on_diverge"] == "stop"
    assert RunOptions.from_dict(stored).policy.on_diverge is OnDiverge.STOP
    with pytest.raises(ValueError):
        RunOptions.from_dict({"on_diverge": "explode"})


def test_start_facts_join_and_name_state_fields():
    found = StartFacts(adopted_checkpoint="checkpoint-4", adopted_because="continuing")
    facts = StartFacts(schedule="nightly", warnings=("fills the disk",)).joined(found)
    assert facts.known() == {
        "adopted_checkpoint": "checkpoint-4",
        "adopted_because": "continuing",
        "warnings": ("fills the disk",),
        "schedule": "nightly",
    }
    state = RunState(id="r", **facts.known())  # every fact is a state field
    assert state.to_json()["schedule"] == "nightly" and state.to_json()["warnings"] == ["fills the disk"]


def test_output_dir_verdict_is_an_enum():
    done = RunState(id="old", status=RunStatus.FAILED, memory_key="k")
    assert output_dir_verdict("/o", [], [], "k", Existing.REFUSE).use is DirUse.USE
    assert output_dir_verdict("/o", ["checkpoint-2"], [], "k", Existing.FRESH).use is DirUse.FRESH
    assert output_dir_verdict("/o", ["checkpoint-2"], [], "k", Existing.RESUME).use is DirUse.ADOPT
    v = output_dir_verdict("/o", ["checkpoint-2"], [done], "k", Existing.REFUSE)
    assert v.use is DirUse.CONTINUE and v.why == "continuing run old of this config from checkpoint-2"
