"""Hub datasets named in a config are pre-downloaded and the run gets its own dataset_info.json.

Pure parts are tested on plain dicts; the shell against the fake hub (tests/fakehub.py) with the real
huggingface_hub client; one end-to-end test runs the real llamafactory-cli offline on the tiny model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from ftlaunch.hub.datasets import (
    DatasetPrefetch,
    HubDataset,
    dataset_names,
    download_patterns,
    hub_datasets,
    prefetch_datasets,
)
from ftlaunch.hub.download import offline_env
from ftlaunch.hub.repo import HubSettings, is_repo_id
from ftlaunch.plan.change import Change
from ftlaunch.plan.datainfo import INFO_FILE
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import plan
from ftlaunch.plan.prepared import adapt_config, adapt_dataset_info, final_plan

from ..conftest import needs_train_stack, tiny_config, venv_bin, write_yaml
from ..fakehub import FakeHub

ROWS = [{"instruction": f"say {i}", "input": "", "output": f"number {i}"} for i in range(24)]
CARD = b"---\nlicense: mit\n---\n# alpaca tiny\n"
DATASET_FILES = {
    "README.md": CARD,
    ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n",
    "data/train.json": json.dumps(ROWS).encode(),
}

INFO = {
    "local_rel": {"file_name": "alpaca.json"},
    "local_abs": {"file_name": "/srv/data/abs.json", "formatting": "sharegpt"},
    "hub": {
        "hf_hub_url": "org/alpaca-tiny",
        "ms_hub_url": "ms/alpaca-tiny",
        "subset": "en",
        "folder": "data",
        "split": "train",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations"},
        "tags": {"role_tag": "from"},
        "num_samples": 10,
    },
    "hub_unused": {"hf_hub_url": "org/other"},
    "ms_only": {"ms_hub_url": "ms/only"},
    "script": {"script_url": "my_script"},
    "cloud": {"cloud_file_name": "s3://bucket/x.json"},
}


# ------------------------------------------------------------------------------------------------- pure
def test_dataset_names_merges_train_and_eval_without_repeats():
    assert dataset_names({"dataset": "a, b,a", "eval_dataset": "c,b"}) == ["a", "b", "c"]
    assert dataset_names({"dataset": ["x", "y"]}) == ["x", "y"]
    assert dataset_names({}) == []


def test_hub_datasets_finds_only_hf_hub_entries_that_are_named():
    names = ["hub", "local_rel", "ms_only", "missing", "script"]
    assert hub_datasets(INFO, names) == [HubDataset("hub", "org/alpaca-tiny", "data")]
    assert hub_datasets({"p": {"hf_hub_url": "/abs/local/dir"}}, ["p"]) == []
    assert hub_datasets(None, ["org/a", "./local"]) == [HubDataset("org/a", "org/a")]  # dataset_dir: ONLINE


def test_one_rule_names_a_hub_repo_for_models_and_datasets(tmp_path):
    assert is_repo_id("org/name") and is_repo_id("imdb")
    for not_a_repo in (None, "", "  ", "/abs/dir", "./rel", "../up", "~/home", ".hidden", "a/b/c", "C:\\models\\x"):
        assert not is_repo_id(not_a_repo), not_a_repo
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert is_repo_id("org/local") and not is_repo_id("org/local", cwd=tmp_path)  # a local folder wins
    assert hub_datasets(None, ["org/local", "org/a"], cwd=tmp_path) == [HubDataset("org/a", "org/a")]


def test_hub_settings_read_cache_and_token_from_the_environment():
    assert HubSettings.from_env({}) == HubSettings(None, None)
    assert HubSettings.from_env({"HF_HOME": "/h"}).cache_dir == str(Path("/h") / "hub")
    both = HubSettings.from_env({"HF_HOME": "/h", "HF_HUB_CACHE": "/c", "HUGGING_FACE_HUB_TOKEN": "hf_old"})
    assert both == HubSettings("/c", "hf_old") and "hf_old" not in repr(both)
    assert HubSettings.from_env({"HF_TOKEN": "hf_new", "HUGGING_FACE_HUB_TOKEN": "hf_old"}).token == "hf_new"


def test_download_patterns_restrict_to_folders_unless_a_whole_repo_is_used():
    refs = [HubDataset("a", "org/x", "data/en"), HubDataset("b", "org/x", "data/de"), HubDataset("c", "org/y")]
    assert download_patterns(refs) == {"org/x": ["README.md", "data/en/*", "data/de/*"], "org/y": None}
    assert download_patterns([*refs, HubDataset("d", "org/x")])["org/x"] is None


def test_adapt_dataset_info_points_hub_entry_to_snapshot_and_keeps_everything_else():
    before = json.loads(json.dumps(INFO))
    snap = "/cache/datasets--org--alpaca-tiny/snapshots/abc"
    out, changes = adapt_dataset_info(
        INFO,
        hub_datasets(INFO, ["hub", "local_rel"]),
        {"org/alpaca-tiny": snap},
        "/home/u/data",
        why="pre-downloaded from X",
    )
    assert INFO == before  # input untouched
    hub = out["hub"]
    assert hub["hf_hub_url"] == snap and "ms_hub_url" not in hub
    for key in ("subset", "folder", "split", "formatting", "columns", "tags", "num_samples"):
        assert hub[key] == INFO["hub"][key], key
    assert out["local_rel"]["file_name"] == "/home/u/data/alpaca.json"
    assert out["local_abs"] == INFO["local_abs"]
    assert out["script"]["script_url"] == "/home/u/data/my_script"
    assert out["hub_unused"] == INFO["hub_unused"] and out["ms_only"] == INFO["ms_only"]
    assert out["cloud"] == INFO["cloud"]
    assert set(out) == set(INFO)
    assert changes == [
        Change(
            "dataset_info[hub].hf_hub_url",
            "org/alpaca-tiny",
            snap,
            "pre-downloaded from X; the local copy is loaded with HF_DATASETS_OFFLINE=1",
        )
    ]


def test_adapt_dataset_info_online_builds_entries_from_repo_ids():
    out, changes = adapt_dataset_info(None, hub_datasets(None, ["org/a", "org/b"]), {"org/a": "/snap/a"}, "ONLINE")
    assert out == {"org/a": {"hf_hub_url": "/snap/a"}, "org/b": {"hf_hub_url": "org/b"}}
    assert [c.key for c in changes] == ["dataset_info[org/a].hf_hub_url"]


RUN = "/runs/20261201-120000-abcd"  # the run's folder, fixed before planning


def test_adapt_config_moves_dataset_dir_and_keeps_media_dir():
    updates, changes = adapt_config({"dataset_dir": "/home/u/data"}, ["org/x"], run_dir=RUN)
    assert updates == {"dataset_dir": RUN, "media_dir": "/home/u/data"}
    assert [c.key for c in changes] == ["dataset_dir", "media_dir"] and "org/x" in changes[0].reason
    updates, _ = adapt_config({"dataset_dir": "/home/u/data", "media_dir": "/m"}, ["org/x"], run_dir=RUN)
    assert updates == {"dataset_dir": RUN}
    updates, _ = adapt_config({"dataset_dir": "ONLINE"}, ["org/x"], run_dir=Path(RUN))
    assert updates == {"dataset_dir": RUN}


def _plan():
    return plan({"dataset": "hub", "dataset_dir": "/home/u/data", "bf16": True}, catalog_hardware("A100-80GB"))


def test_final_plan_makes_the_plan_for_one_run():
    d = DatasetPrefetch(
        dataset_dir="/home/u/data",
        info={"hub": {"hf_hub_url": "org/x"}},
        entries=(HubDataset("hub", "org/x"),),
        endpoint="http://mirror",
        endpoint_reason="--mirror",
        downloads=({"repo_id": "org/x", "path": "/snap"},),
        warnings=("w",),
    )
    p = final_plan(_plan(), run_id="20261201-120000-abcd", datasets=d, run_dir=RUN, offline_env=offline_env())
    assert p.config["dataset_dir"] == RUN and p.env["HF_DATASETS_OFFLINE"] == "1" and "w" in p.warnings
    assert p.run_id == "20261201-120000-abcd" and p.files == {INFO_FILE: {"hub": {"hf_hub_url": "/snap"}}}
    assert [c.new for c in p.changes if c.key == "dataset_dir"] == [RUN]
    plan_json = p.to_dict()  # the payload goes to the run's folder, not into plan.json
    assert "dataset_info" not in plan_json and INFO_FILE not in plan_json and "files" not in plan_json
    assert p.files[INFO_FILE] not in plan_json.values()
    assert plan_json["hub_datasets"][0]["repo_id"] == "org/x"
    assert _plan().run_id is None and _plan().files == {}


def test_final_plan_without_downloads_only_warns():
    p = final_plan(_plan(), datasets=DatasetPrefetch(warnings=("not pre-downloaded",)), offline_env=offline_env())
    assert p.config == _plan().config and p.files == {} and p.run_id is None and "not pre-downloaded" in p.warnings


# ------------------------------------------------------------------------------------------------- shell
@pytest.fixture
def online(tmp_path, monkeypatch):
    from huggingface_hub import constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    real = socket.create_connection

    def loopback_only(address, *args, **kwargs):
        if address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"test tried to reach {address[0]}")
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", loopback_only)
    return {"HF_HOME": str(tmp_path / "hf")}


@needs_train_stack
def test_prefetch_datasets_downloads_and_the_result_loads_offline(tmp_path, online):
    data = tmp_path / "data"
    data.mkdir()
    info = {"hub": {"hf_hub_url": "org/alpaca-tiny", "folder": "data"}, "loc": {"file_name": "loc.json"}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    values = {"dataset": "hub", "eval_dataset": "loc", "dataset_dir": str(data)}
    with FakeHub(datasets={"org/alpaca-tiny": {**DATASET_FILES, "other/big.json": b"[]"}}) as h:
        url = h.url
        d = prefetch_datasets(values, url, online, cwd=tmp_path, progress=False)
        asked = {r.path for r in h.requests}
    assert d is not None
    p = final_plan(plan(values, catalog_hardware("A100-80GB")), datasets=d, run_dir=RUN)
    assert "/api/datasets/org/alpaca-tiny" in asked
    assert not any(p.endswith("other/big.json") for p in asked)  # only the folder (and the card)
    run_info = p.files[INFO_FILE]
    snap = run_info["hub"]["hf_hub_url"]
    assert snap.startswith(str(tmp_path / "hf" / "hub" / "datasets--org--alpaca-tiny" / "snapshots"))
    assert run_info["hub"]["folder"] == "data" and run_info["loc"]["file_name"] == str(data / "loc.json")
    assert (p.config["dataset_dir"], p.config["media_dir"]) == (RUN, str(data))
    assert d.downloads[0]["repo_id"] == "org/alpaca-tiny" and d.downloads[0]["endpoint"] == url
    assert json.loads((data / "dataset_info.json").read_text()) == info  # the user's file is unchanged

    # What LLaMA-Factory then calls, with the network off: load_dataset(hf_hub_url, data_dir=folder, split=...).
    code = (
        "import sys; from datasets import load_dataset; "
        "d = load_dataset(path=sys.argv[1], name=None, data_dir='data', split='train'); print(len(d))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf2")}
    r = subprocess.run([str(venv_bin() / "python"), "-c", code, snap], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(len(ROWS))


def test_prefetch_datasets_is_none_without_hub_datasets(tmp_path, online):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"loc": {"file_name": "x.json"}}))
    assert prefetch_datasets({"dataset": "loc", "dataset_dir": str(tmp_path)}, "http://127.0.0.1:9", online) is None
    assert prefetch_datasets({"dataset_dir": str(tmp_path)}, "http://127.0.0.1:9", online) is None


# ------------------------------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_train_with_mirror_predownloads_hub_dataset_and_trains_offline(tiny, tmp_path, isolated_home):
    data = tmp_path / "data"
    data.mkdir()
    (data / "alpaca_tiny.json").write_bytes((tiny / "data" / "alpaca_tiny.json").read_bytes())
    info = {
        "alpaca_tiny": {"file_name": "alpaca_tiny.json"},
        "hub_alpaca": {"hf_hub_url": "org/alpaca-tiny", "folder": "data", "split": "train", "formatting": "alpaca"},
    }
    (data / "dataset_info.json").write_text(json.dumps(info, indent=2))
    user_info = (data / "dataset_info.json").read_bytes()
    model_files = {p.name: p.read_bytes() for p in (tiny / "model").iterdir() if p.is_file()}
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "c.yaml",
        tiny_config(
            tiny, out, model_name_or_path="org/tiny", dataset="hub_alpaca,alpaca_tiny", dataset_dir="data", max_steps=2
        ),
    )
    env = dict(os.environ)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT"):
        env.pop(key, None)
    env["HF_HOME"] = str(tmp_path / "hf")
    with FakeHub(repos={"org/tiny": model_files}, datasets={"org/alpaca-tiny": DATASET_FILES}) as h:
        r = subprocess.run(
            [str(venv_bin() / "ftlaunch"), "train", str(cfg), "--mirror", h.url, "--foreground", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        asked = {q.path for q in h.requests}
    assert r.returncode == 0, r.stdout + r.stderr
    assert "/api/datasets/org/alpaca-tiny" in asked
    run_dir = Path(json.loads(r.stdout)["run_dir"])
    assert (data / "dataset_info.json").read_bytes() == user_info  # the user's file is unchanged
    adapted = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert adapted["dataset_dir"] == str(run_dir) and adapted["media_dir"] == str(data)
    run_info = json.loads((run_dir / "dataset_info.json").read_text())
    assert run_info["hub_alpaca"]["hf_hub_url"].startswith(str(tmp_path / "hf" / "hub" / "datasets--org--alpaca-tiny"))
    assert run_info["alpaca_tiny"]["file_name"] == str(data / "alpaca_tiny.json")
    plan_json = json.loads((run_dir / "plan.json").read_text())
    assert plan_json["env"]["HF_DATASETS_OFFLINE"] == "1" and "dataset_info" not in plan_json
    assert plan_json["hub_datasets"][0]["repo_id"] == "org/alpaca-tiny"
    assert any(c["key"] == "dataset_dir" and c["new"] == str(run_dir) for c in plan_json["changes"])
    assert json.loads((run_dir / "state.json").read_text())["status"] == "succeeded"
    log = (run_dir / "train.log").read_text()
    assert f"Loading dataset {run_info['hub_alpaca']['hf_hub_url']}" in log  # LLaMA-Factory used the local copy
