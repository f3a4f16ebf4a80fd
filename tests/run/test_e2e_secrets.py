"""Secrets that stay secret (issue 24): a secret config key never reaches a file but secrets.json.

transformers pickles TrainingArguments (hub_token among them) into training_args.bin in the
output_dir and every checkpoint-N, so the trainer gets hub_token, hf_hub_token and swanlab_api_key
through its environment (HF_TOKEN, SWANLAB_API_KEY) instead of its config.

Fast lane: the hand-off per key (pure), the supervisor with the scripted trainer (tests/fake_trainer.py)
and the sbatch script rendered with a stand-in `sbatch` that only answers a job id. Marked e2e: the
real llamafactory-cli trains the tiny model and every file of the run is grepped, bytes included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.plan.config import is_secret_key
from ftlaunch.run.trainer import SECRET_ENV, SECRET_KEY_ENV, public_env, secret_handoff

from ..conftest import child_env, tiny_config, venv_bin, write_yaml
from ..fake_trainer import configs_seen, install, write_config
from .test_reliability import fake  # noqa: F401  (the scripted trainer, in-process)


def token(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def holders(values: list[str], *roots: Path) -> list[Path]:
    """Every file under ``roots`` whose bytes hold one of ``values`` (binary files too: pickles)."""
    found = []
    for root in roots:
        for p in sorted(root.rglob("*")) if root.exists() else []:
            if p.is_file() and not p.is_symlink():
                data = p.read_bytes()
                if any(v.encode() in data for v in values):
                    found.append(p)
    return found


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# ---------------------------------------------------------------- the hand-off (pure)


def test_each_secret_key_goes_to_the_variable_its_library_reads():
    hub, key, ms = token("hf_"), token("sw_"), token("ms_")
    env, kept = secret_handoff({"hub_token": hub, "hf_hub_token": hub, "swanlab_api_key": key, "ms_hub_token": ms})
    assert env == {"HF_TOKEN": hub, "SWANLAB_API_KEY": key}
    assert kept == {"ms_hub_token": ms}  # ModelScope's downloads read no variable: LF logs in with the key
    # Two different Hugging Face tokens: the pickled one (hub_token) has HF_TOKEN, the other stays a key.
    other = token("hf_")
    env, kept = secret_handoff({"hf_hub_token": other, "hub_token": hub})
    assert env == {"HF_TOKEN": hub} and kept == {"hf_hub_token": other}
    assert secret_handoff({}) == ({}, {})
    assert all(var in SECRET_ENV for _, var in SECRET_KEY_ENV)  # so public_env and redact mask them
    assert public_env({"SWANLAB_API_KEY": key, "PATH": "/bin"}) == {"SWANLAB_API_KEY": "***", "PATH": "/bin"}
    assert is_secret_key("swanlab_lark_secret") and is_secret_key("swanlab_lark_webhook_url")


# ---------------------------------------------------------------- the supervisor, scripted trainer


def test_the_trainer_gets_secrets_in_its_environment_and_no_command_prints_them(tmp_path, fake, isolated_home):  # noqa: F811
    hub, key, ms = token("hf_"), token("sw_"), token("ms_")
    fake({"print_env": "SWANLAB_API_KEY", "print_key": "ms_hub_token", "ok": True})
    cfg = write_config(tmp_path, hub_token=hub, ms_hub_token=ms)
    r = cli("train", str(cfg), f"swanlab_api_key={key}", "--gpu", "A10G", "--foreground")
    assert r.exit_code == 0, r.output
    seen = configs_seen(tmp_path)[0]
    assert "hub_token" not in seen and "swanlab_api_key" not in seen  # not in what the trainer parses
    assert seen["ms_hub_token"] == ms  # no variable for it: the 0600 per-attempt copy, never pickled
    run_dir = next(p for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    log = (run_dir / "train.log").read_text()
    assert log.count("printed ***") == 2  # SWANLAB_API_KEY was the key, ms_hub_token the token: redacted
    assert not (run_dir / ".trainer-config.yaml").exists()
    shown = "".join(
        cli(*args).output
        for args in (
            ("status", run_dir.name, "--json"),
            ("status", run_dir.name),
            ("runs", "--json"),
            ("logs", run_dir.name),
        )
    )
    for more in ((), ("--json",)):
        shown += cli("plan", str(cfg), f"swanlab_api_key={key}", "--gpu", "A10G", *more).output
    assert not any(v in shown + r.output for v in (hub, key, ms))
    found = holders([hub, key, ms], isolated_home, tmp_path / "out")
    assert [p.name for p in found] == ["secrets.json"]
    assert stat.S_IMODE(found[0].stat().st_mode) == 0o600
    assert json.loads(found[0].read_text()) == {"hub_token": hub, "ms_hub_token": ms, "swanlab_api_key": key}


def test_the_sbatch_script_and_its_wrapper_hold_no_secret(tmp_path, isolated_home, monkeypatch):
    """Rendered for real by `train --slurm`; the stand-in sbatch only answers a job id (no cluster)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/sbatch.args"\necho 4242\n')
    (bindir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(install(tmp_path)))
    hub, env_token = token("hf_"), token("hf_")
    monkeypatch.setenv("HF_TOKEN", env_token)
    cfg = write_config(tmp_path, hub_token=hub)
    r = cli("train", str(cfg), "--slurm", "--nodes", "2", "--gpu", "none", "--json")
    assert r.exit_code == 0, r.output
    run_dir = Path(json.loads(r.stdout)["run_dir"])  # --json's one document on stdout; what train says, on stderr
    script = (run_dir / "job.sbatch").read_text()
    assert "exec " in script and (run_dir / "srun-trainer.sh").exists()
    found = holders([hub, env_token], isolated_home, tmp_path / "out", bindir)
    assert [p.name for p in found] == ["secrets.json"]  # the job's supervisor reads it on the batch host
    assert stat.S_IMODE(found[0].stat().st_mode) == 0o600


