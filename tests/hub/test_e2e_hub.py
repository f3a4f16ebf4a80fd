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


def test_estimate_with_mirror_fetches_the_tokenizer_not_the_weights(hub, tiny, tmp_path, isolated_home):
    """A hub model's tokens are counted from its tokenizer files alone: the weights stay on the hub."""
    out = tmp_path / "out"
    local = write_yaml(tmp_path / "local.yaml", tiny_config(tiny, out))
    remote = write_yaml(tmp_path / "hub.yaml", tiny_config(tiny, out, model_name_or_path="org/tiny"))
    env = online_env(tmp_path, HF_TOKEN="hf_secret_z")
    r = ftl("estimate", str(remote), "--mirror", hub.url, "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    fetched = json.loads(r.stdout)
    served = {key.split("/", 2)[2] for key, n in hub.bytes_served.items() if n}
    assert "tokenizer.json" in served or "tokenizer_config.json" in served, served
    assert not any(name.endswith(".safetensors") for name in served), served
    assert not list((tmp_path / "hf").rglob("*.safetensors"))
    here = json.loads(ftl("estimate", str(local), "--json", env=env).stdout)
    assert fetched["total_tokens"] == here["total_tokens"] > 0
    assert fetched["label_tokens"] == here["label_tokens"]
    assert "hf_secret_z" not in r.stdout + r.stderr


def test_estimate_of_a_model_path_missing_here_says_what_to_do(tiny, tmp_path, isolated_home):
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, tmp_path / "out", model_name_or_path="/nowhere/model"))
    r = ftl("estimate", str(cfg), "--gpu", "A100-80GB", "--params", "7B", env=online_env(tmp_path))
    assert r.returncode == 3, r.stdout + r.stderr
    assert said("/nowhere/model does not exist", r.stderr) and said("--mirror auto", r.stderr)
