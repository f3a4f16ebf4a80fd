#!/usr/bin/env python
"""Benchmark ftlaunch.hub.download against plain huggingface_hub.snapshot_download, with faults.

Both clients download the same sharded repo from the local fake hub (tests/fakehub.py: a real HTTP server
speaking the hub protocol) into fresh caches. Per scenario it prints wall time, throughput, the bytes the
server sent and how many of them were sent twice ("re-fetched"). "plain" is re-run once if it fails, as a user
would; ftlaunch retries by itself. ftlaunch's time includes its sha256 verification of every LFS file.

    .venv/bin/python scripts/bench_download.py [--shard-mb 48] [--shards 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Isolate from the real cache/token before huggingface_hub is imported (it reads these at import time).
_TMP = tempfile.mkdtemp(prefix="ftlaunch-bench-")
os.environ["HF_HOME"] = os.path.join(_TMP, "hf_home")
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
for _var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
    os.environ.pop(_var, None)

from huggingface_hub import snapshot_download  # noqa: E402

from ftlaunch.hub import download  # noqa: E402
from tests.fakehub import FakeHub  # noqa: E402

REPO = "bench/sharded"
MiB = 1024 * 1024


def make_repo(shards: int, shard_bytes: int) -> dict[str, bytes]:
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    files = {name: os.urandom(shard_bytes) for name in names}
    index = {"metadata": {"total_size": shards * shard_bytes}, "weight_map": {f"w{i}": n for i, n in enumerate(names)}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["config.json"] = b'{"model_type": "llama"}'
    files["tokenizer.json"] = b'{"model": {"type": "BPE"}}' * 1000
    return files


def scenarios(shard_bytes: int) -> dict[str, Callable[[FakeHub], None]]:
    cut = int(shard_bytes * 0.7)
    target = "*model-00001-*"
    return {
        "clean": lambda hub: None,
        "drop-FIN@70%": lambda hub: hub.drop_after(target, cut),
        "drop-RST@70%": lambda hub: hub.drop_after(target, cut, reset=True),
        "503-once": lambda hub: hub.fail_next(target, status=503, method="GET"),
    }


def run_plain(url: str, cache: Path) -> str:
    try:
        snapshot_download(REPO, endpoint=url, cache_dir=cache)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - report and re-run, as a user would
        first = f"{type(exc).__name__}"
        snapshot_download(REPO, endpoint=url, cache_dir=cache)
        return f"failed ({first}), re-run ok"


def run_ftlaunch(url: str, cache: Path) -> str:
    res = download(REPO, endpoint=url, cache_dir=cache, progress=False)
    return f"ok, retries={res.retries} resumes={res.resumes}, verified"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard-mb", type=float, default=48.0, help="size of each weight shard (MiB)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print rows as JSON lines instead of a table")
    args = ap.parse_args()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry warnings would drown the table

    shard_bytes = int(args.shard_mb * MiB)
    files = make_repo(args.shards, shard_bytes)
    total = sum(len(v) for v in files.values())
    rows = []
    with FakeHub({REPO: files}) as hub:
        for name, inject in scenarios(shard_bytes).items():
            for client, run in (("plain", run_plain), ("ftlaunch", run_ftlaunch)):
                hub.clear_faults()
                hub.reset_stats()
                inject(hub)
                cache = Path(tempfile.mkdtemp(prefix=f"{client}-", dir=_TMP))
                t0 = time.perf_counter()
                try:
                    outcome = run(hub.url, cache)
                except Exception as exc:  # noqa: BLE001
                    outcome = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                wall = time.perf_counter() - t0
                served = sum(hub.bytes_served.values())
                rows.append(
                    {
                        "scenario": name,
                        "client": client,
                        "outcome": outcome,
                        "wall_s": round(wall, 2),
                        "MiB_per_s": round(total / MiB / wall, 1),
                        "served_MiB": round(served / MiB, 2),
                        "refetched_MiB": round(max(served - total, 0) / MiB, 2),
                    }
                )

    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"repo: {args.shards} x {args.shard_mb:g} MiB shards + small files = {total / MiB:.1f} MiB, local fake hub")
    header = (
        f"{'scenario':<14} {'client':<9} {'wall s':>7} {'MiB/s':>7} {'served MiB':>11} {'re-fetched MiB':>15}  outcome"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['scenario']:<14} {r['client']:<9} {r['wall_s']:>7.2f} {r['MiB_per_s']:>7.1f} "
            f"{r['served_MiB']:>11.2f} {r['refetched_MiB']:>15.2f}  {r['outcome']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
