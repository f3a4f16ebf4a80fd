"""What the Slurm engine (run/engines/slurm.py) plans and writes: the machine of all the nodes
(``cluster_gpu_spec``), a CPU plan spread over CPU nodes (``cpu_nodes_plan``), and the job's files
written into a created run and submitted (``write_and_submit``).

The global batch is kept across all the processes of all the nodes (the plan's world size is
nodes x GPUs per node; on CPU nodes, one process per node). The run is planned, checked and created
by `start_run` as any run is; the output_dir lock is then let go: the job's supervisor takes it again
on the batch host when Slurm starts it. A submission sbatch refuses leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftlaunch.errors import HardwareError
from ftlaunch.files import home
from ftlaunch.plan.batch import split_batch
from ftlaunch.plan.change import Change
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.run import transitions as journal
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.store import RunFolder, read_state


def cluster_gpu_spec(gpu: str | None, nodes: int) -> tuple[str, int]:
    """`--gpu A100-80GBx8 --nodes 2` -> ("A100-80GBx16", 8): the plan's machine and GPUs per node;
    `--gpu none` -> ("none", 0): CPU nodes."""
    if not gpu:
        raise HardwareError(
            "--slurm needs --gpu CARDxN (the GPUs of one node) or --gpu none (CPU nodes): the login node's own "
            "hardware is not the job's",
            hint="e.g. --gpu A100-80GBx8 --nodes 2, or --gpu none --nodes 2",
        )
    hw = catalog_hardware(gpu)
    if not hw.gpus:
        return "none", 0
    card = hw.source.removeprefix("catalog:").rsplit("x", 1)[0]
    return f"{card}x{hw.gpu_count * nodes}", hw.gpu_count


def cpu_nodes_plan(p: Any, nodes: int) -> Any:
    """A CPU plan (one process, fp32) spread over ``nodes`` CPU nodes, one process each: the global
    batch kept over the ``nodes`` processes (micro-batch x accumulation x nodes), `ddp_backend: gloo`
    (NCCL needs GPUs). Pure: returns a new Plan with the changes shown and explained."""
    if nodes <= 1:
        return p
    g = p.global_batch_target
    per_process = max(1, round(g / nodes))
    micro, accum = split_batch(per_process, p.micro_batch)
    target = micro * accum * nodes
    why = f"global batch {g} kept over {nodes} CPU nodes x 1 process (micro-batch x accumulation x {nodes})"
    warnings = list(p.warnings)
    if target != g:
        warnings.append(f"global batch {g} does not divide over {nodes} nodes; using {target}, the nearest achievable")
    config = dict(p.config)
    changes = [c for c in p.changes if c.key not in ("per_device_train_batch_size", "gradient_accumulation_steps")]
    for key, new in (("per_device_train_batch_size", micro), ("gradient_accumulation_steps", accum)):
        changes.append(Change(key, config.get(key), new, why))
        config[key] = new
    if config.get("ddp_backend") != "gloo":
        changes.append(Change("ddp_backend", config.get("ddp_backend"), "gloo", "CPU nodes: NCCL needs GPUs"))
        config["ddp_backend"] = "gloo"
    return replace(
        p,
        config=config,
        changes=tuple(changes),
        world_size=nodes,
        global_batch_target=target,
        micro_batch=micro,
        accumulation=accum,
        warnings=tuple(warnings),
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
    job = slurm.submit(folder.job_script, {**env, "PWD": str(cwd)})
    journal.job_submitted(run_dir, job, nodes=req.nodes, gpus_per_node=req.gpus_per_node, notes=notes)
    return job, notes
