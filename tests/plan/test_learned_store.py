"""learned.json (issue 20): locked and versioned like the other state files. Two processes remembering
at once lose no entry; a file of another version is refused and left byte-identical; keys this
version does not know are kept; the layout of before is read and versioned at the next write."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from ftlaunch.errors import StateError, StateVersionError
from ftlaunch.plan.memory.store import (
    LEARNED_VERSION,
    Learned,
    load,
    recall,
    remember,
    remember_observed,
    remembered,
    with_observation,
)

from ..helpers import said

KEYS = 50


def _remember_many(home: str, prefix: str, go) -> None:
    env = {"FTLAUNCH_HOME": home}
    go.wait()
    for i in range(KEYS):
        values = {"per_device_train_batch_size": i % 4 + 1, "gradient_accumulation_steps": 2}
        remember(env, f"{prefix}{i}:A10G", values, reason=f"run {prefix}{i}")
        remember_observed(
            env, f"{prefix}{i}:A10G", observed_peak_gib=10.0 + i, predicted_peak_gib=9.0, micro_batch=i % 4 + 1
        )


def test_two_processes_remembering_at_once_lose_no_entry(isolated_home):
    ctx = multiprocessing.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=_remember_many, args=(str(isolated_home), p, go)) for p in ("a", "b")]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    learned = load({"FTLAUNCH_HOME": str(isolated_home)})
    want = {f"{p}{i}:A10G" for p in "ab" for i in range(KEYS)}
    assert set(learned.entries) == want
    assert all(e["learned_from"] and e["observed"]["observed_peak_gib"] >= 10 for e in learned.entries.values())
    assert json.loads((isolated_home / "learned.json").read_text())["version"] == LEARNED_VERSION


def test_a_file_of_another_version_is_refused_and_left_byte_identical(isolated_home):
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    isolated_home.mkdir(parents=True, exist_ok=True)
    path = isolated_home / "learned.json"
    isolated_home.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'{"version": 2, "entries": {"k:A10G": {"micro_batch": 2, "new": true}}}\n')
    before = path.read_bytes()
    with pytest.raises(StateVersionError) as exc:
        remember(env, "k:A10G", {"per_device_train_batch_size": 1}, reason="run x")
    assert "version 2" in exc.value.message and exc.value.exit_code == 12
    with pytest.raises(StateVersionError):
        remember_observed(env, "other:A10G", observed_peak_gib=3.0, predicted_peak_gib=2.0, micro_batch=1)
    with pytest.raises(StateVersionError):
        recall(env, "k:A10G")
    assert path.read_bytes() == before
    assert sorted(p.name for p in isolated_home.iterdir() if p.name.startswith(".learned")) == []  # no temp left


def test_an_unreadable_file_is_refused_not_replaced(isolated_home):
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    isolated_home.mkdir(parents=True, exist_ok=True)
    (isolated_home / "learned.json").write_bytes(b'{"version": 1, "entr')
    with pytest.raises(StateError, match="not JSON"):
        remember(env, "k:A10G", {}, reason="run x")
    assert (isolated_home / "learned.json").read_bytes() == b'{"version": 1, "entr'


def test_unknown_keys_are_kept(isolated_home):
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    isolated_home.mkdir(parents=True, exist_ok=True)
    (isolated_home / "learned.json").write_text(
        json.dumps({"version": 1, "entries": {"k:A10G": {"micro_batch": 4, "note": "kept"}}, "future": {"x": 1}})
    )
    remember(env, "k:A10G", {"per_device_train_batch_size": 2}, reason="run y")
    remember_observed(env, "k:A10G", observed_peak_gib=5.0, predicted_peak_gib=4.0, micro_batch=2)
    data = json.loads((isolated_home / "learned.json").read_text())
    assert data["future"] == {"x": 1} and data["version"] == 1
    entry = data["entries"]["k:A10G"]
    assert entry["note"] == "kept" and entry["micro_batch"] == 2 and entry["observed"]["observed_peak_gib"] == 5.0


def test_the_layout_of_before_is_read_and_versioned_at_the_next_write(isolated_home):
    env = {"FTLAUNCH_HOME": str(isolated_home)}
    isolated_home.mkdir(parents=True, exist_ok=True)
    old = {"k:A10G": {"micro_batch": 2, "learned_from": "run 1", "observed": {"observed_peak_gib": 7.0}}}
    (isolated_home / "learned.json").write_text(json.dumps(old))
    assert recall(env, "k:A10G") == old["k:A10G"]
    remember(env, "j:A10G", {"per_device_train_batch_size": 1}, reason="run 2")
    data = json.loads((isolated_home / "learned.json").read_text())
    assert data["version"] == LEARNED_VERSION and set(data["entries"]) == {"k:A10G", "j:A10G"}
    assert data["entries"]["k:A10G"] == old["k:A10G"]


def test_no_file_is_nothing_learned(isolated_home):
    assert recall({"FTLAUNCH_HOME": str(isolated_home)}, "k:A10G") is None
    assert not os.path.exists(isolated_home / "learned.json")


def test_the_entry_updates_are_pure():
    old = {"observed": {"observed_peak_gib": 8.0, "micro_batch": 2}, "note": 1}
    got = remembered(old, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8}, "run r", "T")
    assert got["observed"] == old["observed"] and got["note"] == 1 and got["micro_batch"] == 2 and got["at"] == "T"
    assert with_observation(old, 7.5, 6.0, 2, "T") is None  # a larger one for this micro-batch is kept
    assert with_observation(old, 9.0, 6.0, 2, "T")["observed"]["observed_peak_gib"] == 9.0
    assert with_observation(old, 3.0, 6.0, 1, "T")["observed"]["micro_batch"] == 1
    assert Learned().with_entry("k", {"a": 1}).to_json() == {"version": LEARNED_VERSION, "entries": {"k": {"a": 1}}}


def test_planning_goes_on_without_a_learned_json_of_another_version_and_says_so(isolated_home, tmp_path):
    from click.testing import CliRunner

    from ftlaunch.cli.main import main as cli

    isolated_home.mkdir(parents=True, exist_ok=True)
    path = isolated_home / "learned.json"
    path.write_text(json.dumps({"version": LEARNED_VERSION + 1, "entries": {}}))
    before = path.read_bytes()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"stage: sft\ndo_train: true\noutput_dir: {tmp_path / 'out'}\nper_device_train_batch_size: 2\n")
    r = CliRunner().invoke(cli, ["plan", str(cfg), "--gpu", "A10G", "--params", "1B"])
    assert r.exit_code == 0, r.output
    assert said("was not used", r.output) and "learned.json" in r.output
    assert path.read_bytes() == before
