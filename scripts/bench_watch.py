"""What `ftlaunch runs --watch` costs in CPU with many runs (issue 40: 29-33% of a core with 42 runs).

Makes one real run with the scripted trainer (tests/fake_trainer.py: a crash after a checkpoint, a
retry, then the end), copies its folder RUNS times into a temp FTLAUNCH_HOME (each copy its own id;
--running K of them made to look alive: their supervisor pid is a live `sleep`, so each refresh asks
liveness, the ETA and the stall clock as for a run going on), then runs `python -m ftlaunch runs
--watch --interval 1` on a pseudo-terminal of COLSxROWS (default 80x40) and measures its CPU time with
psutil over SECONDS (default 30) after a warm-up. Prints the share of one core.

--src DIR puts DIR first on the child's PYTHONPATH: the ftlaunch of another checkout (a `git worktree`
of an older commit) is measured the same way, for a before/after on one machine.

Run: .venv/bin/python scripts/bench_watch.py [--runs 40] [--running 0] [--seconds 30] [--src DIR]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fake_trainer import install, write_config  # noqa: E402

SCRIPT = [
    {"train": True, "steps": 24, "save_steps": 8, "crash_after_saves": 1},
    {"train": True, "steps": 24, "save_steps": 8},
]


def one_run(home: Path, work: Path) -> Path:
    """A finished run of the scripted trainer (one crash, one retry), in ``home``."""
    env = {
        **os.environ,
        "FTLAUNCH_HOME": str(home),
        "FTLAUNCH_LLAMAFACTORY_CLI": str(install(work)),
        "FAKE_TRAINER_COUNTER": str(work / "counter"),
        "FAKE_TRAINER_SCRIPT": json.dumps(SCRIPT),
        "CUDA_VISIBLE_DEVICES": "",
    }
    cfg = write_config(work)
    cmd = [sys.executable, "-m", "ftlaunch", "train", str(cfg), "--gpu", "A10G", "--foreground", "--name", "bench"]
    subprocess.run(cmd, env=env, cwd=work, check=True, capture_output=True, timeout=600)
    return next(p for p in (home / "runs").iterdir() if not p.name.startswith("."))


def copies(source: Path, runs: int, running: int, alive: psutil.Process) -> None:
    """``runs`` copies of ``source`` beside it (the source itself removed), the last ``running`` made
    to look alive under ``alive``'s pid. state.json is edited here, a bench's fixture, not ftlaunch."""
    for i in range(runs):
        run_id = f"20261201-10{i // 60:02d}{i % 60:02d}-b{i:03d}"
        dest = source.parent / run_id
        shutil.copytree(source, dest)
        state = json.loads((dest / "state.json").read_text())
        state.update(id=run_id, name=f"bench-{i}")
        if i >= runs - running:
            state.update(status="running", pid=alive.pid, pid_start=alive.create_time(), trainer_pid=None)
        (dest / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(source)


def watch_cpu(home: Path, seconds: float, cols: int, rows: int, src: str | None, warmup: float = 5.0) -> float:
    """The watch's CPU time over ``seconds`` as a share of one core (percent)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(FTLAUNCH_HOME=str(home), TERM="xterm-256color")
    if src:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH")) if x)
    cmd = [sys.executable, "-m", "ftlaunch", "runs", "--watch", "--interval", "1"]
    # cwd: the home's folder, not this checkout: `python -m` puts the cwd first on sys.path, before --src
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=home, start_new_session=True)
    os.close(slave)
    threading.Thread(target=_drain, args=(master,), daemon=True).start()
    try:
        time.sleep(warmup)  # the imports and the first screens are not what a refresh costs
        p = psutil.Process(proc.pid)
        t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
        time.sleep(seconds)
        t1, c1 = time.monotonic(), sum(p.cpu_times()[:2])
        if proc.poll() is not None:
            raise SystemExit(f"the watch ended early, exit {proc.returncode}")
        where = subprocess.run(
            [sys.executable, "-c", "import ftlaunch; print(ftlaunch.__file__)"], env=env, cwd=home, capture_output=True
        )
        print(f"measured: {where.stdout.decode().strip()}")
        return 100.0 * (c1 - c0) / (t1 - t0)
    finally:
        os.write(master, b"q")
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.close(master)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--running", type=int, default=0, help="how many of them look alive")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--cols", type=int, default=80)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--src", help="an ftlaunch checkout to measure instead of this one")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        work.mkdir()
        alive = subprocess.Popen(["sleep", str(int(args.seconds) + 120)])
        try:
            copies(one_run(home, work), args.runs, args.running, psutil.Process(alive.pid))
            pct = watch_cpu(home, args.seconds, args.cols, args.rows, args.src)
        finally:
            alive.kill()
            alive.wait()
    where = f" ({args.src})" if args.src else ""
    print(
        f"runs --watch{where}: {args.runs} runs ({args.running} live), {args.cols}x{args.rows}, "
        f"1 s refresh: {pct:.1f}% of one core over {args.seconds:g} s"
    )


if __name__ == "__main__":
    main()
