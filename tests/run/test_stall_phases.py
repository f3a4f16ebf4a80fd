"""The stall watchdog's phases end (issue 31, case 5): a save, an evaluation or a load that hangs while
the trainer prints is caught. Pure decisions first, then real supervisor runs of a scripted trainer
(tests/fake_trainer.py's, with the chatty hangs a real run cannot produce cheaply)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from ftlaunch.run.stall import EVAL_MARK, SAVE_MARK, Phase, StallPolicy, Watchdog
from ftlaunch.run.state import RunStatus
from ftlaunch.run.store import read_events, read_state, update_state
from ftlaunch.run.supervisor import Supervisor
from tests.conftest import ROOT
from tests.run.test_recovery import make_run

SAVE = f"[INFO|trainer.py:3815] >> {SAVE_MARK} /x/checkpoint-6"


def chatter(w: Watchdog, start: float, until: float, every: float = 0.5) -> tuple[Watchdog, float | None]:
    """Feed a console line every ``every`` s; the first time the watchdog calls it a stall (or None)."""
    t = start
    while t <= until:
        w = w.console("INFO still here", t)
        if w.stalled(t):
            return w, t
        t += every
    return w, None


# ---------------------------------------------------------------- pure: the phases' limits


def test_a_save_that_prints_but_writes_nothing_stalls_at_its_allowance():
    # issue 31: "Saving model checkpoint to ..." then a line every 0.5 s: 6.5 min against a 30 s allowance
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(6, 5.0).console(SAVE, 10.0)
    assert w.phase is Phase.SAVING and w.allowance() == 30.0
    w, at = chatter(w, 10.5, 10.0 + 6.5 * 60)
    assert at is not None and 40.0 < at <= 41.0
    assert "no progress for 3" in w.describe(at) and "(saving; allowance 30 s" in w.describe(at)


def test_a_save_whose_folder_grows_goes_on_until_its_limit_from_the_phase_start():
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(6, 5.0).console(SAVE, 10.0)
    t = 10.0
    while not w.stalled(t):  # the folder grows every second, forever
        t += 1.0
        w = w.checkpoint_grew(t)
    assert t == 41.0 and w.idle(t) == 0.0  # nothing measured, no size known: the allowance is the limit
    assert w.limit()[0] == 30.0 and "past the phase's limit of 30 s" in w.describe(t)
    # the disk forecast's checkpoint size: 3x its bytes at 20 MB/s (nothing measured yet) = 300 s
    w = Watchdog.begin(StallPolicy(timeout=10, checkpoint_bytes=2_000_000_000), now=0.0).steps(6, 5.0)
    w = w.console(SAVE, 10.0)
    assert w.limit()[0] == 300.0 and "20 MB/s assumed" in w.limit()[1]
    assert not w.checkpoint_grew(309.0).stalled(309.0) and w.checkpoint_grew(311.0).stalled(311.0)


def test_a_measured_save_sets_the_next_ones_limit_from_its_speed_and_length():
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(4, 5.0).console(SAVE, 10.0)
    w = w.checkpoint_done(30.0, size=1_000_000_000)  # 1 GB in 20 s: 50 MB/s
    assert (w.phase, w.longest_save, w.write_rate, w.save_bytes) == (Phase.TRAINING, 20.0, 5e7, 1_000_000_000)
    w = w.steps(5, 31.0).console(SAVE, 40.0)
    assert w.limit()[0] == 60.0 and "50 MB/s measured" in w.limit()[1]
    d = w.to_dict(now=45.0, wall_now=1000.0)
    assert (d["longest_save_s"], d["write_rate_bps"], d["save_bytes"], d["phase_limit_s"]) == (
        20.0,
        50_000_000,
        1_000_000_000,
        60.0,
    )
    nxt = Watchdog.begin(StallPolicy(timeout=10), now=0.0, earlier=d)  # the next attempt keeps them
    assert (nxt.longest_save, nxt.write_rate, nxt.save_bytes) == (20.0, 5e7, 1_000_000_000)


def test_an_evaluation_that_prints_is_progress_up_to_its_limit():
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(4, 5.0).console(EVAL_MARK, 10.0)
    assert w.phase is Phase.EVALUATING and w.limit()[0] == 120.0  # 4x the 30 s allowance: none measured yet
    w, at = chatter(w, 10.5, 1000.0)
    assert at is not None and 130.0 < at <= 131.0 and "evaluating for 12" in w.describe(at)
    # a measured evaluation of 20 s: the next one may last 3x that
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(4, 5.0).console(EVAL_MARK, 10.0).steps(5, 30.0)
    assert w.longest_eval == 20.0 and w.longest_save == 0.0
    w = w.console(EVAL_MARK, 40.0)
    assert w.limit()[0] == 60.0
    # an evaluation followed by a save: each is timed as its own phase
    w = w.console(SAVE, 45.0)
    assert w.phase is Phase.SAVING and w.longest_eval == 20.0 and w.phase_since == 45.0


def test_a_load_that_prints_forever_is_capped():
    w = Watchdog.begin(StallPolicy(timeout=10, load_floor=20), now=0.0)
    assert w.allowance() == 20.0 and w.limit()[0] == 80.0
    w, at = chatter(w, 0.5, 1000.0)
    assert at is not None and 80.0 < at <= 81.0 and "loading for 8" in w.describe(at)
    assert "before the first step" in w.describe(at)
    # an earlier attempt measured the load (12 s): 36 s, output or not
    w = Watchdog.begin(StallPolicy(timeout=10, load_floor=20), now=0.0, earlier={"load_s": 12.0})
    w, at = chatter(w, 0.5, 1000.0)
    assert at is not None and 36.0 < at <= 37.0


def test_training_has_no_phase_limit_and_a_save_mark_while_saving_does_not_restart_the_save():
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(1, 1.0)
    assert w.limit() == (None, "") and not w.stalled(10.0)
    w = w.checkpoint_grew(5.0).console(SAVE, 6.0)  # the folder appeared before the line was read
    assert w.phase is Phase.SAVING and w.phase_since == 5.0 and w.idle(6.0) == 1.0


# ---------------------------------------------------------------- real supervisor runs, scripted trainer

SCRIPT = r"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import yaml
from tests.fake_trainer import train, write_checkpoint

cfg = yaml.safe_load(Path(sys.argv[2]).read_text())
out = Path(cfg["output_dir"])
out.mkdir(parents=True, exist_ok=True)
counter = Path(os.environ["FAKE_TRAINER_COUNTER"])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
shape = os.environ["STALL_SHAPE"]
print(f"scripted trainer attempt {{n + 1}}: {{shape}}", flush=True)


def chatter():
    while True:
        print("INFO still here", flush=True)
        time.sleep(0.5)


def log(i):
    with open(out / "trainer_log.jsonl", "a") as f:
        f.write('{{"current_steps": %d, "total_steps": 8, "loss": %f}}\n' % (i, 1.0 / i))


if n == 0 and shape == "load":
    chatter()
if n == 0:
    for i in range(1, 5):
        log(i)
        time.sleep(0.05)
    write_checkpoint(out, 4)
    log(5)
    if shape == "save":  # a save stuck on a network filesystem while a logging thread prints
        print("[INFO|trainer.py:3815] >> Saving model checkpoint to " + str(out / "checkpoint-6"), flush=True)
        (out / "checkpoint-6").mkdir()
        (out / "checkpoint-6" / "model.safetensors").write_bytes(b"x" * 1000)
        chatter()
    if shape == "eval":
        time.sleep(0.3)  # HF sets the evaluation up after step 5's record
        print("***** Running Evaluation *****", flush=True)
        chatter()
    if shape == "slow_save":  # step 6's record, then a slow save that really writes: 4 s, a chunk every 0.2 s
        log(6)
        print("[INFO|trainer.py:3815] >> Saving model checkpoint to " + str(out / "checkpoint-6"), flush=True)
        (out / "checkpoint-6").mkdir()
        with open(out / "checkpoint-6" / "optimizer.pt", "wb") as f:
            for _ in range(20):
                f.write(b"x" * 100000)
                f.flush()
                time.sleep(0.2)
        write_checkpoint(out, 6)
sys.exit(train(out, {{"train": True, "steps": 8, "save_steps": 2}}))
"""


