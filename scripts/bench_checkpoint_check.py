"""How long the checkpoint content check takes (issue 40): a 1 GiB optimizer.pt checked by its zip
structure (ftlaunch.run.progress.torch_file_problem), against reading every byte to check the CRCs.

Writes a zip laid out as torch.save lays one out (stored entries, one per tensor storage; no torch
needed) of SIZE_MIB (default 1024) in ENTRIES (default 600, an AdamW state of 300 parameters), then
prints milliseconds for: the structural check (median of 20, the file in the page cache), the same
on a copy cut to half (what a killed save leaves), the whole checkpoint_problems of a checkpoint
holding it, and one CRC pass over every entry (zipfile.testzip), the check not taken.
Run: .venv/bin/python scripts/bench_checkpoint_check.py [SIZE_MIB] [ENTRIES]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftlaunch.run.progress import checkpoint_problems, torch_file_problem  # noqa: E402

MIB = 2**20


def write_torch_like_zip(path: Path, size_mib: int, entries: int) -> None:
    """A stored (uncompressed) zip: data.pkl, then data/0..N-1 splitting size_mib between them."""
    chunk = os.urandom(MIB)
    per = size_mib * MIB // entries
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        for i in range(entries):
            with z.open(f"archive/data/{i}", "w", force_zip64=True) as f:
                left = per
                while left:
                    n = min(left, MIB)
                    f.write(chunk[:n])
                    left -= n
        z.writestr("archive/version", b"3\n")


def median_ms(fn, runs: int = 20) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    size_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    entries = int(sys.argv[2]) if len(sys.argv) > 2 else 600
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        ckpt = Path(tmp) / "checkpoint-8"
        ckpt.mkdir()
        opt = ckpt / "optimizer.pt"
        t0 = time.perf_counter()
        write_torch_like_zip(opt, size_mib, entries)
        wrote = time.perf_counter() - t0
        (ckpt / "trainer_state.json").write_text("{}")
        header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
        assert torch_file_problem(opt) is None
        whole = median_ms(lambda: torch_file_problem(opt))
        problems = median_ms(lambda: checkpoint_problems(ckpt))
        t0 = time.perf_counter()
        with zipfile.ZipFile(opt) as z:
            assert z.testzip() is None
        crc = (time.perf_counter() - t0) * 1000
        half = Path(tmp) / "half.pt"
        with open(opt, "rb") as src, open(half, "wb") as dst:
            dst.write(src.read(opt.stat().st_size // 2))
        assert torch_file_problem(half) is not None
        torn = median_ms(lambda: torch_file_problem(half))
    figures = {
        "size_mib": size_mib,
        "entries": entries + 2,
        "write_s": round(wrote, 2),
        "structure_check_ms": round(whole, 3),
        "torn_half_check_ms": round(torn, 3),
        "checkpoint_problems_ms": round(problems, 3),
        "crc_pass_ms": round(crc, 1),
    }
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
