#!/usr/bin/env python3
"""A stand-in for `llamafactory-cli train` under torchrun across nodes: one process per node.

Every node records what the launcher gave it (NODE_RANK, NNODES, MASTER_ADDR, MASTER_PORT,
NPROC_PER_NODE, FORCE_TORCHRUN) in <output_dir>/../nodes.jsonl. Node 0 trains: resumes after the
last complete checkpoint as llamafactory does (auto-resume), logs every step to trainer_log.jsonl,
saves a complete checkpoint every save_steps (written aside, then renamed). SIGTERM ends a node at
once (exit 143), like torchrun's workers. FAKE_STEP_SECONDS sets the pace (default 0.2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import sys
import time
from pathlib import Path

import yaml


def complete(ckpt: Path) -> bool:
    return (ckpt / "trainer_state.json").is_file() and (ckpt / "model.safetensors").is_file()


def last_checkpoint(out: Path) -> int:
    steps = [int(m.group(1)) for p in out.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
    steps = [s for s in steps if complete(out / f"checkpoint-{s}")]
    return max(steps, default=0)


def save(out: Path, step: int) -> None:
    tmp = out / f".tmp-checkpoint-{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0\0\0")
    (tmp / "optimizer.pt").write_bytes(b"opt")
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    tmp.rename(out / f"checkpoint-{step}")


def main() -> int:
    if sys.argv[1] != "train":
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = yaml.safe_load(Path(sys.argv[2]).read_text())
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("NODE_RANK", "0"))
    seen = {k: os.environ.get(k) for k in ("NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")}
    seen["FORCE_TORCHRUN"] = os.environ.get("FORCE_TORCHRUN")
    seen["SLURM_RESTART_COUNT"] = os.environ.get("SLURM_RESTART_COUNT")
    with open(out.parent / "nodes.jsonl", "a") as f:
        f.write(json.dumps(seen) + "\n")
    total = int(cfg.get("max_steps") or 20)
    every = int(cfg.get("save_steps") or 5)
    pace = float(os.environ.get("FAKE_STEP_SECONDS", "0.2"))
    start = last_checkpoint(out) if not cfg.get("overwrite_output_dir") else 0
    if cfg.get("resume_from_checkpoint"):
        start = int(str(cfg["resume_from_checkpoint"]).rstrip("/").rsplit("-", 1)[-1])
    if start and rank == 0:
        print(f"Resuming training from {out / f'checkpoint-{start}'}.", flush=True)
    t0 = time.monotonic()
    for step in range(start + 1, total + 1):
        time.sleep(pace)
        if rank != 0:
            continue
        with open(out / "trainer_log.jsonl", "a") as f:
            rec = {"current_steps": step, "total_steps": total, "loss": round(2.0 / step, 4), "lr": 1e-5}
            rec["elapsed_time"] = f"0:00:{int(time.monotonic() - t0):02d}"
            f.write(json.dumps(rec) + "\n")
        if step % every == 0 or step == total:
            save(out, step)
    if rank == 0:
        print(f"node {rank}: trained to step {total}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
