"""A schedule's secret overrides (issue 24): `schedule add NAME CFG swanlab_api_key=...` keeps the value
in a 0600 file of the schedule (schedules/secrets/NAME.json), the record and `schedule list` show
``key=***``, and each run gets the value back. The stand-in crontab and scripted trainer are those of
test_schedule.py; the e2e test trains the tiny model with the real llamafactory-cli and greps every
file it left (crontab, records, run dir, output_dir, checkpoints' training_args.bin).
"""

from __future__ import annotations

import json
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ftlaunch.errors import ConfigError
from ftlaunch.schedule.records import ScheduleRecord

from ..conftest import tiny_config, write_yaml

# scratch_crontab: autouse, a stand-in crontab(1) writing tmp_path/crontab.txt
from .test_schedule import ENTRY, add, cli, fake_trainer, project, record, scratch_crontab  # noqa: F401


def token(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def holders(values: list[str], root: Path) -> set[Path]:
    out = set()
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink() and any(v.encode() in p.read_bytes() for v in values):
            out.add(p)
    return out


def run_dirs(home: Path) -> list[Path]:
    return sorted(p for p in (home / "runs").iterdir() if not p.name.startswith("."))


def test_a_secret_override_is_kept_apart_masked_and_given_to_runs(project, fake_trainer, tmp_path, isolated_home):  # noqa: F811, E501
    key = token("sw_")
    fake_trainer({"print_env": "SWANLAB_API_KEY", "ok": True, "steps": 4})
    r = add("nightly", project, f"swanlab_api_key={key}", "learning_rate=2e-5")
    assert r.exit_code == 0, r.output
    rec = record(isolated_home, "nightly")
    assert rec["overrides"] == ["swanlab_api_key=***", "learning_rate=2e-5"]
    kept = isolated_home / "schedules" / "secrets" / "nightly.json"
    assert json.loads(kept.read_text()) == {"swanlab_api_key": key}
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    listed = cli("list", "--json").output
    assert json.loads(listed)[0]["overrides"] == ["swanlab_api_key=***", "learning_rate=2e-5"]
    assert cli("run", "nightly").exit_code == 0
    run_dir = run_dirs(isolated_home)[0]
    assert "printed ***" in (run_dir / "train.log").read_text()  # the trainer's SWANLAB_API_KEY was the key
    assert "printed None" not in (run_dir / "train.log").read_text()
    shown = listed + cli("list").output + cli("list", "--json").output
    assert key not in shown + (tmp_path / "crontab.txt").read_text()
    assert holders([key], tmp_path) == {kept, run_dir / "secrets.json"}
    assert cli("remove", "nightly").exit_code == 0
    assert not kept.exists()  # removed with the record


def test_a_lost_secrets_file_is_a_clear_error_not_a_run_with_three_stars(project):  # noqa: F811
    rec = ScheduleRecord(name="n", cron="@daily", config=str(project), overrides=("swanlab_api_key=***", "a=1"))
    assert rec.unmasked_overrides({"swanlab_api_key": "sw_x"}) == ("swanlab_api_key=sw_x", "a=1")
    with pytest.raises(ConfigError, match="swanlab_api_key"):
        rec.plan_request("/out/n-1", {})
    # A record written before secrets had a file keeps its value: it is used as it is (and masked in list).
    old = ScheduleRecord(name="n", cron="@daily", config=str(project), overrides=("swanlab_api_key=sw_old",))
    assert old.unmasked_overrides({}) == ("swanlab_api_key=sw_old",)


@pytest.mark.e2e
def test_e2e_a_scheduled_real_run_writes_its_secrets_only_to_secrets_files(tiny, tmp_path, isolated_home):
    hub, key = token("hf_"), token("sw_")
    out = tmp_path / "models"
    data = shutil.copytree(tiny / "data", tmp_path / "data")
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out, dataset_dir=str(data), hub_token=hub))
    r = cli("add", "tiny", str(cfg), "--cron", "@daily", f"swanlab_api_key={key}")
    assert r.exit_code == 0, r.output
    run = subprocess.run([sys.executable, "-c", ENTRY, "schedule", "run", "tiny"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert record(isolated_home, "tiny")["last"]["status"] == "succeeded"
    version = next(p for p in out.iterdir() if p.name.startswith("tiny-"))
    assert any(version.glob("checkpoint-*/training_args.bin")) and (version / "training_args.bin").exists()
    run_dir = run_dirs(isolated_home)[0]
    listed = cli("list", "--json").output
    assert key not in listed + run.stdout + run.stderr and hub not in listed + run.stdout + run.stderr
    # tmp_path holds the crontab file, FTLAUNCH_HOME (records, logs, runs) and the output_dir.
    assert holders([hub, key], tmp_path) == {
        cfg,  # the user's own YAML
        isolated_home / "schedules" / "secrets" / "tiny.json",
        run_dir / "secrets.json",
    }
    for p in (isolated_home / "schedules" / "secrets" / "tiny.json", run_dir / "secrets.json"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
