"""A run is `succeeded` only if its end is healthy (issue 31, case 2): the dead-model rules count steps,
a tail the streaming rules could not yet call is judged with the records there are, and what a finished
run saved (final model, last checkpoint) goes through the weight scan a rollback uses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ftlaunch.run import health as h
from ftlaunch.run import rollback

from .test_health import complete_checkpoint, hist, write_weights


def every(n: int, steps: int, loss=lambda s: 2.0 + 0.01 * (s % 7), grad=lambda s: 1.0) -> list[dict]:
    """Records as `logging_steps: n` writes them (steps n, 2n, ...), grad_norm merged from the console."""
    return [{"current_steps": s, "loss": loss(s), "grad_norm": grad(s)} for s in range(n, steps + 1, n)]


def test_zero_grad_norm_counts_steps_not_records():
    # issue 31 (a): lr 1e4, logging_steps 10, grad_norm 0 at all 4 logged steps; 5 records never came
    v = h.judge(every(10, 40, loss=lambda s: 6.2106, grad=lambda s: 0.0))
    assert v.diverged and v.first_bad.signal is h.Signal.ZERO_GRAD_NORM
    assert v.first_bad.step == 10 and v.first_bad.values["consecutive"] == 2 and v.records == 4
    # logging_steps 1: still 5 steps in a row; 4 are not enough, and one zero record alone never is
    assert not h.judge(every(1, 5, grad=lambda s: 0.0 if s > 1 else 1.0)).diverged
    assert h.judge(every(1, 6, grad=lambda s: 0.0 if s > 1 else 1.0)).first_bad.step == 2
    assert not h.judge(every(10, 40, grad=lambda s: 0.0 if s == 40 else 1.0)).diverged


def test_a_flat_loss_needs_more_records_than_a_zero_grad_norm():
    # a live loss's logged average matches its neighbour to 1e-5 about once in a thousand records
    flat = every(10, 40, loss=lambda s: 6.2106 if s > 10 else 6.3)
    assert not h.judge(flat).diverged  # 3 equal records span 21 steps but are not yet 4
    v = h.judge(every(10, 50, loss=lambda s: 6.2106 if s > 10 else 6.3))
    assert v.first_bad.signal is h.Signal.FLAT_LOSS and (v.first_bad.step, v.last_good_step) == (20, 10)


def test_the_tail_of_a_finished_run_is_judged_with_the_records_there_are():
    # issue 31 (b): the model dies at step 38 of 40 (logging_steps 1): 3 dead records, never 5
    recs = every(1, 40, loss=lambda s: 6.2106 if s >= 38 else 4.0 + 0.01 * (s % 7), grad=lambda s: 0 if s >= 38 else 1)
    v = h.judge(recs)
    assert not v.diverged
    end = h.judge_end(v)
    assert end.diverged and end.first_bad.signal is h.Signal.ZERO_GRAD_NORM and end.first_bad.values["at_end"]
    assert (end.first_bad.step, end.last_good_step) == (38, 37)
    # without the console's grad_norm the 3 equal losses say the same
    end = h.judge_end(h.judge([{k: r[k] for k in ("current_steps", "loss")} for r in recs]))
    assert end.first_bad.signal is h.Signal.FLAT_LOSS and end.first_bad.step == 38
    # a spike that the end cut short (2 of the 3 a sustained spike needs)
    spiky = every(1, 30, loss=lambda s: 50.0 if s >= 29 else 2.0 + 0.01 * (s % 7))
    end = h.judge_end(h.judge(spiky))
    assert end.first_bad.signal is h.Signal.LOSS_SPIKE and end.first_bad.step == 29
    # a healthy tail, one zero grad_norm, one spike: nothing to say (the weight scan still looks)
    for recs in (every(1, 30), every(10, 40, grad=lambda s: 0.0 if s == 40 else 1.0), spiky[:-1]):
        v = h.judge(recs)
        assert h.judge_end(v) is v


def test_bad_weights_keep_the_last_good_record_so_an_earlier_checkpoint_stays_a_target():
    v = h.judge(every(10, 40))
    bad = h.weights_verdict(v, 40, "checkpoint-40", "weights blown up")
    assert bad.diverged and bad.last_good_step == 40 and bad.first_bad.signal is h.Signal.BAD_WEIGHTS
    assert bad.message() == "diverged at step 40: bad_weights (where=checkpoint-40, why=weights blown up)"
    cks = h.judge_checkpoints(bad, [(s, f"checkpoint-{s}", hist(s)) for s in (30, 40)])
    assert [(c.name, c.clean) for c in cks] == [("checkpoint-30", True), ("checkpoint-40", False)]


def scan(folders: list[tuple[str, str]]) -> dict:
    return rollback.scan_weights(sys.executable, folders)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: linspace to a non-finite value
def test_the_end_scan_reads_the_final_model_and_the_last_checkpoint(tmp_path):
    base, out = tmp_path / "base", tmp_path / "out"
    write_weights(base, a=1.0, b=0.5)
    for step, top in ((10, 1.1), (30, 1.2), (40, 3.6e4)):
        write_weights(out / f"checkpoint-{step}", a=top, b=0.5)
    write_weights(out, a=3.6e4, b=0.5)  # the final model, in output_dir itself
    complete = [(s, out / f"checkpoint-{s}") for s in (10, 30, 40)]
    bad, scanned = rollback.end_scan_problems(out, complete, 40, scan, str(base), 100.0)
    assert scanned == ["checkpoint-10", "checkpoint-40", rollback.FINAL]  # checkpoint-30 is not read
    assert [(c.name, c.step, c.aside_as) for c in bad] == [
        ("checkpoint-40", 40, "badweights"),
        ("final model", 40, "badweights"),
    ]
    assert "weights blown up: max |w| 3.6e+04, 3.6e+04 x the base model's 1" in bad[0].why
    write_weights(out, a=1.3, b=float("nan"))  # a NaN final model beside a fine checkpoint
    write_weights(out / "checkpoint-40", a=1.3, b=0.5)
    bad, _ = rollback.end_scan_problems(out, complete, 40, scan, str(base), 100.0)
    assert [c.name for c in bad] == ["final model"] and "non-finite" in bad[0].why
    write_weights(out, a=1.3, b=0.5)
    assert rollback.end_scan_problems(out, complete, 40, scan, str(base), 100.0)[0] == []
    assert rollback.end_scan_problems(tmp_path / "empty", [], None, scan, str(base), 100.0) == ([], [])


def watch(tmp_path: Path, policy: str = "rollback") -> tuple[rollback.HealthWatch, Path, dict, list[str]]:
    run_dir, out, base = tmp_path / "run", tmp_path / "out", tmp_path / "base"
    run_dir.mkdir(parents=True)
    (run_dir / "state.json").write_text(json.dumps({"version": 1, "id": "r", "on_diverge": policy}))
    values = {"learning_rate": 1e-3, "output_dir": str(out), "model_name_or_path": str(base)}
    said: list[str] = []
    w = rollback.HealthWatch(run_dir, values, {}, said.append)
    w.start()
    write_weights(base, a=1.0, b=0.5)
    for step in (10, 20, 30, 40):
        complete_checkpoint(out, step, hist(step), 1e-3)
        write_weights(out / f"checkpoint-{step}", a=1.0 + step / 100, b=0.5)
    return w, out, values, said


def test_a_finished_run_with_blown_weights_rolls_back_to_the_last_clean_checkpoint(tmp_path):
    from ftlaunch.run.store import read_events, read_state

    w, out, values, said = watch(tmp_path)
    write_weights(out / "checkpoint-40", a=3.6e4, b=0.5)
    write_weights(out, a=3.6e4, b=0.5)
    assert not w.feed(every(10, 40)) and not w.halt  # every record looked fine
    assert w.after(out, values, weights_only=False) is None  # an attempt that did not finish: not judged here
    d = w.after(out, values, weights_only=False, done=True)
    assert d.action is h.Response.ROLLBACK and d.resume_from == "checkpoint-30"
    assert d.message.startswith("[1/2] diverged at step 40: bad_weights (where=checkpoint-40, why=weights blown up")
    names = sorted(p.name for p in out.iterdir())
    aside = [n for n in names if n.startswith("badweights-checkpoint-40-")]
    final = [n for n in names if n.startswith("diverged-final-")]
    assert aside and final and not (out / "model.safetensors").exists()
    assert f"checkpoint-40 -> {aside[0]} (weights blown up" in d.message
    assert f"model.safetensors -> {final[0]}/" in d.message
    ev = read_events(w.run_dir)
    end = next(e for e in ev if e["event"] == "end_judged")
    assert end["healthy"] is False and end["scanned"] == ["checkpoint-10", "checkpoint-40", "final model"]
    div = [e for e in ev if e["event"] == "diverged"]
    assert len(div) == 1 and div[0]["signal"] == "bad_weights" and div[0]["step"] == 40
    assert read_state(w.run_dir).health["health"] == "diverged"
    assert any(">>> first bad record: diverged at step 40: bad_weights" in s for s in said)


def test_a_finished_run_with_a_dead_tail_and_policy_stop_ends_diverged_and_a_healthy_end_succeeds(tmp_path):
    from ftlaunch.run.store import read_events

    w, out, values, _ = watch(tmp_path / "a", policy="stop")
    write_weights(out, a=1.5, b=0.5)
    w.feed(every(1, 40, grad=lambda s: 0.0 if s >= 39 else 1.0))
    d = w.after(out, values, weights_only=False, done=True)
    assert d.action is h.Response.STOP and "diverged at step 39: zero_grad_norm" in d.message
    assert not (out / "model.safetensors").exists() and list(out.glob("diverged-final-*/model.safetensors"))

    w, out, values, _ = watch(tmp_path / "b")
    write_weights(out, a=1.5, b=0.5)
    w.feed(every(10, 40))
    assert w.after(out, values, weights_only=False, done=True) is None
    end = [e for e in read_events(w.run_dir) if e["event"] == "end_judged"]
    assert len(end) == 1 and end[0]["healthy"] is True and end[0]["verdict"] == "finite"
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-40").is_dir()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: linspace to a non-finite value
def test_ignore_records_a_bad_end_and_lets_the_run_succeed(tmp_path):
    w, out, values, said = watch(tmp_path, policy="ignore")
    write_weights(out, a=float("inf"), b=0.5)
    w.feed(every(10, 40))
    assert w.after(out, values, weights_only=False, done=True) is None
    assert w.verdict.diverged and (out / "model.safetensors").is_file()
    assert any("bad_weights" in s for s in said)


@pytest.mark.parametrize("text", ["flat_records=2", "dead_steps=30"])
def test_thresholds_take_the_new_keys(text):
    t = h.thresholds_from(text)
    key, value = text.split("=")
    assert getattr(t, key) == int(value)
