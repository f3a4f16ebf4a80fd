"""Hub end to end: `ftlaunch download` and `train --mirror URL` against the project's fake hub server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from ..conftest import tiny_config, venv_bin, write_yaml
from ..fakehub import FakeHub
from ..helpers import said

pytestmark = pytest.mark.e2e


def online_env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"):
        env.pop(key, None)
    env["HF_HOME"] = str(tmp_path / "hf")
    env.update(extra)
    return env


def ftl(*args, env, timeout=300):
    return subprocess.run(
        [str(venv_bin() / "ftlaunch"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def hub(tiny):
    files = {p.name: p.read_bytes() for p in (tiny / "model").iterdir() if p.is_file()}
    with FakeHub(repos={"org/tiny": files}) as h:
        yield h


def test_download_json(hub, tmp_path):
    r = ftl("download", "org/tiny", "--mirror", hub.url, "--json", env=online_env(tmp_path, HF_TOKEN="hf_secret_x"))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert Path(d["path"], "model.safetensors").exists() and d["endpoint"] == hub.url
    assert d["files"] >= 4 and d["bytes"] > 500_000 and d["retries"] == 0
    assert "hf_secret_x" not in r.stdout + r.stderr


def test_download_missing_repo_is_a_hub_error(hub, tmp_path):
    r = ftl("download", "org/missing", "--mirror", hub.url, env=online_env(tmp_path))
    assert r.returncode == 8 and said("log in", r.stderr.lower()) and "Traceback" not in r.stderr


def test_train_with_mirror_predownloads_then_trains_offline(hub, tiny, tmp_path, isolated_home):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, model_name_or_path="org/tiny", max_steps=4))
    r = ftl(
        "train",
        str(cfg),
        "--mirror",
        hub.url,
        "--foreground",
        "--json",
        env=online_env(tmp_path, HF_TOKEN="hf_secret_y"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    adapted = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert adapted["model_name_or_path"].startswith(str(tmp_path / "hf"))  # the local snapshot
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["env"]["HF_HUB_OFFLINE"] == "1" and plan["hub"]["endpoint"] == hub.url
    state = json.loads((run_dir / "state.json").read_text())
    assert state["status"] == "succeeded"
    # the token was used, never stored
    for name in ("plan.json", "state.json", "events.jsonl", "train.log", "config.yaml", "plan.txt"):
        assert "hf_secret_y" not in (run_dir / name).read_text(), name


def test_download_dataset_repo(tmp_path):
    with FakeHub(datasets={"org/ds": {"data/train.json": b'[{"instruction": "a", "output": "b"}]'}}) as h:
        r = ftl("download", "org/ds", "--repo-type", "dataset", "--mirror", h.url, "--json", env=online_env(tmp_path))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert Path(d["path"], "data", "train.json").exists() and "datasets--org--ds" in d["path"]
