"""How long secrecy.scrub (what the support bundle and source.yaml pass through) takes on one long line
and on the same bytes in 64-column lines: it must stay linear (a stacks dump or a log can be one line of
hundreds of KiB; the comment rule was quadratic: 29 s for 256 KiB before). Prints seconds per size.
    .venv/bin/python scripts/bench_scrub.py [KIB ...]"""

from __future__ import annotations

import random
import string
import sys
import time

from ftlaunch.run.secrecy import scrub


def main(sizes: list[int]) -> None:
    rng = random.Random(0)
    for kib in sizes:
        one = "".join(rng.choice(string.ascii_letters + " =:#/?&") for _ in range(kib * 1024)).encode()
        lines = b"\n".join(one[i : i + 64] for i in range(0, len(one), 64))
        for name, data in (("one line", one), ("64-column lines", lines)):
            t = time.perf_counter()
            scrub(data, ["secretvalue1234"])
            print(f"{kib:6d} KiB {name:16s} {time.perf_counter() - t:8.3f} s")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [16, 64, 256, 1024])
