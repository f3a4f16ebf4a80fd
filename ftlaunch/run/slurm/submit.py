"""What the Slurm engine (run/engines/slurm.py) checks and writes: that a job's node is named
(``one_node_named``), and the job's files written into a created run and submitted
(``write_and_submit``).

The planner plans the job's nodes x processes per node itself (plan/hardware.on_nodes,
plan/planner.plan: the global batch kept over every process of every node); the plan is final. The
run is planned, checked and created by `start_run` as any run is; the output_dir lock is then let
go: the job's supervisor takes it again on the batch host when Slurm starts it. A submission sbatch
refuses leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftlaunch.errors import HardwareError
from ftlaunch.files import home
from ftlaunch.run import transitions as journal
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.store import RunFolder, keep_notify_secrets, read_state


def one_node_named(gpu: str | None) -> None:
    """A Slurm job's machine is named, never probed: `--gpu CARDxN` (the GPUs of one node) or `--gpu
    none` (CPU nodes); the planner plans ``--nodes`` of it (plan/hardware.on_nodes)."""
    if not gpu:
        raise HardwareError(
            "--slurm needs --gpu CARDxN (the GPUs of one node) or --gpu none (CPU nodes): the login node's own "
            "hardware is not the job's",
            hint="e.g. --gpu A100-80GBx8 --nodes 2, or --gpu none --nodes 2",
        )


def write_and_submit(
    run_dir: Path, p: Any, req: slurm.SlurmRequest, trainer: list[str], env: Mapping[str, str], cwd: str | Path
) -> tuple[str, list[str]]:
    """Write job.sbatch and srun-trainer.sh into the created run, record it queued, sbatch it: (job id,
    notes for the user). The engine (run/engines/slurm.py) removes the run when this raises."""
    notes = []
    for path, what in ((run_dir, "the run directory"), (Path(str(p.config.get("output_dir") or ".")), "output_dir")):
        fs = slurm.local_filesystem(path.parent if not path.exists() else path, slurm.mounts_text())
        if fs:
            notes.append(f"{what} {path} is on {fs}: other nodes cannot see it; use a shared filesystem")
    carry = {"FTLAUNCH_HOME": str(home(env).absolute())}
    files = slurm.render_job(run_dir, run_dir.name, run_dir.name, req, slurm.this_python(), trainer, carry)
    folder = RunFolder(run_dir)
    folder.job_script.write_text(files.script)
    folder.train_log.touch()  # `logs -f` works while the job is queued
    wrapper = folder.srun_trainer
    wrapper.write_text(files.trainer)
    wrapper.chmod(0o755)
    record = {
        "nodes": req.nodes,
        "gpus_per_node": req.gpus_per_node,
        "partition": req.partition,
        "time": req.time,
        "master_addr": req.master_addr,
    }
    warnings = (*(read_state(run_dir).warnings or ()), *notes)  # the disk forecast's warning kept
    journal.submitting(run_dir, record, warnings)
    keep_notify_secrets(run_dir, env)  # FTLAUNCH_NOTIFY: to secrets.json, not the job's environment
    job = slurm.submit(folder.job_script, {**env, "PWD": str(cwd)})
    journal.job_submitted(run_dir, job, nodes=req.nodes, gpus_per_node=req.gpus_per_node, notes=notes)
    return job, notes