def scripted(tmp_path: Path, shape: str, policy: StallPolicy) -> tuple[int, Path, float]:
    run_dir, env = make_run(tmp_path, [{"ok": True}])
    script = tmp_path / "scripted_trainer.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    wrapper = tmp_path / "scripted-llamafactory-cli"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    env = {**env, "FTLAUNCH_LLAMAFACTORY_CLI": str(wrapper), "STALL_SHAPE": shape}
    update_state(run_dir, stall_timeout=policy.timeout)
    t0 = time.monotonic()
    code = Supervisor(run_dir, env, poll=0.05, stop_grace=2, stall_policy=policy).run()
    return code, run_dir, time.monotonic() - t0


def stalls(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "stalled" and "stacks" in e]


@pytest.mark.parametrize(
    ("shape", "policy", "said"),
    [
        ("save", StallPolicy(timeout=1.0), r"no progress for \d+ s after step 5 \(saving; allowance 3 s"),
        ("eval", StallPolicy(timeout=1.0), r"evaluating for \d+ s after step 5, past the phase's limit of 12 s"),
        (
            "load",
            StallPolicy(timeout=1.0, load_floor=2.0),
            r"loading for \d+ s before the first step, past the phase's",
        ),
    ],
)
def test_a_hang_that_prints_is_stalled_and_resumed_with_every_step_once(tmp_path, shape, policy, said):
    code, run_dir, took = scripted(tmp_path, shape, policy)
    assert code == 0 and took < 90, took
    (stall,) = stalls(run_dir)
    assert re.search(said, " ".join(stall["message"].split())), stall["message"]  # seconds: whenever a poll saw it
    st = read_state(run_dir)
    assert st.status is RunStatus.SUCCEEDED and st.attempt == 2
    steps = [json.loads(x)["current_steps"] for x in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    if shape == "load":
        assert steps == list(range(1, 9))
    else:  # resumed from checkpoint-4
        assert steps == [1, 2, 3, 4, 5, *range(5, 9)]
    if shape == "save":  # the stuck save's partial checkpoint-6 was set aside, never resumed from
        assert len(list((tmp_path / "out").glob("incomplete-checkpoint-6-*"))) == 1


def test_a_slow_save_that_writes_is_progress_within_the_forecasts_limit(tmp_path):
    # 4 s of writing against a 3 s allowance: each chunk is progress; the forecast's 100 MB at 20 MB/s
    # gives the save 15 s in all
    code, run_dir, _ = scripted(tmp_path, "slow_save", StallPolicy(timeout=1.0, checkpoint_bytes=100_000_000))
    assert code == 0 and not stalls(run_dir)
    st = read_state(run_dir)
    assert st.status is RunStatus.SUCCEEDED and st.attempt == 1
    assert st.stall["longest_save_s"] >= 3.5 and st.stall["write_rate_bps"] > 0
