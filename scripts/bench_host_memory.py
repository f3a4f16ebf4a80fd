"""Host-memory verdict against real CPU training: predicted peak RSS vs measured.

Usage: .venv/bin/python scripts/bench_host_memory.py [--work DIR] [--models tiny,medium]
                                                    [--methods full,lora] [--steps 10] [--cutoff 128] [--json]

For each model and method it writes a CPU config (fp32, cutoff 128, micro-batch 2 x accumulation 2,
``max_steps`` steps, one checkpoint at the end), asks ``ftlaunch plan --gpu none --json`` for the
predicted host peak (``memory.peak_gib``), then runs ``llamafactory-cli train`` on it (one run at a
time) while sampling the resident set size of its whole process tree every 50 ms (psutil), and prints
predicted, measured and the error. Models: ``tiny`` is scripts/make_tiny.py's (~200k parameters),
``medium`` a LlamaForCausalLM with hidden 768, 12 layers, intermediate 2048 and the tiny tokenizer
(~85M parameters, ~340 MB of fp32 weights), built here once, with no network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GIB = 2**30

MEDIUM = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12}


def make_models(work: Path, names: list[str]) -> dict[str, Path]:
    tiny = work / "tiny"
    if not (tiny / "model" / "config.json").exists():
        subprocess.run([PY, str(ROOT / "scripts" / "make_tiny.py"), str(tiny), "--rows", "256"], check=True)
    out = {"tiny": tiny / "model"}
    if "medium" in names:
        med = work / "medium"
        if not (med / "config.json").exists():
            med.mkdir(parents=True, exist_ok=True)
            code = f"""
import json, shutil, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
src = Path({str(tiny / "model")!r}); dst = Path({str(med)!r})
base = json.loads((src / "config.json").read_text())
cfg = LlamaConfig(vocab_size=base["vocab_size"], num_key_value_heads={MEDIUM["num_attention_heads"]},
                  max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=base.get("pad_token_id"),
                  bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"), **{MEDIUM!r})
torch.manual_seed(0)
m = LlamaForCausalLM(cfg)
m.save_pretrained(dst, safe_serialization=True)
for f in src.iterdir():
    if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith((".jinja",)):
        shutil.copy(f, dst / f.name)
print(sum(p.numel() for p in m.parameters()))
"""
            subprocess.run([PY, "-c", code], check=True)
        out["medium"] = med
    return out


def write_config(work: Path, model: Path, method: str, steps: int, name: str, cutoff: int = 128) -> Path:
    cfg = {
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": method,
        "dataset": "alpaca_tiny",
        "dataset_dir": str(work / "tiny" / "data"),
        "template": "default",
        "cutoff_len": cutoff,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 0,
        "output_dir": str(work / "saves" / name),
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_steps": steps,
        "report_to": "none",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1.0e-4,
        "max_steps": steps,
    }
    if method == "lora":
        cfg["lora_target"] = "all"
    path = work / f"{name}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def predicted(cfg: Path, host_ram: float) -> dict:
    r = subprocess.run(
        [PY, "-m", "ftlaunch", "plan", str(cfg), "--gpu", "none", "--host-ram", str(host_ram), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if r.returncode not in (0, 5):
        raise SystemExit(f"plan failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def measure(adapted: Path, log: Path) -> dict:
    """Run the trainer on ``adapted`` and sample its process tree's RSS; returns GiB figures."""
    import psutil

    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "DISABLE_VERSION_CHECK": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cli = str(Path(PY).with_name("llamafactory-cli"))
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen([cli, "train", str(adapted)], stdout=out, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs if p.is_running())
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"training failed ({proc.returncode}); see {log}")
    return {"peak_rss_gib": peak / GIB, "seconds": time.monotonic() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ftlaunch-bench-host")
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--methods", default="full,lora")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cutoff", type=int, default=128)
    ap.add_argument("--host-ram", type=float, default=64.0, help="host RAM the plans are made for (GiB)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = [m for m in args.models.split(",") if m]
    models = make_models(work, names)
    rows = []
    for name in names:
        for method in [m for m in args.methods.split(",") if m]:
            tag = f"{name}-{method}-{args.cutoff}"
            cfg = write_config(work, models[name], method, args.steps, tag, args.cutoff)
            plan = predicted(cfg, args.host_ram)
            mem = plan.get("memory") or {}
            adapted = work / f"{tag}.adapted.yaml"
            import yaml

            adapted.write_text(yaml.safe_dump(plan["config"], sort_keys=False))
            got = measure(adapted, work / f"{tag}.log")
            pred = mem.get("peak_gib")
            err = None if pred is None else (pred - got["peak_rss_gib"]) / got["peak_rss_gib"]
            rows.append(
                {
                    "case": tag,
                    "params": mem.get("model_params"),
                    "predicted_gib": pred,
                    "tensors_gib": mem.get("tensors_gib"),
                    "measured_gib": round(got["peak_rss_gib"], 3),
                    "error": None if err is None else round(err, 4),
                    "verdict": mem.get("verdict"),
                    "seconds": round(got["seconds"], 1),
                }
            )
            shutil.rmtree(work / "saves" / tag, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':14} {'params':>11} {'predicted':>10} {'measured':>9} {'error':>7}  verdict")
    for r in rows:
        pred = "-" if r["predicted_gib"] is None else f"{r['predicted_gib']:.3f}"
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        print(f"{r['case']:14} {r['params'] or 0:>11,} {pred:>10} {r['measured_gib']:>9.3f} {err:>7}  {r['verdict']}")


if __name__ == "__main__":
    main()
