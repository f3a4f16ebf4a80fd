"""The stall watchdog against the real llamafactory-cli on the tiny model (issue 20): a trainer frozen
with SIGSTOP mid-run is found stalled within the timeout, its stacks are dumped by py-spy, it is
resumed from the last checkpoint and finishes; a real run with evaluation and saves is never stalled."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from ..conftest import tiny_config, write_yaml
from .test_e2e_detached import ftl, slow_env, status, wait_for

pytestmark = pytest.mark.e2e


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def steps_by_attempt(out: Path) -> list[list[int]]:
    """trainer_log.jsonl's step records, split where the step number goes back (a resumed attempt)."""
    runs: list[list[int]] = []
    for line in (out / "trainer_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" not in rec:
            continue
        step = rec["current_steps"]
        if not runs or step <= runs[-1][-1]:
            runs.append([])
        runs[-1].append(step)
    return runs


def test_a_sigstopped_trainer_is_stalled_dumped_resumed_and_finishes(tiny, tmp_path):
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=24, save_steps=8))
    r = ftl("train", str(cfg), "--gpu", "none", "--stall-timeout", "20", "--json", env=slow_env("0.3"))
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)
    run_dir = Path(run["run_dir"])
    wait_for(lambda: (status(run["id"]).get("step") or 0) >= 11, timeout=240)
    st = json.loads((run_dir / "state.json").read_text())
    os.kill(st["trainer_pid"], signal.SIGSTOP)
    frozen_at = time.time()
    stalled = wait_for(lambda: [e for e in events(run_dir) if e["event"] == "stalled" and "stacks" in e], timeout=90)
    # The event's own time: the watchdog polls every 0.5 s and writes its view every 5 s.
    from datetime import datetime

    seen = datetime.fromisoformat(stalled[0]["t"]).timestamp()
    latency = seen - frozen_at
    assert 19 <= latency <= 40, latency  # 20 s after the last step record, which came just before the freeze
    dump = Path(stalled[0]["stacks"])
    text = dump.read_text()
    assert "pid " in text and ("training_step" in text or "py-spy" in text), text[:2000]
    final = wait_for(lambda: (s := status(run["id"]))["status"] not in ("running", "recovering", "starting") and s, 300)
    assert final["status"] == "succeeded", final
    attempts = steps_by_attempt(out)
    assert len(attempts) == 2
    resumed_from = max(s for s in attempts[0] if s % 8 == 0)
    assert attempts[1][0] == resumed_from + 1  # from the last complete checkpoint
    assert sorted(set(attempts[0][:resumed_from] + attempts[1])) == list(range(1, 25))
    assert attempts[1][-1] == 24 and attempts[1].count(24) == 1
    retry = [e for e in events(run_dir) if e["event"] == "retry"]
    assert len(retry) == 1 and "[1/2] stalled" in retry[0]["message"]


def test_a_real_run_with_evaluation_and_saves_is_never_stalled(tiny, tmp_path):
    out = tmp_path / "out"
    over = {
        "max_steps": 24,
        "save_steps": 4,
        "val_size": 0.25,
        "eval_strategy": "steps",
        "eval_steps": 4,
        "per_device_eval_batch_size": 1,
    }
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, **over))
    # 10 s of no progress would stall a step (0.1 s here); the saves and evaluations get longer allowances
    r = ftl(
        "train", str(cfg), "--gpu", "none", "--stall-timeout", "10", "--foreground", env=slow_env("0.1"), timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = next((Path(os.environ.get("FTLAUNCH_HOME", "")) / "runs").iterdir())
    assert not [e for e in events(run_dir) if e["event"] == "stalled"]
    st = json.loads((run_dir / "state.json").read_text())
    assert st["status"] == "succeeded" and st["stall"]["timeout_s"] == 10.0
    assert st["stall"]["longest_step_gap_s"] < 10.0
