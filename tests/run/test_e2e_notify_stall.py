"""A stall of the real llamafactory-cli on the tiny model reaches a --notify-cmd (issue 35): the trainer
frozen with SIGSTOP mid-run is found stalled by the supervisor's watchdog, and the command gets the
`stalled` message with the run id, the step it stalled after and where py-spy put the stacks; no
secret of the run's environment in it."""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from ..conftest import tiny_config, write_yaml
from .test_e2e_detached import ftl, slow_env, status, wait_for

pytestmark = pytest.mark.e2e


def messages(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_a_sigstopped_real_trainer_notifies_stalled_with_the_run_and_the_step(tiny, tmp_path):
    out = tmp_path / "out"
    got, arrived = tmp_path / "got.jsonl", tmp_path / "arrived.txt"
    hf_token = "hf_" + secrets.token_hex(16)
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tiny, out, max_steps=40, save_steps=8))
    env = slow_env("0.3", HF_TOKEN=hf_token)
    cmd = f"cat >> {got}; echo >> {got}; date +%s.%N >> {arrived}"
    r = ftl(
        "train", str(cfg), "--gpu", "none", "--stall-timeout", "15", "--json",
        "--notify-cmd", cmd, "--notify-on", "started,stalled", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)
    run_dir = Path(run["run_dir"])
    try:
        wait_for(lambda: (status(run["id"], env).get("step") or 0) >= 6, timeout=240)
        st = json.loads((run_dir / "state.json").read_text())
        os.kill(st["trainer_pid"], signal.SIGSTOP)
        frozen_at = time.time()
        stalled = wait_for(lambda: [m for m in messages(got) if m["event"] == "stalled"], timeout=120)[0]
        told_at = float(arrived.read_text().split()[-1])
    finally:
        ftl("stop", run["id"], env=env)
    assert [m["event"] for m in messages(got)][0] == "started"
    assert stalled["run_id"] == run["id"] and stalled["name"] == "out" and stalled["machine"]
    step = stalled["step"]
    assert step >= 6 and stalled["total_steps"] == 40 and stalled["details"]["attempt"] == 1
    assert f"after step {step}" in stalled["details"]["message"], stalled["details"]
    assert Path(stalled["details"]["stacks"]).parent == run_dir / "stacks"
    assert stalled["log_tail"] and stalled["loss"] is not None and stalled["output_dir"] == str(out)
    assert f"step {step}/40" in stalled["text"] and stalled["title"] == "ftlaunch: run out stalled"
    assert hf_token not in got.read_text()
    seen = next(
        e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["event"] == "stalled"
    )
    seen_at = datetime.fromisoformat(seen["t"]).timestamp()
    print(
        f"\nreal trainer stalled: SIGSTOP -> stalled event {seen_at - frozen_at:.1f} s (timeout 15 s); "
        f"stalled event -> the command had it {(told_at - seen_at) * 1000:.0f} ms"
    )
    assert told_at - seen_at < 5