# ---------------------------------------------------------------- the real trainer


@pytest.mark.e2e
def test_every_pickled_secret_field_of_the_trainer_goes_through_the_environment():
    """TrainingArguments is what transformers pickles (training_args.bin): each of its secret-looking
    fields in this llamafactory must have a variable (imports llamafactory: ~7 s, hence e2e)."""
    from llamafactory.hparams.training_args import TrainingArguments

    pickled = {f.name for f in dataclasses.fields(TrainingArguments) if is_secret_key(f.name)}
    assert pickled == {"hub_token"}
    assert pickled <= {key for key, _ in SECRET_KEY_ENV}


@pytest.mark.e2e
def test_e2e_a_real_run_writes_its_secrets_only_to_secrets_json(tiny, tmp_path, isolated_home):
    hub, key, ms = token("hf_"), token("sw_"), token("ms_")
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "tiny.yaml", tiny_config(tiny, out, hub_token=hub, ms_hub_token=ms))
    r = subprocess.run(
        [str(venv_bin() / "ftlaunch"), "train", str(cfg), f"swanlab_api_key={key}", "--foreground"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = next(p for p in (isolated_home / "runs").iterdir() if not p.name.startswith("."))
    pickles = sorted(out.rglob("training_args.bin"))
    assert len(pickles) >= 2 and any(p.parent.name.startswith("checkpoint-") for p in pickles)
    import torch

    assert torch.load(pickles[0], weights_only=False).hub_token is None  # the field is there, empty
    shown = subprocess.run(
        [str(venv_bin() / "ftlaunch"), "status", run_dir.name, "--json"],
        env=child_env(),
        capture_output=True,
        text=True,
    ).stdout
    assert json.loads(shown)["status"] == "succeeded"
    assert not any(v in shown + r.stdout + r.stderr for v in (hub, key, ms))
    # Everything under tmp_path: the output_dir with its checkpoints, FTLAUNCH_HOME, the HF caches.
    assert set(holders([hub, key, ms], tmp_path)) == {cfg, run_dir / "secrets.json"}  # cfg: the user's own YAML
    assert stat.S_IMODE((run_dir / "secrets.json").stat().st_mode) == 0o600
    assert yaml.safe_load((run_dir / "config.yaml").read_text()).get("hub_token") is None
