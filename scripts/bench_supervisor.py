"""Benchmarks for the supervisor and recovery, on the tiny model (real llamafactory-cli, CPU is fine).

Prints:
  1. the supervisor's own CPU time as a share of the trainer's over a run;
  2. the extra wall time `ftlaunch train --foreground` adds over `llamafactory-cli train`;
  3. per recovery: time from the trainer's exit to the next attempt's start, and steps redone.
Run: .venv/bin/python scripts/bench_supervisor.py [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def config(tiny: Path, out: Path, steps: int, **over) -> dict:
    cfg = {
        "model_name_or_path": str(tiny / "model"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "alpaca_tiny",
        "dataset_dir": str(tiny / "data"),
        "template": "default",
        "cutoff_len": 128,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0,
        "output_dir": str(out),
        "logging_steps": 1,
        "save_steps": 10,
        "report_to": "none",
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-4,
        "max_steps": steps,
        "seed": 42,
    }
    cfg.update(over)
    return cfg


def write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ftl-bench-"))
    env = {
        **os.environ,
        "FTLAUNCH_HOME": str(work / "home"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }
    tiny = work / "tiny"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny.py"), str(tiny), "--rows", "512"],
        check=True,
        capture_output=True,
    )

    # 1. supervisor CPU share: run the supervisor in this process, the trainer is its child.
    from ftlaunch.run.launch import create_run
    from ftlaunch.run.prepare import PlanRequest, make_plan
    from ftlaunch.run.supervisor import Supervisor

    os.environ.update(env)
    cfg = write(work / "a.yaml", config(tiny, work / "out-a", args.steps))
    loaded, plan = make_plan(PlanRequest(config=str(cfg)), env)
    run_dir = create_run(loaded, plan, env)
    self0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    Supervisor(run_dir, env).run()
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    sup = (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)
    trainer = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    print(
        f"supervisor CPU {sup:.2f} s vs trainer CPU {trainer:.2f} s over {args.steps} steps: "
        f"{100 * sup / trainer:.1f}% (poll interval 0.5 s)"
    )

    # 2. wall-time overhead of `ftlaunch train --foreground` over plain llamafactory-cli
    plain, ours = [], []
    for i in range(2):
        c1 = write(work / f"p{i}.yaml", config(tiny, work / f"out-p{i}", args.steps, overwrite_output_dir=True))
        plain.append(timed([str(BIN / "llamafactory-cli"), "train", str(c1)], env))
        c2 = write(work / f"f{i}.yaml", config(tiny, work / f"out-f{i}", args.steps))
        ours.append(timed([str(BIN / "ftlaunch"), "train", str(c2), "--foreground", "--json"], env))
    print(
        f"wall: llamafactory-cli train {min(plain):.2f} s, ftlaunch train --foreground {min(ours):.2f} s "
        f"(best of 2): +{min(ours) - min(plain):.2f} s"
    )

    # 3. recovery: OOM injected above micro-batch 1 from step 25 (after checkpoint-20)
    renv = {
        **env,
        "PYTHONPATH": str(ROOT / "tests" / "inject"),
        "FTLAUNCH_TEST_OOM_ABOVE": "1",
        "FTLAUNCH_TEST_OOM_FROM_STEP": "25",
    }
    c3 = write(work / "r.yaml", config(tiny, work / "out-r", args.steps))
    r = subprocess.run(
        [str(BIN / "ftlaunch"), "train", str(c3), "--foreground", "--json"], env=renv, capture_output=True, text=True
    )
    rd = Path(json.loads(r.stdout)["run_dir"])
    events = [json.loads(x) for x in (rd / "events.jsonl").read_text().splitlines()]
    ts = lambda e: datetime.fromisoformat(e["t"]).timestamp()  # noqa: E731
    exits = [e for e in events if e["event"] == "exited"]
    starts = [e for e in events if e["event"] == "attempt_started"]
    steps = [
        json.loads(x)["current_steps"]
        for x in (work / "out-r" / "trainer_log.jsonl").read_text().splitlines()
        if '"loss"' in x
    ]
    redone = len(steps) - len(set(steps))
    for ex, nxt in zip(exits, starts[1:], strict=False):
        print(
            f"recovery after attempt {ex['attempt']} ({ex['kind']} at step {ex.get('step')}): next attempt "
            f"started {ts(nxt) - ts(ex):.3f} s after the trainer exited, resuming {nxt.get('resume_from')}"
        )
    print(
        f"steps redone in total: {redone} over {len(exits) - 1} recoveries (at most those since the last "
        f"checkpoint: save_steps=10); final status {json.loads((rd / 'state.json').read_text())['status']}"
    )


if __name__ == "__main__":
    main()
