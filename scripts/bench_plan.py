"""How long `ftlaunch plan` takes, against `llamafactory-cli version`, in one run.

Runs each command N times as a fresh process (what a user waits for: interpreter start, imports, the
plan, rendering), after one warm-up run that writes the bytecode caches, and prints the median wall
time and the median CPU time (user + system of the child, from wait4) of each. The plan is a
what-if (--gpu, --model-config) of a config shipped in the repo, so it reads no hub and no GPU;
FTLAUNCH_HOME is a fresh temporary folder, so nothing learned before changes it. Issue 30 asks
for a median plan CPU time <= 0.25 s.

    .venv/bin/python scripts/bench_plan.py              # 20 runs each
    .venv/bin/python scripts/bench_plan.py -n 50 --json
    .venv/bin/python scripts/bench_plan.py --no-llamafactory   # plan only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "templates" / "cluster" / "qwen3_lora_sft.yaml"
MODEL_CONFIG = ROOT / "tests" / "data" / "corpus" / "model-configs" / "qwen3-4b" / "config.json"


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the child, exit code) of one run of ``argv``."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


def bench(argv: list[str], n: int, env: dict[str, str], cwd: Path) -> dict:
    timed(argv, env, cwd)  # warm-up, not counted: writes the bytecode caches, as a first run does
    walls, cpus = [], []
    for _ in range(n):
        wall, cpu, code = timed(argv, env, cwd)
        if code != 0:
            raise SystemExit(f"{' '.join(argv)} exited {code}; run it by hand to see why")
        walls.append(wall)
        cpus.append(cpu)
    return {
        "command": " ".join(argv),
        "runs": n,
        "median_wall_s": round(statistics.median(walls), 3),
        "median_cpu_s": round(statistics.median(cpus), 3),
        "min_wall_s": round(min(walls), 3),
        "min_cpu_s": round(min(cpus), 3),
    }


def llamafactory_cli() -> str | None:
    beside = Path(sys.executable).parent / "llamafactory-cli"
    return str(beside) if beside.exists() else shutil.which("llamafactory-cli")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--runs", type=int, default=20, help="runs of each command (default 20)")
    ap.add_argument("--config", default=str(CONFIG), help="the config to plan (default: a shipped template)")
    ap.add_argument("--gpu", default="A100-80GB", help="the card planned for (default A100-80GB)")
    ap.add_argument("--no-llamafactory", action="store_true", help="time the plan only")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        env = {**os.environ, "FTLAUNCH_HOME": tmp, "HF_HUB_OFFLINE": "1", "DISABLE_VERSION_CHECK": "1"}
        # bytecode cached as on an installed machine (a dev shell may set PYTHONDONTWRITEBYTECODE),
        # in the temporary folder, so the checkout stays as it is
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        plan = [sys.executable, "-m", "ftlaunch", "plan", args.config, "--gpu", args.gpu]
        plan += ["--model-config", str(MODEL_CONFIG)]
        rows = [("ftlaunch plan", bench(plan, args.runs, env, Path(tmp)))]
        cli = None if args.no_llamafactory else llamafactory_cli()
        if cli is not None:
            rows.append(("llamafactory-cli version", bench([cli, "version"], args.runs, env, Path(tmp))))
    if args.json:
        print(json.dumps({name: row for name, row in rows}, indent=1))
        return
    print(f"{'command':<26} {'runs':>4} {'median wall':>12} {'median CPU':>11} {'min wall':>9} {'min CPU':>8}")
    for name, r in rows:
        print(
            f"{name:<26} {r['runs']:>4} {r['median_wall_s']:>11.3f}s {r['median_cpu_s']:>10.3f}s "
            f"{r['min_wall_s']:>8.3f}s {r['min_cpu_s']:>7.3f}s"
        )
    if len(rows) == 2:
        ratio = rows[1][1]["median_wall_s"] / max(rows[0][1]["median_wall_s"], 1e-9)
        print(f"llamafactory-cli version takes {ratio:.1f}x the wall time of a whole plan")
    elif not args.no_llamafactory:
        print("llamafactory-cli not found: install the train extra to compare")


if __name__ == "__main__":
    main()
