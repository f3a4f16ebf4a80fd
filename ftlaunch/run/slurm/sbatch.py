"""Slurm: submit a run as a batch job, ask Slurm about it, cancel it.

Pure parts: the job request, the batch script and the trainer wrapper (text from data), and the
parsers of sbatch/squeue/sacct output. Shell parts: `submit`, `job_state`, `cancel`, which run the
Slurm commands found on PATH (tests put stand-ins there: tests/slurm/).

How a job runs (docs/slurm.md):
- the batch script runs `python -m ftlaunch.run.slurm.job RUN_DIR` on the first node: it runs the
  supervisor as on one machine, so recovery, numeric health and checkpoint rules are unchanged;
- the supervisor's trainer is `srun-trainer.sh`: a bounded rendezvous check on every node
  (ftlaunch.run.slurm.rendezvous), then one `srun` step that starts `llamafactory-cli train` on every
  node with FORCE_TORCHRUN=1, NNODES, NODE_RANK (= SLURM_NODEID), MASTER_ADDR (the first node's
  address, chosen and resolved on that node by the batch step), MASTER_PORT and NPROC_PER_NODE
  (the plan's processes per node: one per GPU, fewer where the global batch asks; 1 on CPU nodes);
- `--signal=B:USR1@N` warns the batch step N seconds before the time limit: the trainer is stopped
  gracefully, the job requeued, and the requeued job resumes from the last complete checkpoint.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftlaunch.errors import ConfigError, FtlaunchError, TrainerError
from ftlaunch.run import secrecy
from ftlaunch.run.procs import python_module
from ftlaunch.run.store import RunFolder
from ftlaunch.run.trainer import CPU_SITE as TRAINER_CPU_SITE

# Slurm job states (squeue %T / sacct State) and what ftlaunch shows for a job whose supervisor is
# not (yet, or any more) alive.
QUEUED_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED"}
ACTIVE_STATES = QUEUED_STATES | {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}
# Filesystems that other nodes never see: the run directory must be shared with every node.
LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs", "overlay"}
# torch.load(map_location=torch.device("cpu", 0)) cannot restore "cpu:0" storages; transformers
# passes args.device (cpu:0 under gloo) when it resumes a multi-process CPU run. The local trainer's
# cpu_site (run/trainer.py) registers a deserializer for "cpu:N" (docs/slurm.md, "CPU nodes").
CPU_SITE = TRAINER_CPU_SITE
RENDEZVOUS_TIMEOUT_S = 300


@dataclass(frozen=True)
class SlurmRequest:
    """What `train --slurm` was asked for."""

    nodes: int
    gpus_per_node: int
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    sbatch_args: tuple[str, ...] = ()
    signal_lead_seconds: int = 180  # USR1 this long before the time limit: enough to stop and save
    master_port: int | None = None  # default: derived from the job id (29500-29999)
    master_addr: str | None = None  # default: the first node's NodeAddr (scontrol show node)
    rendezvous_timeout: float = RENDEZVOUS_TIMEOUT_S  # every node must reach MASTER_ADDR within this; 0: no check
    processes_per_node: int = 0  # the plan's (Plan.processes_per_node); 0: one per GPU, one on a CPU node

    @property
    def cpu(self) -> bool:
        """CPU nodes: gloo, no GPU request."""
        return self.gpus_per_node == 0

    @property
    def nproc_per_node(self) -> int:
        """The trainer processes torchrun starts on each node."""
        return self.processes_per_node or max(1, self.gpus_per_node)


@dataclass(frozen=True)
class JobFiles:
    """The files a Slurm run directory holds besides the usual ones."""

    script: str  # job.sbatch
    trainer: str  # srun-trainer.sh


def _sbatch_line(arg: str) -> str:
    if "\n" in arg:
        raise ConfigError(f"--sbatch-arg {arg!r} holds a newline", hint="give one option per --sbatch-arg")
    if secrecy.holds_secret(arg):  # quoted by name only: the value is the secret
        raise ConfigError(
            f"--sbatch-arg {arg.partition('=')[0]}=... holds a secret, which job.sbatch would keep in clear",
            hint="set it in the environment `train` runs in instead: sbatch passes that environment to the job",
        )
    return f"#SBATCH {arg}"


def render_job(
    run_dir: Path,
    run_id: str,
    name: str,
    req: SlurmRequest,
    python: str,
    trainer: Sequence[str],
    carry_env: Mapping[str, str],
) -> JobFiles:
    """The batch script and the trainer wrapper for one run (no secrets: sbatch passes the
    submitting environment to the job; only ftlaunch's own settings are written)."""
    if req.nodes < 1 or req.gpus_per_node < 0:
        raise ConfigError("--nodes must be 1 or more and the GPUs per node 0 (CPU nodes) or more")
    if req.master_addr is not None and not re.fullmatch(r"[\w.:-]+", req.master_addr):
        raise ConfigError(f"--master-addr {req.master_addr!r} is not a host name or address")
    script = _batch_script(run_dir, run_id, name, req, python, carry_env)
    return JobFiles("\n".join(script), "\n".join(_wrapper_script(req, python, trainer)))


def _batch_script(
    run_dir: Path, run_id: str, name: str, req: SlurmRequest, python: str, carry_env: Mapping[str, str]
) -> list[str]:
    """The batch script's lines: the #SBATCH header, then the batch step that runs the supervisor."""
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={q('ftlaunch-' + name)}",
        f"#SBATCH --nodes={req.nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([] if req.cpu else [f"#SBATCH --gpus-per-node={req.gpus_per_node}"]),
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{req.signal_lead_seconds}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={RunFolder(run_dir).train_log}",
    ]
    for opt, value in (("partition", req.partition), ("time", req.time), ("account", req.account)):
        if value:
            lines.append(f"#SBATCH --{opt}={value}")
    lines += [_sbatch_line(a) for a in req.sbatch_args]
    port = str(req.master_port) if req.master_port else "$((29500 + SLURM_JOB_ID % 500))"
    return [
        *lines,
        "",
        f"# Written by ftlaunch for run {run_id}. Requeued jobs run this again: the supervisor resumes",
        "# from the last complete checkpoint. The run directory must be on a filesystem every node sees.",
        "set -euo pipefail",
        *(f"export {k}={q(v)}" for k, v in sorted(secrecy.job_env(carry_env).items())),
        "# MASTER_ADDR: chosen and resolved on this (the first) node by the batch step (slurm/job.py).",
        *([f"export FTLAUNCH_MASTER_ADDR={q(req.master_addr)}"] if req.master_addr else []),
        f'export MASTER_PORT="${{MASTER_PORT:-{port}}}"',
        f"export FTLAUNCH_LLAMAFACTORY_CLI={q(str(RunFolder(run_dir).srun_trainer))}",
        "exec " + shlex.join(python_module(python, "ftlaunch.run.slurm.job", str(run_dir))),
        "",
    ]


