"""CPU cost of the numeric-health judge, per trainer_log.jsonl record, beside what the supervisor
already spends on the same record (reading and parsing it).

Prints the CPU time per record of: parsing (progress.parse_trainer_log, done before this feature),
judging (health.observe, folded one batch of records at a time as the supervisor does), and both for
a long run's worth of records. Records are realistic: a noisy, slowly falling loss with grad_norm and
the fields llamafactory writes, with a few single spikes.
Run: .venv/bin/python scripts/bench_health.py [--records 100000] [--batch 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from ftlaunch import health
from ftlaunch import progress as prog


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

    n = len(recs)
    t_parse = min(cpu(parse) for _ in range(args.repeat))
    t_judge = min(cpu(judge) for _ in range(args.repeat))
    v = final[-1]
    print(f"{n} records, {args.batch} per poll; best of {args.repeat}; verdict at the end: {v.health.value}")
    print(f"  parse (already done by the supervisor): {1e6 * t_parse / n:7.2f} us/record  ({t_parse:.3f} s)")
    print(f"  judge (numeric health, added):          {1e6 * t_judge / n:7.2f} us/record  ({t_judge:.3f} s)")
    print(f"  judge / parse: {t_judge / t_parse:.2f}")


if __name__ == "__main__":
    main()
