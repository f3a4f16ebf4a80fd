"""CPU cost of the numeric-health judge, per trainer_log.jsonl record, beside what the supervisor
already spends on the same record (reading and parsing it).

Prints the CPU time per record of: parsing (progress.parse_trainer_log, done before this feature),
judging (health.observe, folded one batch of records at a time as the supervisor does), and both for
a long run's worth of records. Records are realistic: a noisy, slowly falling loss with grad_norm and
the fields llamafactory writes, with a few single spikes.
With --real N it also runs the supervisor in this process on the tiny model (real llamafactory-cli,
N steps, logging_steps 1), alternately with numeric health and with a no-op stand-in for it, and
prints the supervisor's own CPU time (RUSAGE_SELF) beside the trainer's (RUSAGE_CHILDREN).
Run: .venv/bin/python scripts/bench_health.py [--records 100000] [--batch 5] [--real 60]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from ftlaunch.run import health
from ftlaunch.run import progress as prog
from ftlaunch.run.rollback import HealthWatch


def records(n: int) -> list[dict]:
    rng = random.Random(0)
    out = []
    for i in range(1, n + 1):
        loss = 2.5 * (1 - 0.5 * i / n) + rng.gauss(0, 0.05)
        if i % 5000 == 0:
            loss *= 4  # an isolated spike: spiky, not diverged
        out.append(
            {
                "current_steps": i,
                "total_steps": n,
                "loss": loss,
                "lr": 2e-5,
                "epoch": i / n,
                "percentage": round(100 * i / n, 2),
                "elapsed_time": "1:00:00",
                "remaining_time": "1:00:00",
                "throughput": 1234.5,
                "total_tokens": 1000 * i,
            }
        )
    return out


def cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=5, help="records per supervisor poll")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--real", type=int, default=0, help="also a real supervised run of N steps (tiny model)")
    args = ap.parse_args()
    recs = records(args.records)
    text = "".join(json.dumps(r) + "\n" for r in recs).encode()
    batches = [recs[i : i + args.batch] for i in range(0, len(recs), args.batch)]

    def parse() -> None:
        prog.parse_trainer_log(text)

    final: list[health.Verdict] = []

    def judge() -> None:
        v = health.Verdict()
        for b in batches:
            v = health.judge(b, start=v)
        final.append(v)

    # What the supervisor really runs: console lines (a tqdm update line and a step dict per record)
    # through the pump hook, records through HealthWatch.feed (pairing, state writes on change).
    bar = " 33%|###       | 2/6 [00:04<00:08,  2.15s/it]" * 3
    lines = [
        f"{bar} {{'loss': '{r['loss']:.4g}', 'grad_norm': '1.0', 'learning_rate': '2e-05', 'epoch': '0.1'}}\n"
        for r in recs
    ]

    def watch() -> None:
        with tempfile.TemporaryDirectory() as d:
            run_dir = Path(d)
            (run_dir / "state.json").write_text(json.dumps({"version": 1, "id": "bench"}))
            w = HealthWatch(run_dir, {}, {}, lambda s: None)
            w.start()
            for i, b in enumerate(batches):
                for line in lines[i * args.batch : (i + 1) * args.batch]:
                    w.console(bar + "\n")
                    w.console(line)
                w.feed(b)
            final.append(w.verdict)

    n = len(recs)
    t_parse = min(cpu(parse) for _ in range(args.repeat))
    t_judge = min(cpu(judge) for _ in range(args.repeat))
    t_watch = min(cpu(watch) for _ in range(args.repeat))
    v = final[-1]
    print(f"{n} records, {args.batch} per poll; best of {args.repeat}; verdict at the end: {v.health.value}")
    print(f"  parse (already done by the supervisor): {1e6 * t_parse / n:7.2f} us/record  ({t_parse:.3f} s)")
    print(f"  judge (numeric health, added):          {1e6 * t_judge / n:7.2f} us/record  ({t_judge:.3f} s)")
    print("  watch (console pairing + judge + state writes on change, 2 console lines/record):")
    print(f"                                          {1e6 * t_watch / n:7.2f} us/record  ({t_watch:.3f} s)")
    print(f"  judge / parse: {t_judge / t_parse:.2f}; watch / parse: {t_watch / t_parse:.2f}")
    if args.real:
        real(args.real)


class NoHealth:
    """The supervisor's HealthWatch calls, doing nothing: the baseline of --real."""

    halt = False

    def __init__(self, *a, **k) -> None:
        pass

    def start(self) -> None:
        pass

    def console(self, line: str) -> None:
        pass

    def feed(self, records) -> bool:
        return False

    def after(self, *a, **k) -> None:
        return None


def real(steps: int, rounds: int = 2) -> None:
    import os
    import resource
    import subprocess
    import sys

    from bench_supervisor import config as bench_config  # scripts/ is on sys.path when run as a script

    import ftlaunch.run.supervisor as sup_mod
    from ftlaunch.run.launch import create_run
    from ftlaunch.run.prepare import PlanRequest, make_plan

    root = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix="ftl-bench-health-"))
    env = {**os.environ, "FTLAUNCH_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    os.environ.update(env)
    tiny = work / "tiny"
    cmd = [sys.executable, str(root / "scripts" / "make_tiny.py"), str(tiny), "--rows", "512"]
    subprocess.run(cmd, check=True, capture_output=True)
    real_watch = sup_mod.HealthWatch
    for i in range(rounds):
        for label, cls in (("health on ", real_watch), ("health off", NoHealth)):
            sup_mod.HealthWatch = cls
            out = work / f"out-{i}-{label.strip().replace(' ', '-')}"
            cfg = bench_config(tiny, out, steps, save_steps=20)  # the supervisor bench's tiny run
            path = work / f"c-{out.name}.yaml"
            path.write_text(json.dumps(cfg))
            loaded, plan = make_plan(PlanRequest(config=str(path)), env)
            run_dir = create_run(loaded, plan, env)
            s0, k0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            sup_mod.Supervisor(run_dir, env).run()
            s1, k1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            sup = (s1.ru_utime + s1.ru_stime) - (s0.ru_utime + s0.ru_stime)
            trainer = (k1.ru_utime + k1.ru_stime) - (k0.ru_utime + k0.ru_stime)
            print(
                f"  real run {i + 1}, {label}: supervisor CPU {sup:.3f} s, trainer CPU {trainer:.1f} s, {steps} steps"
            )
    sup_mod.HealthWatch = real_watch


if __name__ == "__main__":
    main()
