"""Disk forecast against reality (issue 20): the tiny model trained for real, and the formula for a
1.5B full SFT.

Prints:
  1. per variant of the tiny model (full, save_only_model, LoRA): the predicted size of one checkpoint
     (RunState.disk, made by `ftlaunch train` at start) against the real checkpoint-N (apparent bytes,
     what `du -sb` counts), and the number of saves predicted against the folders found;
  2. the formula's figures for a Qwen2.5-1.5B full SFT in bf16 (tests/data/corpus), with and without
     save_only_model: one checkpoint, the final model, and a 3000-step run saving every 500 steps with
     and without save_total_limit 2.
Run: .venv/bin/python scripts/bench_disk.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from ftlaunch.files import tree_bytes  # noqa: E402
from ftlaunch.plan.disk import GIB, RunLength, SaveSettings, forecast  # noqa: E402
from ftlaunch.plan.memory.setup import setup_from_config  # noqa: E402
from ftlaunch.plan.modelspec import spec_from_config  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from bench_supervisor import config  # noqa: E402

QWEN15 = ROOT / "tests" / "data" / "corpus" / "model-configs" / "qwen2.5-1.5b" / "config.json"


def tiny_config(tiny: Path, out: Path, **over) -> dict:
    """The benchmarks' tiny config (bench_supervisor.config): 16 steps of micro-batch 2 x 2, a save every 4."""
    base = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "save_steps": 4, "max_samples": 64}
    return config(tiny, out, 16, **{**base, **over})


def tiny_rows(work: Path) -> None:
    tiny = work / "tiny"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny.py"), str(tiny)], check=True, capture_output=True)
    env = {
        **os.environ,
        "FTLAUNCH_HOME": str(work / "home"),
        "HF_HOME": str(work / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "MPLCONFIGDIR": str(work / "mpl"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    variants = {
        "full": {},
        "full, save_only_model": {"save_only_model": True},
        "lora r8 all": {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all"},
    }
    print("tiny model (145,984 params, fp32 on the CPU), 16 steps, save_steps 4")
    print(f"{'variant':24} {'predicted':>11} {'real (max)':>11} {'error':>7} {'saves':>9}")
    for name, over in variants.items():
        out = work / name.replace(" ", "_").replace(",", "")
        cfg = work / f"{out.name}.yaml"
        cfg.write_text(yaml.safe_dump(tiny_config(tiny, out, **over)))
        r = subprocess.run(
            [str(BIN / "ftlaunch"), "train", str(cfg), "--foreground", "--json", "--name", out.name],
            env=env,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise SystemExit(f"{name}: train failed\n{r.stderr[-2000:]}")
        run_dir = Path(json.loads(r.stdout)["run_dir"])
        fc = json.loads((run_dir / "state.json").read_text())["disk"]
        sizes = [tree_bytes(p) for p in out.glob("checkpoint-*")]
        real = max(sizes)
        err = (fc["checkpoint_bytes"] - real) / real
        saves = f"{fc['saves']} / {len(sizes)}"
        print(f"{name:24} {fc['checkpoint_bytes']:>11,} {real:>11,} {err:>+7.2%} {saves:>9}")


def qwen_rows() -> None:
    spec = spec_from_config(json.loads(QWEN15.read_text()))
    print(f"\nQwen2.5-1.5B ({spec.params:,} params) full SFT, bf16, AdamW; 3000 steps, save_steps 500 (6 saves)")
    print(f"{'config':30} {'checkpoint':>11} {'final':>9} {'run':>10} {'run, limit 2':>13}")
    rows = {
        "bf16": {},
        "bf16, save_only_model": {"save_only_model": True},
        "pure_bf16": {"pure_bf16": True},
        "bf16, DeepSpeed ZeRO-2": {"deepspeed": "ds_z2_config.json"},
        "LoRA r8 all, bf16": {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all"},
    }
    for name, over in rows.items():
        cfg = {"finetuning_type": "full", "bf16": True, "save_steps": 500, "logging_steps": 10, **over}
        setup = setup_from_config(cfg, default_optim="adamw_torch_fused")
        length = RunLength(3000, None, "3000 steps")
        fc = forecast(spec, setup, SaveSettings.from_config(cfg), length)
        limited = forecast(spec, setup, SaveSettings.from_config({**cfg, "save_total_limit": 2}), length)
        print(
            f"{name:30} {fc.checkpoint_bytes / GIB:>7.2f} GiB {fc.final_bytes / GIB:>5.2f} GiB "
            f"{fc.total_bytes / GIB:>6.1f} GiB {limited.total_bytes / GIB:>9.1f} GiB"
        )


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-disk-") as tmp:
        tiny_rows(Path(tmp))
    qwen_rows()


if __name__ == "__main__":
    main()
