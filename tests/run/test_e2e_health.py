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


def real_run(tiny: Path, tmp_path: Path, *args: str, out: Path | None = None, **cfg) -> tuple:
    """ftlaunch train --foreground on the tiny model (fp32 on the CPU): (result, run, env, out)."""
    out = out or tmp_path / "out"
    path = write_yaml(tmp_path / f"c-{len(list(tmp_path.glob('c-*.yaml')))}.yaml", tiny_config(tiny, out, **cfg))
    env = child_env(FTLAUNCH_HOME=str(tmp_path / "home"))
    r = ftl("train", str(path), "--foreground", "--json", *args, env=env, timeout=400)
    run = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    return r, run, env, out


def assert_listing_matches(out: Path, messages: list[str]) -> None:
    """Every folder a message says it moved is there under that name; every set-aside folder in
    output_dir is one a message named; what the last message says is left in place is what is left."""
    import re

    moved = []
    for msg in messages:
        part = msg.split("; set aside: ", 1)[1].split("; every checkpoint", 1)[0] if "; set aside: " in msg else ""
        moved += re.findall(r"(\S+) -> ([^\s(;,]+)", part)
    names = {p.name for p in out.iterdir()}
    for _old, new in moved:
        assert new.rstrip("/") in names, (new, sorted(names))
    said = {new.rstrip("/") for _, new in moved}
    aside = {n for n in names if n.split("-checkpoint-")[0] in ("diverged", "badweights", "unverified", "rolledback")}
    aside |= {n for n in names if n.startswith("diverged-final-")}
    assert aside <= said, (aside - said, messages)
    left = {n for n in names if n.startswith("checkpoint-")}
    if "left in place:" in messages[-1]:
        listed = messages[-1].rsplit("left in place: ", 1)[1].strip()
        assert left == (set() if listed == "none" else set(listed.split(", "))), (left, messages[-1])


