"""Numeric health end to end: a diverging run is caught, rolled back with a lower lr, or stopped.

Exact step control comes from tests/fake_nan_trainer.py (NaN from a given step while the lr it really
uses, read from the checkpoint like the real trainer does, is above a threshold). The last test runs
the real llamafactory-cli on the tiny model with an absurd learning rate, fp32 on the CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT, child_env, tiny_config, write_yaml
from .test_e2e_detached import ftl, status

pytestmark = pytest.mark.e2e


def fake_setup(tmp_path: Path, *, nan_from: int = 12, lr_above: float = 0.0, **cfg_over) -> tuple[Path, dict, Path]:
    wrapper = tmp_path / "fake-llamafactory-cli"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "fake_nan_trainer.py"} "$@"\n')
    wrapper.chmod(0o755)
    log = tmp_path / "fake.jsonl"
    env = child_env(
        FTLAUNCH_LLAMAFACTORY_CLI=str(wrapper),
        FAKE_NAN_LOG=str(log),
        FAKE_NAN_FROM_STEP=str(nan_from),
        FAKE_NAN_LR_ABOVE=str(lr_above),
    )
    cfg = {
        "stage": "sft",
        "do_train": True,
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "learning_rate": 2e-3,
        "max_steps": 16,
        "save_steps": 5,
        **cfg_over,
    }
    return write_yaml(tmp_path / "c.yaml", cfg), env, log


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def events(run_dir: Path) -> list[dict]:
    return lines(run_dir / "events.jsonl")


def markers(out: Path) -> set[str]:
    return {p.read_text() for p in out.glob("*/marker")}


def test_nan_after_checkpoint_10_resumes_from_it_with_half_the_lr_same_batch_and_finishes(tmp_path):
    cfg, env, log = fake_setup(tmp_path, nan_from=12, lr_above=1e-3)
    r = ftl("train", str(cfg), "--foreground", "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)
    attempts = [x for x in lines(log) if "resume_from" in x]
    assert len(attempts) == 2
    assert attempts[0] == {"resume_from": None, "lr": 2e-3, "batch": [2, 4]}
    # checkpoint-10, not a later one; the lr the trainer really uses is halved; the global batch is the same
    assert attempts[1] == {"resume_from": "checkpoint-10", "lr": 1e-3, "batch": [2, 4]}
    ev = events(Path(run["run_dir"]))
    div = [e for e in ev if e["event"] == "diverged"]
    assert len(div) == 1 and div[0]["step"] == 12 and div[0]["signal"] == "nonfinite_loss"
    rolled = [e for e in ev if e["event"] == "rolled_back"]
    assert len(rolled) == 1 and rolled[0]["resume_from"] == "checkpoint-10"
    assert rolled[0]["edits"] == {"learning_rate": 1e-3} and rolled[0]["message"].startswith("[1/2]")
    s = status(run["id"], env=env)
    assert s["status"] == "succeeded" and s["health"] == "finite" and s["step"] == 16
    assert s["diverged"]["first_bad"]["step"] == 12
    out = tmp_path / "out"
    # the original checkpoint-10 is kept beside the rebuilt one; a checkpoint-15 of the bad attempt, if
    # it was written before the trainer was stopped, is set aside: no checkpoint was deleted
    assert len(list(out.glob("rolledback-checkpoint-10-*"))) == 1
    written = {x["marker"] for x in lines(log) if "marker" in x}
    assert written <= markers(out)
    assert not list(out.glob("checkpoint-1[1-4]"))
    assert (out / "checkpoint-15").is_dir()  # written again by the healthy attempt
    # the config the run ends with: lower lr, batch untouched
    import yaml

    final = yaml.safe_load((Path(run["run_dir"]) / "config.yaml").read_text())
    assert final["learning_rate"] == 1e-3
    assert (final["per_device_train_batch_size"], final["gradient_accumulation_steps"]) == (2, 4)
    # `logs` marks the first bad record
    logs = ftl("logs", run["id"], env=env).stdout
    assert ">>> first bad record: diverged at step 12: nonfinite_loss" in logs


def test_a_run_that_diverges_whatever_is_done_stops_after_two_rollbacks_with_every_checkpoint_kept(tmp_path):
    cfg, env, log = fake_setup(tmp_path, nan_from=12, lr_above=0.0, max_grad_norm=0)
    r = ftl("train", str(cfg), "--foreground", "--json", env=env)
    assert r.returncode == 14, r.stdout + r.stderr
    run = json.loads(r.stdout)
    attempts = [x for x in lines(log) if "resume_from" in x]
    assert [a["resume_from"] for a in attempts] == [None, "checkpoint-10", "checkpoint-10"]
    assert [a["lr"] for a in attempts] == [2e-3, 1e-3, 1e-3]  # rung 2 is clipping, the lr stays
    assert all(a["batch"] == [2, 4] for a in attempts)
    ev = events(Path(run["run_dir"]))
    rolled = [e["edits"] for e in ev if e["event"] == "rolled_back"]
    assert rolled == [{"learning_rate": 1e-3}, {"max_grad_norm": 1.0}]
    s = status(run["id"], env=env)
    assert s["status"] == "diverged" and s["exit_code"] == 14 and s["failure_kind"] == "diverged"
    assert s["last_checkpoint"] == 10  # checkpoint-15 was set aside
    assert s["health"] == "diverged"
    assert "after 2 rollbacks (tried: learning_rate 0.002 -> 0.001; max_grad_norm 0 -> 1.0)" in s["message"]
    assert ftl("status", run["id"], env=env).returncode == 14
    out = tmp_path / "out"
    written = {x["marker"] for x in lines(log) if "marker" in x}
    assert written and written <= markers(out)  # every checkpoint ever written is still there
    # nothing written after the divergence is left where llamafactory would resume from it
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-5"]


def test_on_diverge_stop_stops_at_once_and_ignore_trains_on(tmp_path):
    (tmp_path / "a").mkdir()
    cfg, env, log = fake_setup(tmp_path / "a")
    r = ftl("train", str(cfg), "--foreground", "--json", "--on-diverge", "stop", env=env)
    assert r.returncode == 14, r.stdout + r.stderr
    s = status(json.loads(r.stdout)["id"], env=env)
    assert s["status"] == "diverged" and s["attempt"] == 1 and "--on-diverge stop" in s["message"]
    assert len([x for x in lines(log) if "resume_from" in x]) == 1

    (tmp_path / "b").mkdir()
    cfg, env, log = fake_setup(tmp_path / "b")
    r = ftl("train", str(cfg), "--foreground", "--json", "--on-diverge", "ignore", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    s = status(json.loads(r.stdout)["id"], env=env)
    assert s["status"] == "succeeded" and s["health"] == "diverged" and s["step"] == 16


def test_real_tiny_model_with_an_absurd_lr_goes_non_finite_is_caught_and_rolled_back(tiny, tmp_path):
    """fp32 on the CPU, lr 1e8: step 2's grad_norm is NaN (console and trainer_state.json only), step 3's
    loss is NaN, logged as 0.0 by HF's logging_nan_inf_filter. Either way the rollback goes to
    checkpoint-1 (checkpoint-2 holds the NaN step), and the lr the trainer uses after it is really halved."""
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "c.yaml", tiny_config(tiny, out, learning_rate=1.0e8, max_steps=6, save_steps=1, warmup_steps=0)
    )
    env = child_env(FTLAUNCH_HOME=str(tmp_path / "home"))
    r = ftl("train", str(cfg), "--foreground", "--json", env=env, timeout=400)
    assert r.returncode == 14, r.stdout + r.stderr
    run = json.loads(r.stdout)
    ev = events(Path(run["run_dir"]))
    div = [e for e in ev if e["event"] == "diverged"]
    # the console's grad_norm is normally seen first (step 2); the hidden NaN loss of step 3 otherwise
    assert (div[0]["step"], div[0]["signal"]) in ((2, "nonfinite_grad_norm"), (3, "hidden_nan_loss")), div
    rolled = [e for e in ev if e["event"] == "rolled_back"]
    assert [e["resume_from"] for e in rolled] == ["checkpoint-1", "checkpoint-1"]
    assert [e["edits"] for e in rolled] == [{"learning_rate": 5e7}, {"learning_rate": 2.5e7}]
    # the real trainer's own log after each rollback: it resumed at step 2 with the lowered lr
    recs = lines(out / "trainer_log.jsonl")
    resumed = [r for r in recs if r["current_steps"] == 2]
    first = resumed[0]["lr"]  # the cosine schedule's value at step 2 of lr 1e8
    assert [r["lr"] for r in resumed] == pytest.approx([first, first / 2, first / 4], rel=1e-9)
    s = status(run["id"], env=env)
    assert s["status"] == "diverged" and s["attempt"] == 3
    # every checkpoint kept: the originals of checkpoint-1 and all later ones are set aside, not deleted
    assert len(list(out.glob("rolledback-checkpoint-1-*"))) == 2
    assert list(out.glob("diverged-checkpoint-2-*"))
