#!/usr/bin/env python3
"""Stand-ins for sbatch, srun, squeue, sacct, scancel and scontrol that really run jobs locally.

Kept only for what the real two-node CPU cluster of the Slurm lane (scripts/slurm_local.sh,
tests/run/test_e2e_slurm_real.py) cannot produce cheaply: a GPU request (`--gpus-per-node=8`,
NPROC_PER_NODE=8, a 16-GPU global batch) and a job whose nodes have distinct addresses
(127.0.0.1/127.0.0.2), in the fast e2e lane on a machine without Slurm.

Installed by tests/conftest.py's `fake_slurm` fixture as one script per command name (argv[0] picks
the command). Jobs live in $FAKE_SLURM_DIR/<id>.json. `sbatch` starts a detached runner that runs
the batch script with the SLURM_* variables of an N-node allocation on 127.0.0.1..127.0.0.N,
output appended to --output; `srun` starts one copy of its command per node with SLURM_NODEID set,
so two "nodes" are two processes. FAKE_SLURM_SIGNAL_AFTER=S sends the batch step the signal of
`--signal=B:SIG@N` S seconds after the first start (a time limit reached early), or
FAKE_SLURM_SIGNAL_WHEN=PATH once PATH exists (deterministic under load); `scontrol requeue`
makes the runner run the script again once it exits, with SLURM_RESTART_COUNT + 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def jobs_dir() -> Path:
    d = Path(os.environ["FAKE_SLURM_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    return d


def load(job: str) -> dict:
    return json.loads((jobs_dir() / f"{job}.json").read_text())


def save(job: str, data: dict) -> None:
    tmp = jobs_dir() / f".{job}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(jobs_dir() / f"{job}.json")


def update(job: str, **kw) -> dict:
    data = load(job)
    data.update(kw)
    save(job, data)
    return data


def directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(.*))?$", line.strip())
        if m:
            out[m.group(1)] = (m.group(2) or "").strip()
    return out


def sbatch(args: list[str]) -> int:
    script = Path(args[-1])
    d = directives(script.read_text())
    ids = [int(p.stem) for p in jobs_dir().glob("*.json")]
    job = str(max(ids, default=1000) + 1)
    nodes = int(d.get("nodes", "1"))
    save(job, {"state": "PENDING", "script": str(script), "directives": d, "nodes": nodes, "restarts": 0})
    log = open(jobs_dir() / f"{job}.runner.log", "ab")
    subprocess.Popen(
        [sys.executable, __file__, "_runner", job], start_new_session=True, stdout=log, stderr=log, env=os.environ
    )
    print(job if "--parsable" in args else f"Submitted batch job {job}")
    return 0


def runner(job: str) -> int:
    data = load(job)
    d = data["directives"]
    nodes = data["nodes"]
    hosts = ",".join(f"127.0.0.{i + 1}" for i in range(nodes))
    time.sleep(float(os.environ.get("FAKE_SLURM_QUEUE_SECONDS", "0.5")))  # PENDING for a moment
    sig_spec = re.match(r"B:(\w+)@(\d+)", d.get("signal", ""))
    signal_after = os.environ.get("FAKE_SLURM_SIGNAL_AFTER")
    signal_when = os.environ.get("FAKE_SLURM_SIGNAL_WHEN")  # ... or once this path exists
    restarts = 0
    while True:
        data = update(job, state="RUNNING", requeue=False)
        env = dict(os.environ)
        env.update(
            SLURM_JOB_ID=job,
            SLURM_JOBID=job,
            SLURM_NNODES=str(nodes),
            SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_JOB_NODELIST=hosts,
            SLURM_RESTART_COUNT=str(restarts),
            SLURM_SUBMIT_DIR=os.getcwd(),
        )
        env.pop("FAKE_SLURM_SIGNAL_AFTER", None)
        env.pop("FAKE_SLURM_SIGNAL_WHEN", None)
        out = d.get("output") or str(jobs_dir() / f"slurm-{job}.out")
        mode = "ab" if d.get("open-mode") == "append" else "wb"
        with open(out, mode) as f:
            proc = subprocess.Popen(["bash", data["script"]], env=env, stdout=f, stderr=f, start_new_session=True)
        update(job, batch_pid=proc.pid)
        start = time.monotonic()
        signalled = False
        while proc.poll() is None:
            if sig_spec and (signal_after or signal_when) and restarts == 0 and not signalled:
                due = signal_when and Path(signal_when).exists()
                if due or (signal_after and time.monotonic() - start >= float(signal_after)):
                    os.kill(proc.pid, getattr(signal, "SIG" + sig_spec.group(1)))  # B: the batch shell only
                    signalled = True
            if load(job).get("cancel"):
                os.kill(proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + 30
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        code = proc.wait()
        data = load(job)
        if data.get("cancel"):
            update(job, state="CANCELLED", exit_code=code)
            return 0
        if data.get("requeue") and "requeue" in d:
            restarts += 1
            update(job, state="PENDING", restarts=restarts)
            time.sleep(0.5)
            continue
        update(job, state="COMPLETED" if code == 0 else "FAILED", exit_code=code)
        return 0


def srun(args: list[str]) -> int:
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    i = 0
    while i < len(args) and args[i].startswith("-"):
        m = re.match(r"--nodes=(\d+)", args[i])
        if m:
            nodes = int(m.group(1))
        i += 1
    cmd = args[i:]
    procs = []
    for node in range(nodes):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_STEP_ID="0")
        env["SLURMD_NODENAME"] = f"127.0.0.{node + 1}"
        procs.append(subprocess.Popen(cmd, env=env))

    def forward(sig: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    while any(p.poll() is None for p in procs):
        time.sleep(0.05)
    bad = [c for c in codes if c != 0]
    return (bad[0] if bad[0] > 0 else 128 - bad[0]) if bad else 0


def squeue(args: list[str]) -> int:
    job = args[args.index("-j") + 1]
    try:
        state = load(job)["state"]
    except FileNotFoundError:
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        return 1
    if state in ("PENDING", "RUNNING") or "all" in args:
        print(state)
    return 0


def sacct(args: list[str]) -> int:
    job = args[args.index("-j") + 1]
    try:
        print(load(job)["state"])
    except FileNotFoundError:
        pass
    return 0


def scancel(args: list[str]) -> int:
    job = args[-1]
    data = update(job, cancel=True)
    if data["state"] == "PENDING":
        update(job, state="CANCELLED")
    return 0


def scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        try:
            print("\n".join(args[2].split(",")), flush=True)
        except BrokenPipeError:  # `| head -n 1` stops reading: fine, as for the real one
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args[:2] == ["show", "node"]:  # the fake's node names are their addresses
        print(f"NodeName={args[2]} NodeAddr={args[2]} NodeHostName={args[2]} State=ALLOCATED")
        return 0
    if args[:2] == ["show", "job"]:
        try:
            data = load(args[2])
        except FileNotFoundError:
            print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
            return 1
        print(f"JobId={args[2]} JobState={data['state']} Restarts={data.get('restarts', 0)}")
        return 0
    if args[0] == "requeue":
        update(args[1], requeue=True)
        return 0
    print(f"fake scontrol: unsupported {args}", file=sys.stderr)
    return 1


COMMANDS = {"sbatch": sbatch, "srun": srun, "squeue": squeue, "sacct": sacct, "scancel": scancel, "scontrol": scontrol}

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_runner":
        sys.exit(runner(sys.argv[2]))
    name = os.environ.get("FAKE_SLURM_COMMAND") or Path(sys.argv[0]).name
    sys.exit(COMMANDS[name](sys.argv[1:]))
