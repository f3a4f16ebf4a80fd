"""Slurm, the pure parts: the job script and trainer wrapper, the parsers, the status mapping."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ftlaunch.errors import ConfigError, HardwareError, TrainerError
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.slurm.submit import cluster_gpu_spec


def job(req: slurm.SlurmRequest, tmp_path: Path) -> slurm.JobFiles:
    return slurm.render_job(
        tmp_path / "run", "RID", "RID", req, "/venv/bin/python", ["/opt/llamafactory-cli"], {"FTLAUNCH_HOME": "/h o"}
    )


def test_script_asks_for_what_the_issue_lists(tmp_path):
    req = slurm.SlurmRequest(2, 8, partition="gpu", time="24:00:00", account="ml", sbatch_args=("--exclusive",))
    files = job(req, tmp_path)
    s = files.script
    wants = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--requeue", "--signal=B:USR1@180"]
    wants += ["--open-mode=append", "--partition=gpu", "--time=24:00:00", "--account=ml", "--exclusive"]
    for want in wants:
        assert f"#SBATCH {want}\n" in s, want
    assert f"#SBATCH --output={tmp_path / 'run' / 'train.log'}" in s
    assert "export FTLAUNCH_HOME='/h o'" in s  # quoted for the shell
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in s
    assert s.rstrip().endswith(f"exec /venv/bin/python -m ftlaunch.run.slurm.job {tmp_path / 'run'}")
    w = files.trainer
    assert "export NNODES=2" in w and "export NPROC_PER_NODE=8" in w and "export FORCE_TORCHRUN=1" in w
    assert "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1" in w and 'NODE_RANK="$SLURM_NODEID"' in w
    # Both are valid bash.
    for text in (s, w):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_wrapper_gives_each_node_its_rank(tmp_path):
    files = job(slurm.SlurmRequest(2, 4), tmp_path)
    fake_srun = tmp_path / "srun"  # one "node": SLURM_NODEID=1, then run the command
    fake_srun.write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nSLURM_NODEID=1 exec "$@"\n')
    fake_srun.chmod(0o755)
    show = tmp_path / "show-env"  # stands in for llamafactory-cli: prints what it was given
    show.write_text("#!/bin/sh\nenv\n")
    show.chmod(0o755)
    wrapper = tmp_path / "w.sh"
    wrapper.write_text(files.trainer.replace("/opt/llamafactory-cli", str(show)))
    r = subprocess.run(["bash", str(wrapper), "train", "x.yaml"], capture_output=True, text=True,
                       env={"PATH": f"{tmp_path}:/usr/bin:/bin"})  # fmt: skip
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert (env["NODE_RANK"], env["NNODES"], env["NPROC_PER_NODE"]) == ("1", "2", "4"), r.stderr


def test_a_newline_in_an_sbatch_arg_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="newline"):
        job(slurm.SlurmRequest(1, 1, sbatch_args=("--x\nrm -rf /",)), tmp_path)


def test_parsers():
    assert slurm.parse_sbatch("1234\n") == "1234" and slurm.parse_sbatch("77;cluster\n") == "77"
    with pytest.raises(TrainerError):
        slurm.parse_sbatch("sbatch: error: invalid partition")
    assert slurm.parse_state("PENDING\n") == "PENDING"
    assert slurm.parse_state("CANCELLED by 0\n") == "CANCELLED"
    assert slurm.parse_state("COMPLETED+\n") == "COMPLETED" and slurm.parse_state("\n") is None
    assert [slurm.status_of(s) for s in ("PENDING", "REQUEUED", "RUNNING", "COMPLETED", None)] == [
        "queued", "queued", "starting", None, None,
    ]  # fmt: skip


def test_local_filesystems_are_named():
    mounts = "tmpfs /tmp tmpfs rw 0 0\n/dev/sda1 / ext4 rw 0 0\nnfs:/x /shared nfs4 rw 0 0\n"
    assert slurm.local_filesystem(Path("/tmp/run"), mounts) == "tmpfs"
    assert slurm.local_filesystem(Path("/shared/runs/a"), mounts) is None
    assert slurm.local_filesystem(Path("/home/u"), mounts) is None


def test_cluster_gpu_spec():
    assert cluster_gpu_spec("A100-80GBx8", 2) == ("A100-80GBx16", 8)
    assert cluster_gpu_spec("H100", 4) == ("H100-80GBx4", 1)
    with pytest.raises(HardwareError, match="needs --gpu"):
        cluster_gpu_spec(None, 2)
    with pytest.raises(HardwareError, match="needs GPUs"):
        cluster_gpu_spec("none", 2)


def test_without_slurm_on_path_the_error_says_so(tmp_path):
    with pytest.raises(TrainerError, match="not a Slurm login node"):
        slurm.submit(tmp_path / "job.sbatch", {"PATH": str(tmp_path)})
    assert slurm.job_state("1", {"PATH": str(tmp_path)}) is None
