"""Benchmark of the stall watchdog on the tiny model (real llamafactory-cli, CPU is fine).

For each --stall-timeout T: a detached run is frozen with SIGSTOP after step 11; prints the time from
the last step record to the `stalled` event (the watchdog's latency against T), from the freeze to it,
whether the stacks were dumped, and that the resumed run succeeded. Then one run with evaluation and
saves at the derived default timeout: no stall, and the longest step gap and allowance it saw.
Run: .venv/bin/python scripts/bench_stall.py [--timeouts 10 20 30]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_supervisor import config, write  # noqa: E402


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def last_step_time(out: Path, upto: float) -> float:
    """When the last step record before ``upto`` was written: its file's mtime at freeze time."""
    return min(upto, (out / "trainer_log.jsonl").stat().st_mtime)


def wait(pred, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v := pred():
            return v
        time.sleep(0.1)
    raise SystemExit("timed out")


def frozen_run(tiny: Path, work: Path, timeout: float, env: dict) -> dict:
    out = work / f"out-{timeout:g}"
    cfg = write(work / f"c-{timeout:g}.yaml", config(tiny, out, 30, save_steps=8))
    r = subprocess.run(
        [str(BIN / "ftlaunch"), "train", str(cfg), "--gpu", "none", "--stall-timeout", f"{timeout:g}", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    run_dir = Path(json.loads(r.stdout)["run_dir"])

    def step() -> int:
        st = json.loads((run_dir / "state.json").read_text())
        return int((st.get("progress") or {}).get("step") or 0)

    wait(lambda: step() >= 11, 300)
    trainer = json.loads((run_dir / "state.json").read_text())["trainer_pid"]
    os.kill(trainer, signal.SIGSTOP)
    frozen = time.time()
    last = last_step_time(out, frozen)
    ev = wait(lambda: [e for e in events(run_dir) if e["event"] == "stalled" and "stacks" in e], timeout * 3 + 60)[0]
    seen = datetime.fromisoformat(ev["t"]).timestamp()
    final = wait(
        lambda: (
            (s := json.loads((run_dir / "state.json").read_text()))["status"] in ("succeeded", "failed", "stalled")
            and s
        ),
        300,
    )
    dump = Path(ev["stacks"])
    return {
        "timeout_s": timeout,
        "after_last_step_s": round(seen - last, 2),
        "after_freeze_s": round(seen - frozen, 2),
        "stacks_dumped": dump.is_file() and "Thread" in dump.read_text(),
        "final": final["status"],
    }


def busy_run(tiny: Path, work: Path, env: dict) -> dict:
    out = work / "out-default"
    over = {"save_steps": 4, "val_size": 0.25, "eval_strategy": "steps", "eval_steps": 4}
    cfg = write(work / "c-default.yaml", config(tiny, out, 40, **over))
    t0 = time.monotonic()
    r = subprocess.run(
        [str(BIN / "ftlaunch"), "train", str(cfg), "--gpu", "none", "--foreground"],
        env=env,
        capture_output=True,
        text=True,
    )
    run_dir = next(
        p
        for p in (Path(env["FTLAUNCH_HOME"]) / "runs").iterdir()
        if (p / "config.yaml").read_text().find(str(out)) >= 0
    )
    st = json.loads((run_dir / "state.json").read_text())
    return {
        "exit": r.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "stalls": sum(1 for e in events(run_dir) if e["event"] == "stalled"),
        "longest_step_gap_s": st["stall"]["longest_step_gap_s"],
        "longest_save_or_eval_s": st["stall"]["longest_slow_phase_s"],
        "load_s": st["stall"]["load_s"],
        "timeout_in_force_s": st["stall"]["timeout_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeouts", type=float, nargs="+", default=[10.0, 20.0, 30.0])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = work / "tiny"
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_tiny.py"), str(tiny)], check=True, capture_output=True
        )
        env = {
            **os.environ,
            "FTLAUNCH_HOME": str(work / "home"),
            "PYTHONPATH": str(ROOT / "tests" / "inject"),
            "FTLAUNCH_TEST_STEP_SLEEP": "0.2",
        }
        for t in args.timeouts:
            print(json.dumps({"frozen": frozen_run(tiny, work, t, env)}), flush=True)
        print(json.dumps({"evaluation_and_saves": busy_run(tiny, work, env)}), flush=True)


if __name__ == "__main__":
    main()
