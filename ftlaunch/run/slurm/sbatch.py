"""Slurm: submit a run as a batch job, ask Slurm about it, cancel it.

Pure parts: the job request, the batch script and the trainer wrapper (text from data), and the
parsers of sbatch/squeue/sacct output. Shell parts: `submit`, `job_state`, `cancel`, which run the
Slurm commands found on PATH (tests put stand-ins there: tests/slurm/).

How a job runs (docs/slurm.md):
- the batch script runs `python -m ftlaunch.run.slurm.job RUN_DIR` on the first node: it runs the
  supervisor as on one machine, so recovery, numeric health and checkpoint rules are unchanged;
- the supervisor's trainer is `srun-trainer.sh`, one `srun` step that starts `llamafactory-cli train`
  on every node with FORCE_TORCHRUN=1, NNODES, NODE_RANK (= SLURM_NODEID), MASTER_ADDR (first host
  of the allocation), MASTER_PORT and NPROC_PER_NODE (GPUs per node);
- `--signal=B:USR1@N` warns the batch step N seconds before the time limit: the trainer is stopped
  gracefully, the job requeued, and the requeued job resumes from the last complete checkpoint.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftlaunch.errors import ConfigError, FtlaunchError, TrainerError

# Slurm job states (squeue %T / sacct State) and what ftlaunch shows for a job whose supervisor is
# not (yet, or any more) alive.
QUEUED_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED"}
ACTIVE_STATES = QUEUED_STATES | {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}
# Filesystems that other nodes never see: the run directory must be shared with every node.
LOCAL_FS = {"tmpfs", "ramfs", "devtmpfs", "overlay"}


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


@dataclass(frozen=True)
class JobFiles:
    """The files a Slurm run directory holds besides the usual ones."""

    script: str  # job.sbatch
    trainer: str  # srun-trainer.sh


def _sbatch_line(arg: str) -> str:
    if "\n" in arg:
        raise ConfigError(f"--sbatch-arg {arg!r} holds a newline", hint="give one option per --sbatch-arg")
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
    if req.nodes < 1 or req.gpus_per_node < 1:
        raise ConfigError("--nodes and the GPUs per node must be 1 or more")
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={q('ftlaunch-' + name)}",
        f"#SBATCH --nodes={req.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={req.gpus_per_node}",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{req.signal_lead_seconds}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={run_dir / 'train.log'}",
    ]
    for opt, value in (("partition", req.partition), ("time", req.time), ("account", req.account)):
        if value:
            lines.append(f"#SBATCH --{opt}={value}")
    lines += [_sbatch_line(a) for a in req.sbatch_args]
    port = str(req.master_port) if req.master_port else "$((29500 + SLURM_JOB_ID % 500))"
    lines += [
        "",
        f"# Written by ftlaunch for run {run_id}. Requeued jobs run this again: the supervisor resumes",
        "# from the last complete checkpoint. The run directory must be on a filesystem every node sees.",
        "set -euo pipefail",
        *(f"export {k}={q(v)}" for k, v in sorted(carry_env.items())),
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f'export MASTER_PORT="${{MASTER_PORT:-{port}}}"',
        f"export FTLAUNCH_LLAMAFACTORY_CLI={q(str(run_dir / 'srun-trainer.sh'))}",
        f"exec {q(python)} -m ftlaunch.run.slurm.job {q(str(run_dir))}",
        "",
    ]
    wrapper = [
        "#!/bin/bash",
        "# One srun step: llamafactory-cli on every node; torchrun inside it spreads over the node's GPUs.",
        "# The supervisor sets the plan's environment; the per-node figures are set here.",
        "set -euo pipefail",
        "export FORCE_TORCHRUN=1",
        f"export NNODES={req.nodes}",
        f"export NPROC_PER_NODE={req.gpus_per_node}",
        f"exec srun --nodes={req.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f'  bash -c \'export NODE_RANK="$SLURM_NODEID"; exec "$@"\' trainer {" ".join(q(t) for t in trainer)} "$@"',
        "",
    ]
    return JobFiles("\n".join(lines), "\n".join(wrapper))


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
    r = _run(["sbatch", "--parsable", str(script)], env)
    if r.returncode != 0:
        raise FtlaunchError(
            f"sbatch refused the job ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}",
            hint=f"the script is {script}; check --partition/--account/--time",
        )
    return parse_sbatch(r.stdout)


def job_state(job_id: str, env: Mapping[str, str]) -> str | None:
    """The job's state from squeue (while Slurm holds it), else sacct (after); None if unknown."""
    try:
        r = _run(["squeue", "-h", "-j", job_id, "-o", "%T"], env, timeout=10)
        state = parse_state(r.stdout) if r.returncode == 0 else None
        if state is None:
            r = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], env, timeout=10)
            state = parse_state(r.stdout) if r.returncode == 0 else None
    except TrainerError:
        return None
    return state


def cancel(job_id: str, env: Mapping[str, str]) -> None:
    """scancel: Slurm sends SIGTERM to the batch step (the supervisor stops the trainer), then kills."""
    r = _run(["scancel", job_id], env)
    if r.returncode != 0:
        raise FtlaunchError(f"scancel {job_id} failed ({r.returncode}): {r.stderr.strip()}")


def requeue(job_id: str, env: Mapping[str, str]) -> bool:
    return _run(["scontrol", "requeue", job_id], env).returncode == 0


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
