"""Capture what the real trainer writes at absurd learning rates, for tests/data/health/.

Runs llamafactory-cli on the tiny model (scripts/make_tiny.py), fp32 on the CPU, logging every step,
and writes beside each other in OUT: <name>.jsonl (trainer_log.jsonl as written), <name>.console.txt
(HF's training-step dicts from the console, one a line) and <name>.weights.json (max |w| and
non-finite count of every checkpoint-N and of the base model, read with torch: the truth the
cheap scan of ftlaunch/run/weights_child.py is checked against).
Run: .venv/bin/python scripts/capture_health.py OUT [--only lr1e4_save8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # name: (learning_rate, save_steps, max_steps), as in issue 23
    "lr1e4_save8": (1.0e4, 8, 24),
    "lr1e8_save2": (1.0e8, 2, 8),
}


def max_abs(folder: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    out = {"max_abs": 0.0, "nonfinite": 0}
    for f in sorted(folder.glob("*.safetensors")):
        for t in load_file(str(f)).values():
            t = t.float()
            bad = ~torch.isfinite(t)
            out["nonfinite"] += int(bad.sum())
            if (~bad).any():
                out["max_abs"] = max(out["max_abs"], float(t[~bad].abs().max()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ftl-capture-health-"))
    tiny = work / "tiny"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny.py"), str(tiny)], check=True)
    sys.path.insert(0, str(ROOT / "tests"))
    import yaml
    from conftest import tiny_config  # the tests' own tiny config

    cli = Path(sys.executable).parent / "llamafactory-cli"
    for name, (lr, save, steps) in CASES.items():
        if args.only and name != args.only:
            continue
        out = work / name
        cfg = tiny_config(tiny, out, learning_rate=lr, save_steps=save, max_steps=steps, bf16=False, warmup_steps=0)
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
        r = subprocess.run([str(cli), "train", str(path)], capture_output=True, text=True, env=env)
        print(name, "exit", r.returncode)
        (args.out / f"{name}.jsonl").write_text((out / "trainer_log.jsonl").read_text())
        dicts = re.findall(r"\{'loss': [^{}]*'grad_norm': [^{}]*\}", r.stdout + r.stderr)
        (args.out / f"{name}.console.txt").write_text("".join(d + "\n" for d in dicts))
        weights = {"base": max_abs(tiny / "model")}
        for ck in sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1])):
            weights[ck.name] = max_abs(ck)
        (args.out / f"{name}.weights.json").write_text(json.dumps(weights, indent=1) + "\n")
        print(json.dumps(weights))


if __name__ == "__main__":
    main()
