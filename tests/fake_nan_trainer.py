"""A scripted llamafactory-cli whose loss goes NaN at an exact step, for rollback tests.

Like the real trainer it resumes from the last ``checkpoint-N`` in output_dir (by name) and takes the
learning rate from that checkpoint's ``scheduler.pt`` (``base_lrs``), not from the YAML: a rollback
that only edits the config keeps the old lr here too. Checkpoints hold what ftlaunch checks
(trainer_state.json with log_history, a valid model.safetensors, optimizer.pt, scheduler.pt) and a
``marker`` file with a unique id, so a test can tell that no checkpoint was ever deleted.

  FAKE_NAN_FROM_STEP=12      the loss is NaN from this global step on ...
  FAKE_NAN_LR_ABOVE=1e-3     ... while the effective lr is above this (0: whatever the lr)
  FAKE_NAN_LOG=path          one JSON line per attempt: resume_from, lr, batch; one per checkpoint
  FAKE_STEP_SLEEP=0.05       seconds per step
Config keys read: output_dir, max_steps, save_steps, learning_rate, per_device_train_batch_size,
gradient_accumulation_steps.
"""

import json
import math
import os
import re
import struct
import sys
import time
import uuid
from pathlib import Path

import torch
import yaml


def write_checkpoint(out: Path, step: int, lr: float, history: list, log: Path) -> None:
    ck = out / f"checkpoint-{step}"
    ck.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (ck / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    torch.save({"param_groups": [{"lr": lr, "initial_lr": lr, "params": [0]}], "state": {}}, ck / "optimizer.pt")
    torch.save({"base_lrs": [lr], "_last_lr": [lr], "last_epoch": step}, ck / "scheduler.pt")
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    marker = uuid.uuid4().hex
    (ck / "marker").write_text(marker)
    with open(log, "a") as f:
        f.write(json.dumps({"checkpoint": step, "marker": marker}) + "\n")


def main() -> int:
    assert sys.argv[1] == "train"
    cfg = yaml.safe_load(Path(sys.argv[2]).read_text())
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    log = Path(os.environ["FAKE_NAN_LOG"])
    nan_from = int(os.environ.get("FAKE_NAN_FROM_STEP", "12"))
    lr_above = float(os.environ.get("FAKE_NAN_LR_ABOVE", "0"))
    sleep = float(os.environ.get("FAKE_STEP_SLEEP", "0.05"))
    total, save = int(cfg["max_steps"]), int(cfg["save_steps"])
    ckpts = sorted((int(m.group(1)), p) for p in out.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)))
    start, lr, history = 0, float(cfg["learning_rate"]), []
    if ckpts:
        start, ck = ckpts[-1]
        lr = torch.load(ck / "scheduler.pt", weights_only=False)["base_lrs"][0]
        history = json.loads((ck / "trainer_state.json").read_text())["log_history"]
        print(f"Resuming training from {ck}.", flush=True)
    batch = [cfg["per_device_train_batch_size"], cfg["gradient_accumulation_steps"]]
    with open(log, "a") as f:
        f.write(json.dumps({"resume_from": ckpts[-1][1].name if ckpts else None, "lr": lr, "batch": batch}) + "\n")
    for step in range(start + 1, total + 1):
        time.sleep(sleep)
        bad = step >= nan_from and lr > lr_above
        loss = math.nan if bad else 2.0 - step * 0.01
        rec = {"loss": loss, "grad_norm": math.nan if bad else 1.0, "learning_rate": lr, "step": step}
        history.append(rec)
        with open(out / "trainer_log.jsonl", "a") as f:  # json.dumps writes NaN as a bare token, as llamafactory
            f.write(json.dumps({"current_steps": step, "total_steps": total, "loss": loss, "lr": lr}) + "\n")
        print(
            f"{{'loss': '{loss:.4g}', 'grad_norm': '{rec['grad_norm']:.4g}', 'learning_rate': '{lr:.4g}'}}", flush=True
        )
        if step % save == 0:
            write_checkpoint(out, step, lr, list(history), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
