#!/usr/bin/env python3
"""A scripted stand-in for llamafactory-cli, for failures a real run cannot produce cheaply.

FAKE_TRAINER_SCRIPT is a JSON list, one entry per attempt (the last repeats), each one of:
  {"exit": 137, "signal": 9}        die by SIGKILL with no traceback (the host OOM killer)
  {"oom": true, "rank": true}       print a torchrun-style [rank0]: CUDA OOM traceback, exit 1
  {"eval_oom": true}                OOM inside evaluation_loop, exit 1
  {"config_error": "..."}           ValueError from argument parsing, exit 1
  {"half_checkpoint": 6}            write checkpoint-6 with only a truncated model.safetensors, then die
  {"ok": true, "steps": 4}          write trainer_log.jsonl and a checkpoint, exit 0
  {"print_env": "HF_TOKEN"}         print that variable's value (secrets must be redacted in the log)
It counts attempts in FAKE_TRAINER_COUNTER and records each config it was given.
"""

import json
import os
import signal
import sys
from pathlib import Path

import yaml


def main() -> int:
    assert sys.argv[1] == "train"
    cfg = yaml.safe_load(Path(sys.argv[2]).read_text())
    counter = Path(os.environ["FAKE_TRAINER_COUNTER"])
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    with open(counter.with_suffix(".configs.jsonl"), "a") as f:
        f.write(json.dumps(cfg) + "\n")
    script = json.loads(os.environ["FAKE_TRAINER_SCRIPT"])
    step = script[min(n, len(script) - 1)]
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    print(f"fake trainer attempt {n + 1}: {step}", flush=True)
    if "print_env" in step:
        print(f"printed {os.environ.get(step['print_env'])}", flush=True)
    if "signal" in step:
        os.kill(os.getpid(), step["signal"])
    if step.get("oom"):
        prefix = "[rank0]: " if step.get("rank") else ""
        print(
            f'{prefix}Traceback (most recent call last):\n{prefix}  File "trainer.py", in training_step\n'
            f"{prefix}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.79 GiB.",
            flush=True,
        )
        if step.get("rank"):
            print("subprocess.CalledProcessError: Command '['torchrun', ...]' returned non-zero exit status 1.")
        return 1
    if step.get("eval_oom"):
        print(
            'Traceback (most recent call last):\n  File "trainer.py", in evaluation_loop\n'
            '  File "trainer.py", in prediction_step\n'
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB.",
            flush=True,
        )
        return 1
    if "config_error" in step:
        print(f"Traceback (most recent call last):\nValueError: {step['config_error']}", flush=True)
        return 1
    if "half_checkpoint" in step:
        ck = out / f"checkpoint-{step['half_checkpoint']}"
        ck.mkdir(exist_ok=True)
        (ck / "model.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":')
        os.kill(os.getpid(), signal.SIGKILL)
    if step.get("ok"):
        steps = step.get("steps", 4)
        with open(out / "trainer_log.jsonl", "a") as f:
            for i in range(1, steps + 1):
                f.write(json.dumps({"current_steps": i, "total_steps": steps, "loss": 1.0 / i}) + "\n")
        return 0
    return 3


if __name__ == "__main__":
    sys.exit(main())