def max_abs(folder: Path) -> float:
    """max |w| with torch (inf when any weight is not finite): the truth the weight scan samples."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    top = 0.0
    for f in folder.glob("*.safetensors"):
        for t in load_file(str(f)).values():
            t = t.float()
            top = max(top, float("inf") if not torch.isfinite(t).all() else float(t.abs().max()))
    return top


def test_real_lr1e4_dead_model_is_never_called_succeeded(tiny, tmp_path):
    """Issue 23 case 1: lr 1e4, save_steps 8. From step 2 grad_norm is 0 and the loss 6.2106: dead. It
    diverges at step 2, no checkpoint was written before it, and `rollback` alone does not start over."""
    r, run, env, out = real_run(tiny, tmp_path, learning_rate=1.0e4, save_steps=8, max_steps=24, warmup_steps=0)
    assert r.returncode == 14, r.stdout + r.stderr
    s = status(run["id"], env=env)
    assert s["status"] == "diverged" and s["health"] == "diverged" and s["attempt"] == 1
    div = [e for e in events(Path(run["run_dir"])) if e["event"] == "diverged"]
    assert (div[0]["step"], div[0]["signal"]) in ((2, "zero_grad_norm"), (2, "flat_loss")), div
    assert "no clean checkpoint remains" in s["message"] and "rollback-or-restart would" in s["message"]
    assert_listing_matches(out, [s["message"]])
    assert not list(out.glob("checkpoint-*"))


def test_real_lr1e8_never_restores_blown_weights_and_the_folders_match_the_messages(tiny, tmp_path):
    """Issue 23 case 2: lr 1e8, save_steps 2. Every weight is NaN after step 2's update; the record after
    checkpoint-2 (and the console's grad_norm at step 2) say so, and so would the scan. With
    --on-diverge rollback-or-restart each rollback starts from the base model with a lower lr."""
    r, run, env, out = real_run(
        tiny, tmp_path, "--on-diverge", "rollback-or-restart", learning_rate=1.0e8, save_steps=2, max_steps=8,
        warmup_steps=0,
    )  # fmt: skip
    assert r.returncode == 14, r.stdout + r.stderr
    run_dir = Path(run["run_dir"])
    rolled = [e for e in events(run_dir) if e["event"] == "rolled_back"]
    assert [e["edits"] for e in rolled] == [{"learning_rate": 5e7}, {"learning_rate": 2.5e7}]
    base = max_abs(tiny / "model")
    for e in rolled:  # what was restored: the base model, or a checkpoint no worse than it
        restored = tiny / "model" if e["resume_from"] is None else out / e["resume_from"]
        assert max_abs(restored) <= 100 * base, e
    assert all(e["resume_from"] is None and "from the base model" in e["message"] for e in rolled)
    # the trainer really started over: each attempt's first step logs the base model's step-1 loss
    from ftlaunch.run.records import read_attempts

    attempts = read_attempts(run_dir)
    assert [(a.attempt, a.resume_step) for a in attempts] == [(1, 0), (2, 0), (3, 0)]
    firsts = [a.records[0] for a in attempts]
    assert [f["current_steps"] for f in firsts] == [1, 1, 1]
    assert firsts[1]["loss"] == pytest.approx(firsts[0]["loss"]) == pytest.approx(firsts[2]["loss"])
    s = status(run["id"], env=env)
    assert s["status"] == "diverged" and s["attempt"] == 3 and "after 2 rollbacks" in s["message"]
    assert_listing_matches(out, [e["message"] for e in rolled] + [s["message"]])
    assert not list(out.glob("checkpoint-*"))
    for ck in out.glob("diverged-checkpoint-*"):  # what was set aside really is garbage (torch says so)
        assert max_abs(ck) == float("inf")
    # plot: one curve per attempt and a marker where each began
    from ftlaunch.cli.plot import progress_figure
    from ftlaunch.estimate.history import training_history

    hist = training_history(run["id"], env)
    marks = [(m.attempt, m.step, m.why) for m in hist.markers]
    assert hist.attempts == [1, 2, 3] and marks == [(1, 0, "start"), (2, 0, "rollback"), (3, 0, "rollback")]
    plt, fig = progress_figure(hist)
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines if not ln.get_gid()] == ["attempt 1", "attempt 2", "attempt 3"]
    assert sorted(ln.get_gid() for ln in lines if ln.get_gid()) == ["attempt-1", "attempt-2", "attempt-3"]
    plt.close(fig)


def test_real_plot_of_two_runs_that_shared_an_output_dir_draws_each_run_only(tiny, tmp_path):
    """--fresh moves the first run's files aside and the second run writes its own trainer_log.jsonl in
    the same output_dir: each run's plot is its own curve, with its own attempt marker."""
    from ftlaunch.cli.plot import progress_figure
    from ftlaunch.estimate.history import training_history

    r1, run1, env, out = real_run(tiny, tmp_path, learning_rate=1.0e-3, max_steps=6, save_steps=100)
    assert r1.returncode == 0, r1.stdout + r1.stderr
    r2, run2, _, _ = real_run(tiny, tmp_path, "--fresh", learning_rate=3.0e-2, max_steps=9, save_steps=100)
    assert r2.returncode == 0, r2.stdout + r2.stderr

    def curve(run_id: str) -> tuple[list, list, list]:
        plt, fig = progress_figure(training_history(run_id, env))
        lines = fig.axes[0].get_lines()
        data = [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in lines if not ln.get_gid()]
        marks = [ln.get_gid() for ln in lines if ln.get_gid()]
        plt.close(fig)
        return data, marks, [ln.get_label() for ln in lines if not ln.get_gid()]

    (a,), marks_a, labels_a = curve(run1["id"])
    (b,), marks_b, labels_b = curve(run2["id"])
    assert a[0] == [1, 2, 3, 4, 5, 6] and b[0] == list(range(1, 10))
    assert a[1] != b[1][:6]  # two different curves (lr 1e-3 and 3e-2)
    assert marks_a == marks_b == ["attempt-1"] and labels_a == labels_b == ["attempt 1"]
    # the shared file now holds only the second run, which the old code drew under the first's title
    tlog = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in tlog if "loss" in r] == pytest.approx(b[1])
