"""What the preflight costs (issue 21): LLaMA-Factory's own parser on an adapted config, cold and cached.

Prints:
  1. ``preflight()`` cold (a fresh FTLAUNCH_HOME each time: one child in the trainer's Python that imports
     llamafactory, hence torch and transformers, and parses once) and cached (the verdict's file read);
  2. `ftlaunch plan CONFIG` against `ftlaunch plan CONFIG --check`, cold and cached, as whole processes;
  3. the batch form: N configs in one child (the examples-tree test's way), seconds per config.
Run: .venv/bin/python scripts/bench_preflight.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from ftlaunch.plan.config import dump_yaml  # noqa: E402
from ftlaunch.plan.hardware import catalog_hardware  # noqa: E402
from ftlaunch.plan.planner import PlanOptions, plan  # noqa: E402
from ftlaunch.run.preflight import card_of, check_configs, config_text, parse_env, preflight  # noqa: E402

CONFIG = {
    "model_name_or_path": "Qwen/Qwen3-4B-Instruct-2507",
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "lora_rank": 8,
    "lora_target": "all",
    "dataset": "alpaca_en_demo",
    "template": "qwen3_nothink",
    "cutoff_len": 2048,
    "output_dir": "saves/qwen3-4b/lora/sft",
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "learning_rate": 1.0e-4,
    "num_train_epochs": 3.0,
    "bf16": True,
}


def env_for(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "FTLAUNCH_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "MPLCONFIGDIR": str(home / "mpl"),
    }


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-preflight-"))
    p = plan(CONFIG, catalog_hardware("A100-80GBx4"), PlanOptions(source_gpus=8))

    print("1. preflight() in this process (A100-80GBx4 plan of a Qwen3-4B LoRA SFT)")
    cold, child, cached = [], [], []
    for i in range(args.repeat):
        env = env_for(tmp / f"home-{i}")
        t0 = time.perf_counter()
        v = preflight(p, env)
        cold.append(time.perf_counter() - t0)
        child.append(v.seconds)
        assert v.ok and not v.cached, v
        for _ in range(20):
            t = timed(lambda env=env: preflight(p, env))
            cached.append(t)
    med_child = statistics.median(child)
    print(f"   cold   : {statistics.median(cold):6.2f} s median of {len(cold)} (child {med_child:.2f} s)")
    print(f"   cached : {statistics.median(cached) * 1000:6.2f} ms median of {len(cached)}")

    print("2. `ftlaunch plan` as a process (--gpu A100-80GBx4)")
    cfg = tmp / "cfg.yaml"
    cfg.write_text(dump_yaml(CONFIG))
    exe = str(BIN / "ftlaunch")

    def run(*extra: str, home: Path) -> float:
        cmd = [exe, "plan", str(cfg), "--gpu", "A100-80GBx4", "--source-gpus", "8", *extra]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env_for(home), capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return time.perf_counter() - t0

    plain = [run(home=tmp / "plain") for _ in range(args.repeat)]
    check_cold = [run("--check", home=tmp / f"cli-{i}") for i in range(args.repeat)]
    check_cached = [run("--check", home=tmp / "cli-0") for _ in range(args.repeat)]
    print(f"   plan            : {statistics.median(plain):6.2f} s")
    print(f"   plan --check    : {statistics.median(check_cold):6.2f} s cold")
    print(f"   plan --check    : {statistics.median(check_cached):6.2f} s cached")

    print("3. the batch form: N adapted configs in one child")
    cards = ["V100-32GB", "T4", "RTX4090", "A100-80GB", "A100-80GBx4", "H100-80GBx8", "none"]
    plans = [plan(CONFIG, catalog_hardware(c), PlanOptions(source_gpus=8)) for c in cards]
    env = env_for(tmp / "batch")
    for n in (1, 70, 500):
        items = [
            {
                "id": str(k),
                "yaml": config_text(plans[k % len(plans)]),
                "env": parse_env(env, plans[k % len(plans)].env),
                "card": card_of(plans[k % len(plans)].hardware),
            }
            for k in range(n)
        ]
        out = check_configs(items, env, assume_packages=True, timeout=900)
        ok = sum(r["verdict"] == "ok" for r in out["results"])
        print(f"   {n:4d} configs: {out['seconds']:6.2f} s ({ok} accepted)")


if __name__ == "__main__":
    main()