def _wrapper_script(req: SlurmRequest, python: str, trainer: Sequence[str]) -> list[str]:
    """The trainer wrapper's lines: one srun step that starts the trainer on every node."""
    q = shlex.quote
    step = f"srun --nodes={req.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1"
    check = []
    if req.nodes > 1 and req.rendezvous_timeout > 0:
        rendezvous = python_module(python, "ftlaunch.run.slurm.rendezvous", "--timeout", f"{req.rendezvous_timeout:g}")
        check = [
            f"# Every node reaches MASTER_ADDR:MASTER_PORT within {req.rendezvous_timeout:g} s, or the attempt ends",
            "# with 'ftlaunch: rendezvous failed' (torchrun itself would retry forever).",
            f"{step} {shlex.join(rendezvous)}",
        ]
    cpu = []
    if req.cpu:
        cpu = [
            "# CPU nodes: transformers resumes a gloo run with torch.load(map_location=cpu:0), which torch",
            "# cannot restore without the deserializer that cpu_site/sitecustomize.py registers.",
            f'export PYTHONPATH={q(str(CPU_SITE))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        ]
    return [
        "#!/bin/bash",
        "# One srun step: llamafactory-cli on every node; torchrun inside it spreads over the node's GPUs.",
        "# The supervisor sets the plan's environment; the per-node figures are set here.",
        "set -euo pipefail",
        "export FORCE_TORCHRUN=1",
        f"export NNODES={req.nodes}",
        f"export NPROC_PER_NODE={req.nproc_per_node}",
        *check,
        *cpu,
        f"exec {step} \\",
        f'  bash -c \'export NODE_RANK="$SLURM_NODEID"; exec "$@"\' trainer {" ".join(q(t) for t in trainer)} "$@"',
        "",
    ]


def parse_sbatch(stdout: str) -> str:
    """`sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`."""
    text = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job = text.split(";", 1)[0].strip()
    if not re.fullmatch(r"\d+(_\d+)?", job):
        raise TrainerError(f"sbatch printed no job id: {stdout.strip()!r}")
    return job


def parse_state(stdout: str) -> str | None:
    """The first state word of squeue `-o %T` or sacct `-o State` output ("CANCELLED by 0" -> CANCELLED)."""
    for line in stdout.splitlines():
        word = line.strip().split(" ", 1)[0].strip().upper().rstrip("+")
        if word:
            return word
    return None


def status_of(slurm_state: str | None) -> str | None:
    """What a run shows while its supervisor is not alive: queued, starting, or None (ask the run)."""
    if slurm_state in QUEUED_STATES:
        return "queued"
    if slurm_state in ACTIVE_STATES:
        return "starting"
    return None


def local_filesystem(path: Path, mounts: str) -> str | None:
    """The fs type of `path` from /proc/mounts text when other nodes cannot see it, else None."""
    best: tuple[int, str] | None = None
    resolved = str(path.resolve())
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt, fstype = parts[1].replace("\\040", " "), parts[2]
        if resolved == mnt or resolved.startswith(mnt.rstrip("/") + "/"):
            if best is None or len(mnt) > best[0]:
                best = (len(mnt), fstype)
    return best[1] if best and best[1] in LOCAL_FS else None


# ---------------------------------------------------------------- shells: the Slurm commands


def _run(argv: list[str], env: Mapping[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TrainerError(
            f"`{argv[0]}` is not on PATH: this machine is not a Slurm login node",
            hint="run `ftlaunch train --slurm` where sbatch works, or drop --slurm",
        ) from None
    except subprocess.TimeoutExpired:
        raise TrainerError(f"`{' '.join(argv)}` did not answer in {timeout:.0f} s") from None


def submit(script: Path, env: Mapping[str, str]) -> str:
    """sbatch the script with ``env`` as the job's environment (sbatch's default --export=ALL), but
    the notification settings: the job's supervisor reads its destinations from secrets.json."""
    r = _run(["sbatch", "--parsable", str(script)], secrecy.supervisor_env(env))
    if r.returncode != 0:
        raise TrainerError(
            f"sbatch refused the job (sbatch exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}",
            hint="nothing was submitted; check --partition/--account/--time/--sbatch-arg",
        )
    return parse_sbatch(r.stdout)


@dataclass(frozen=True)
class JobInfo:
    """What Slurm said about a job. ``known`` False: no command answered (fail closed: it may be
    alive); known with ``state`` None: Slurm no longer knows the job (ended, forgotten)."""

    known: bool
    state: str | None = None
    restarts: int | None = None  # scontrol's Restarts (requeues so far)
    source: str | None = None  # squeue, scontrol or sacct

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def parse_fields(stdout: str) -> dict[str, str]:
    """`scontrol show job|node X -o`: one line of Key=Value pairs."""
    out: dict[str, str] = {}
    for word in stdout.split():
        key, eq, value = word.partition("=")
        if eq and key not in out:
            out[key] = value
    return out


def _gone(r: subprocess.CompletedProcess[str]) -> bool:
    return "Invalid job id" in (r.stderr + r.stdout)


def query_job(job_id: str, env: Mapping[str, str]) -> JobInfo:
    """squeue (every state it still holds), then scontrol (Restarts), then sacct (after squeue forgot
    it; fails where accounting is off, common on small clusters). Shell."""
    try:
        r = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], env, timeout=10)
        forgotten = _gone(r) or (r.returncode == 0 and parse_state(r.stdout) is None)
        state = parse_state(r.stdout) if r.returncode == 0 else None
        restarts = None
        c = _run(["scontrol", "show", "job", job_id, "-o"], env, timeout=10)
        if c.returncode == 0:
            f = parse_fields(c.stdout)
            state = state or (f.get("JobState") or None)
            restarts = int(f["Restarts"]) if f.get("Restarts", "").isdigit() else None
        if state is not None:
            return JobInfo(True, state, restarts, "squeue")
        a = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], env, timeout=10)
        if a.returncode == 0 and (acct := parse_state(a.stdout)):
            return JobInfo(True, acct, restarts, "sacct")
        return JobInfo(True, None, restarts, None) if forgotten or (c.returncode != 0 and _gone(c)) else JobInfo(False)
    except TrainerError:
        return JobInfo(False)


