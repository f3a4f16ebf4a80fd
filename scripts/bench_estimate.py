"""Benchmark: how close `ftlaunch estimate --probe-steps` comes to a real run's wall time (the tiny
model, real llamafactory-cli, CPU is fine). Not a test: on shared cores the probe and the run can
meet different loads, so the error is a figure of the machine, printed with the load average.

For each repeat: the estimate with a 20-step probe, then the full run it predicts (128 steps);
prints predicted range, central figure, measured wall time, the error and the load before/after.
Run: .venv/bin/python scripts/bench_estimate.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
EPOCHS = 8  # 128 steps: training is a good part of the wall time (the same workload the e2e test used)


def config(tiny: Path, out: Path) -> dict:
    return {
        "model_name_or_path": str(tiny / "model"), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "alpaca_tiny", "dataset_dir": str(tiny / "data"), "template": "default", "cutoff_len": 48,
        "max_samples": 64, "preprocessing_num_workers": 1, "dataloader_num_workers": 0, "output_dir": str(out),
        "logging_steps": 1, "save_steps": 40, "overwrite_output_dir": False, "report_to": "none",
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "learning_rate": 1.0e-4,
        "num_train_epochs": EPOCHS, "lr_scheduler_type": "cosine", "bf16": False, "seed": 42,
    }  # fmt: skip


def one(root: Path, tiny: Path, env: dict[str, str], i: int) -> dict:
    cfg = root / f"run{i}.yaml"
    cfg.write_text(yaml.safe_dump(config(tiny, root / f"out{i}")))
    load_before = os.getloadavg()[0]
    r = subprocess.run([str(BIN / "ftlaunch"), "estimate", str(cfg), "--json", "--probe-steps", "20",
                        "--warmup-steps", "5"], env=env, capture_output=True, text=True, check=True)  # fmt: skip
    e = json.loads(r.stdout)
    t0 = time.monotonic()
    subprocess.run([str(BIN / "llamafactory-cli"), "train", str(cfg)], env=env, capture_output=True, check=True)
    wall = time.monotonic() - t0
    central = e["wall_seconds_central"]
    return {
        "predicted_range_s": [round(h * 3600, 1) for h in e["wall_hours"]],
        "predicted_central_s": round(central, 1),
        "actual_wall_s": round(wall, 1),
        "error": f"{(central - wall) / wall:+.0%}",
        "load_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-estimate-") as tmp:
        root = Path(tmp)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny.py"), str(root / "tiny")], check=True,
                       capture_output=True)  # fmt: skip
        env = dict(os.environ, FTLAUNCH_HOME=str(root / "home"), HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1", MPLCONFIGDIR=str(root / "mpl"), CUDA_VISIBLE_DEVICES="")  # fmt: skip
        for i in range(args.repeats):
            print(json.dumps(one(root, root / "tiny", env, i)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
