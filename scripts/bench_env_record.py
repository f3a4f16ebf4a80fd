"""What recording the trainer's environment costs per attempt (issue 25: under 50 ms).

Times, N times each, in this process (median and worst, ms):
  1. reading the trainer venv's distributions (METADATA headers, direct_url.json) and torch's CUDA;
  2. the NVML query (driver, CUDA, GPUs) as a run planned on GPUs asks it (on a machine without a
     driver this is the failed load);
  3. the whole attempt hook (ftlaunch.run.environment.at_attempt_start): read, compare with the
     previous attempt, write attempt-N.json atomically, append the events, update state.json;
  4. for comparison, importlib.metadata's own parser over the same folders.
Run: .venv/bin/python scripts/bench_env_record.py [N]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftlaunch.run import environment as envrec  # noqa: E402
from ftlaunch.run.state import RunState, RunStatus  # noqa: E402
from ftlaunch.run.store import write_state  # noqa: E402


def timed(fn, n: int) -> tuple[float, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), max(times)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    python = envrec.trainer_interpreter(os.environ)
    dirs, _ = envrec.site_dirs(python, os.environ)
    count = len(envrec.read_distributions(dirs)[0])
    print(f"trainer Python {python}: {count} distributions in {', '.join(map(str, dirs))}")
    rows = [
        ("read distributions + torch CUDA", lambda: envrec.read_environment(python, os.environ, gpus=False)),
        ("NVML query", envrec.nvml_system),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        write_state(run_dir, RunState(id="bench", status=RunStatus.RUNNING, gpu_count=0))
        attempt = iter(range(1, 10**6))
        rows.append(
            (
                "whole attempt hook (CPU plan)",
                lambda: envrec.at_attempt_start(run_dir, next(attempt), os.environ, resuming=True),
            )
        )

        def importlib_parser() -> None:
            from importlib.metadata import Distribution

            {d.metadata["Name"]: d.version for d in Distribution.discover(path=[str(d) for d in dirs])}

        rows.append(("importlib.metadata over the same folders", importlib_parser))
        for name, fn in rows:
            med, worst = timed(fn, n)
            print(f"{name:45s} median {med:7.2f} ms   max {worst:7.2f} ms   (n={n})")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