def job_state(job_id: str, env: Mapping[str, str]) -> str | None:
    """The job's state (squeue, scontrol, else sacct); None if unknown or forgotten."""
    return query_job(job_id, env).state


def cancel(job_id: str, env: Mapping[str, str]) -> None:
    """scancel: Slurm sends SIGTERM to the batch step (the supervisor stops the trainer), then kills."""
    r = _run(["scancel", job_id], env)
    if r.returncode != 0:
        raise FtlaunchError(f"scancel {job_id} failed ({r.returncode}): {r.stderr.strip()}")


def requeue(job_id: str, env: Mapping[str, str]) -> bool:
    return _run(["scontrol", "requeue", job_id], env).returncode == 0


# ---------------------------------------------------------------- MASTER_ADDR


def first_host(nodelist: str, env: Mapping[str, str]) -> str:
    """The first host of SLURM_JOB_NODELIST (`node[1-2]` -> node1), as Slurm expands it."""
    r = _run(["scontrol", "show", "hostnames", nodelist], env)
    hosts = r.stdout.split()
    if r.returncode != 0 or not hosts:
        raise TrainerError(f"scontrol show hostnames {nodelist} failed ({r.returncode}): {r.stderr.strip()}")
    return hosts[0]


def node_addresses(node: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """NodeAddr then NodeHostName of a node (`scontrol show node NODE -o`); empty when Slurm says nothing."""
    r = _run(["scontrol", "show", "node", node, "-o"], env)
    f = parse_fields(r.stdout) if r.returncode == 0 else {}
    return tuple(dict.fromkeys(v for v in (f.get("NodeAddr"), f.get("NodeHostName")) if v and v != "(null)"))


def resolve(name: str) -> str:
    """The first address of a host name (IPv4 first) on this machine; OSError when it does not resolve."""
    infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return str(infos[0][4][0])


@dataclass(frozen=True)
class MasterAddr:
    addr: str | None  # the address every node is given as MASTER_ADDR; None: none could be found
    how: str  # where it came from, or why none was found


def choose_master_addr(
    node: str, given: str | None, addresses: Sequence[str], resolver: Callable[[str], str] = resolve
) -> MasterAddr:
    """MASTER_ADDR for a job whose first node is ``node``: ``given`` (--master-addr), else the node's
    NodeAddr / NodeHostName from Slurm, else the node name; the first that resolves here (the first
    node), as an address, so no other node has to resolve a name. Pure but for ``resolver``."""
    tried = []
    names = [given] if given else [*addresses, node]
    for name in dict.fromkeys(names):
        try:
            addr = resolver(name)
        except OSError as exc:
            tried.append(f"{name} ({exc.strerror or exc})")
            continue
        where = "--master-addr" if given else ("NodeAddr" if name != node else "the node name")
        return MasterAddr(addr, f"{name} ({where} of {node}) resolved on {node} to {addr}")
    hint = "pass another --master-addr" if given else "pass --master-addr ADDR (an address every node reaches)"
    return MasterAddr(None, f"no address for the first node {node}: {'; '.join(tried)} did not resolve; {hint}")


def mounts_text() -> str:
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return ""


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """The Slurm variables of the current job (for events and state)."""
    keys = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT")
    return {k: env[k] for k in keys if env.get(k)}


def this_python() -> str:
    return os.path.abspath(sys.executable)
