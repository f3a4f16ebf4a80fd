"""`train --slurm`: plan for nodes x GPUs, write the run directory with its job script, submit it.

The global batch is kept across all the GPUs of all the nodes (the plan's world size is
nodes x GPUs per node). The output_dir is claimed as for any `train`, then released: the job's
supervisor takes the lock again on the batch host when Slurm starts it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import HardwareError
from ftlaunch.files import home
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.run.options import RunOptions
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.state import FailureKind, RunStatus
from ftlaunch.run.store import append_event, update_state
from ftlaunch.run.trainer import find_trainer


def cluster_gpu_spec(gpu: str | None, nodes: int) -> tuple[str, int]:
    """`--gpu A100-80GBx8 --nodes 2` -> ("A100-80GBx16", 8): the plan's machine and GPUs per node."""
    if not gpu:
        raise HardwareError(
            "--slurm needs --gpu CARDxN: the GPUs of one node (the login node's own GPUs are not the job's)",
            hint="e.g. --gpu A100-80GBx8 --nodes 2",
        )
    hw = catalog_hardware(gpu)
    if not hw.gpus:
        raise HardwareError("--slurm needs GPUs: --gpu none plans for the CPU", hint="e.g. --gpu A100-80GBx8")
    card = hw.source.removeprefix("catalog:").rsplit("x", 1)[0]
    return f"{card}x{hw.gpu_count * nodes}", hw.gpu_count


def submit_run(
    config: str,
    overrides: tuple[str, ...],
    opts: RunOptions,
    req: slurm.SlurmRequest,
    env: Mapping[str, str],
    *,
    existing: str = "refuse",
) -> tuple[Path, str, Any]:
    """Plan, create the run (status queued), write job.sbatch and srun-trainer.sh, sbatch it.

    Returns (run_dir, job id, plan). A refused submission leaves the run marked failed, saying why."""
    from ftlaunch.run.launch import new_run
    from ftlaunch.run.outdir import Existing
    from ftlaunch.run.prepare import make_plan

    spec, per_node = cluster_gpu_spec(opts.gpu, req.nodes)
    req = replace(req, gpus_per_node=per_node)
    loaded, p = make_plan(replace(opts, gpu=spec).plan_request(config, overrides, strict=True), env)
    trainer = find_trainer(env)
    run_dir, lock = new_run(loaded, p, env, existing=Existing(existing), **opts.supervisor_settings())
    lock.close()  # the job's supervisor takes it on the batch host
    notes = []
    for path, what in ((run_dir, "the run directory"), (Path(str(p.config.get("output_dir") or ".")), "output_dir")):
        fs = slurm.local_filesystem(path.parent if not path.exists() else path, slurm.mounts_text())
        if fs:
            notes.append(f"{what} {path} is on {fs}: other nodes cannot see it; use a shared filesystem")
    carry = {"FTLAUNCH_HOME": str(home(env).absolute())}
    files = slurm.render_job(run_dir, run_dir.name, run_dir.name, req, slurm.this_python(), trainer, carry)
    (run_dir / "job.sbatch").write_text(files.script)
    (run_dir / "train.log").touch()  # `logs -f` works while the job is queued
    wrapper = run_dir / "srun-trainer.sh"
    wrapper.write_text(files.trainer)
    wrapper.chmod(0o755)
    record = {"nodes": req.nodes, "gpus_per_node": per_node, "partition": req.partition, "time": req.time}
    update_state(run_dir, status=RunStatus.QUEUED, slurm=record, warnings=tuple(notes))
    try:
        job = slurm.submit(run_dir / "job.sbatch", {**env, "PWD": os.getcwd()})
    except Exception as exc:
        update_state(run_dir, status=RunStatus.FAILED, failure_kind=FailureKind.SETUP, message=f"not submitted: {exc}")
        raise
    update_state(run_dir, slurm_job_id=job)
    append_event(run_dir, "submitted", job_id=job, nodes=req.nodes, gpus_per_node=per_node, notes=notes)
    for n in notes:  # a local filesystem works when every "node" is this machine: say so, do not refuse
        print(f"warning: {n}", file=sys.stderr)
    return run_dir, job, p
