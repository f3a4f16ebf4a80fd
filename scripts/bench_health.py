"""CPU cost of the numeric-health judge, per trainer_log.jsonl record, beside what the supervisor
already spends on the same record (reading and parsing it).

Prints the CPU time per record of: parsing (progress.parse_trainer_log, done before this feature),
judging (health.observe, folded one batch of records at a time as the supervisor does), and both for
a long run's worth of records. Records are realistic: a noisy, slowly falling loss with grad_norm and
the fields llamafactory writes, with a few single spikes.
The watch line includes keeping the run's own copy of the records (ftlaunch.run.records.keep, one
append per poll), as the supervisor does since issue 23.
With --real N it also runs the supervisor in this process on the tiny model (real llamafactory-cli,
N steps, logging_steps 1), alternately with numeric health and with a no-op stand-in for it, and
prints the supervisor's own CPU time (RUSAGE_SELF) beside the trainer's (RUSAGE_CHILDREN).
With --rollback it times HealthWatch.after on real checkpoints of the tiny model (a divergence at the
last step: the weight scan of every candidate and the base model, set-aside renames, the lr rewrite
in a child of the trainer's Python), and the weight scan alone on a synthetic 1 GiB model.
Run: .venv/bin/python scripts/bench_health.py [--records 100000] [--batch 5] [--real 60] [--rollback]
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
from ftlaunch.run import records as run_records
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
    ap.add_argument("--rollback", action="store_true", help="also time rollbacks on real checkpoints")
    args = ap.parse_args()
    recs = records(args.records)
    text = "".join(json.dumps(r) + "\n" for r in recs).encode()
    batches = [recs[i : i + args.batch] for i in range(0, len(recs), args.batch)]
    raw = ["".join(json.dumps(r) + "\n" for r in b).encode() for b in batches]

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
                run_records.keep(run_dir, raw[i])
                w.feed(b)
            final.append(w.verdict)

    def keep() -> None:
        with tempfile.TemporaryDirectory() as d:
            for chunk in raw:
                run_records.keep(Path(d), chunk)

    n = len(recs)
    t_keep = min(cpu(keep) for _ in range(args.repeat))
    t_parse = min(cpu(parse) for _ in range(args.repeat))
    t_judge = min(cpu(judge) for _ in range(args.repeat))
    t_watch = min(cpu(watch) for _ in range(args.repeat))
    v = final[-1]
    print(f"{n} records, {args.batch} per poll; best of {args.repeat}; verdict at the end: {v.health.value}")
    print(f"  parse (already done by the supervisor): {1e6 * t_parse / n:7.2f} us/record  ({t_parse:.3f} s)")
    print(f"  judge (numeric health, added):          {1e6 * t_judge / n:7.2f} us/record  ({t_judge:.3f} s)")
    print("  watch (console pairing + judge + state writes on change, 2 console lines/record):")
    print(f"                                          {1e6 * t_watch / n:7.2f} us/record  ({t_watch:.3f} s)")
    print(f"  of which keeping the run's copy (one append per poll): {1e6 * t_keep / n:7.2f} us/record")
    print(f"  judge / parse: {t_judge / t_parse:.2f}; watch / parse: {t_watch / t_parse:.2f}")
    if args.real:
        real(args.real)
    if args.rollback:
        rollback_cost()


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


def rollback_cost(rounds: int = 3) -> None:
    """Wall time of HealthWatch.after on the tiny model's real checkpoints, and of the scan alone."""
    import os
    import shutil
    import subprocess
    import sys

    import yaml

    from ftlaunch.run.rollback import WEIGHTS_CHILD, python_of, scan_weights
    from ftlaunch.run.trainer import find_trainer

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    from conftest import tiny_config

    work = Path(tempfile.mkdtemp(prefix="ftl-bench-rollback-"))
    tiny = work / "tiny"
    subprocess.run([sys.executable, str(root / "scripts" / "make_tiny.py"), str(tiny)], check=True, capture_output=True)
    made = work / "made"
    cfg = tiny_config(tiny, made, learning_rate=1e-4, max_steps=6, save_steps=2, bf16=False)
    (work / "c.yaml").write_text(yaml.safe_dump(cfg))
    cli = Path(sys.executable).parent / "llamafactory-cli"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([str(cli), "train", str(work / "c.yaml")], check=True, capture_output=True, env=env)
    python = python_of(str(find_trainer(env)[0]))
    print(f"rollback on the tiny model's real checkpoints (2, 4, 6; ~0.6 MB weights each), trainer Python {python}:")
    for i in range(rounds):
        out = work / f"out-{i}"
        shutil.copytree(made, out)
        run_dir = work / f"run-{i}"
        run_dir.mkdir()
        (run_dir / "state.json").write_text(json.dumps({"version": 1, "id": f"bench-{i}", "on_diverge": "rollback"}))
        values = {**cfg, "output_dir": str(out)}
        w = HealthWatch(run_dir, values, env, lambda s: None)
        w.start()
        good = [r for r in prog.parse_trainer_log((made / "trainer_log.jsonl").read_bytes()) if "loss" in r]
        w.feed(good[:5] + [{"current_steps": 6, "loss": float("nan")}])
        t0 = time.perf_counter()
        d = w.after(out, values, weights_only=False)
        total = time.perf_counter() - t0
        ev = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        scan = next(e["weight_scan_s"] for e in ev if e["event"] == "rolled_back")
        print(f"  round {i + 1}: {total:.2f} s in all (weight scan {scan:.2f} s), -> {d.resume_from}")
    # the scan samples: its cost does not grow with the model. A 1 GiB safetensors, 256 tensors.
    import numpy as np
    from safetensors.numpy import save_file

    big = work / "big"
    big.mkdir()
    save_file(
        {f"layer.{i}.weight": np.ones(1 << 20, dtype=np.float32) for i in range(256)}, str(big / "model.safetensors")
    )
    for _ in range(rounds):
        subprocess.run(["sync"], check=False)
        t0 = time.perf_counter()
        got = scan_weights(python, [("big", str(big)), ("base", str(big))])
        dt = time.perf_counter() - t0
        print(f"  scan of two 1 GiB folders (256 tensors, {got['big']['elements']} values sampled each): {dt:.2f} s")
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "import torch"], check=True)
    took = time.perf_counter() - t0
    print(f"  for scale: the trainer's Python importing torch (the lr rewrite's child does): {took:.2f} s")
    print(f"  ({WEIGHTS_CHILD.name} imports numpy only)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
