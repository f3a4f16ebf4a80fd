"""Slurm, the pure parts: the job script and trainer wrapper, the parsers, the status mapping,
MASTER_ADDR, what a SIGTERM was, the rendezvous check, the engine's request and the CPU resume fix.
The planning of nodes x processes is the planner's: tests/plan/test_nodes.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ftlaunch.errors import ConfigError, TrainerError
from ftlaunch.run.recovery import classify, decide
from ftlaunch.run.slurm import rendezvous
from ftlaunch.run.slurm import sbatch as slurm
from ftlaunch.run.slurm.job import ended_by_slurm, stop_requested
from ftlaunch.run.state import Budget, FailureKind, RunStatus

from ..conftest import needs_train_stack


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
    assert "MASTER_ADDR" not in s.replace("# MASTER_ADDR", "")  # chosen by the batch step on the first node
    assert s.rstrip().endswith(f"exec /venv/bin/python -P -m ftlaunch.run.slurm.job {tmp_path / 'run'}")
    w = files.trainer
    assert "export NNODES=2" in w and "export NPROC_PER_NODE=8" in w and "export FORCE_TORCHRUN=1" in w
    assert "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1" in w and 'NODE_RANK="$SLURM_NODEID"' in w
    assert "-m ftlaunch.run.slurm.rendezvous --timeout 300" in w and "PYTHONPATH" not in w
    # Both are valid bash.
    for text in (s, w):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_cpu_nodes_ask_for_no_gpu_and_carry_the_resume_fix(tmp_path):
    req = slurm.SlurmRequest(2, 0, master_addr="10.0.0.7", rendezvous_timeout=30)
    files = job(req, tmp_path)
    assert "gpus" not in files.script and "export FTLAUNCH_MASTER_ADDR=10.0.0.7" in files.script
    w = files.trainer
    assert "export NPROC_PER_NODE=1" in w and "--timeout 30" in w
    assert f"export PYTHONPATH={slurm.CPU_SITE}" in w and (slurm.CPU_SITE / "sitecustomize.py").is_file()
    # the check runs before the trainer, without the torch-importing sitecustomize
    assert w.index("rendezvous") < w.index("PYTHONPATH") < w.index("exec srun")
    with pytest.raises(ConfigError, match="master-addr"):
        job(slurm.SlurmRequest(2, 0, master_addr="a b; rm -rf /"), tmp_path)


def test_wrapper_gives_each_node_its_rank(tmp_path):
    files = job(slurm.SlurmRequest(2, 4, rendezvous_timeout=0), tmp_path)
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


def test_the_engine_asks_the_planner_for_the_jobs_nodes_and_takes_its_plan():
    from ftlaunch.errors import HardwareError
    from ftlaunch.plan.hardware import catalog_hardware, on_nodes
    from ftlaunch.plan.planner import plan
    from ftlaunch.run.engines.slurm import Slurm
    from ftlaunch.run.prepare import PlanRequest

    engine = Slurm(job=slurm.SlurmRequest(2, 0))
    req = engine.request(PlanRequest(config="c.yaml", gpu="A100-80GBx8"))
    assert (req.gpu, req.nodes) == ("A100-80GBx8", 2)  # one node named; the planner plans two of it
    with pytest.raises(HardwareError, match="needs --gpu"):
        engine.request(PlanRequest(config="c.yaml"))
    p = plan({"stage": "sft", "do_train": True, "output_dir": "/o"}, on_nodes(catalog_hardware("none"), 2))
    assert engine.adapt(p) is p  # the plan is final


def test_the_wrapper_starts_the_plans_processes_on_each_node(tmp_path):
    fewer = job(slurm.SlurmRequest(2, 8, processes_per_node=6), tmp_path)
    assert "#SBATCH --gpus-per-node=8\n" in fewer.script and "export NPROC_PER_NODE=6" in fewer.trainer
    assert "export NPROC_PER_NODE=8" in job(slurm.SlurmRequest(2, 8), tmp_path).trainer  # one per GPU


def test_master_addr_is_the_first_that_resolves_on_the_first_node():
    table = {"localhost": "127.0.0.1", "10.1.2.3": "10.1.2.3"}

    def resolver(name: str) -> str:
        if name not in table:
            raise OSError(-2, "Name or service not known")
        return table[name]

    got = slurm.choose_master_addr("node1", None, ("localhost",), resolver)
    assert got.addr == "127.0.0.1" and "NodeAddr of node1" in got.how
    assert slurm.choose_master_addr("node1", "10.1.2.3", (), resolver).addr == "10.1.2.3"
    none = slurm.choose_master_addr("node1", None, ("node1",), resolver)
    assert none.addr is None and "node1 (Name or service not known)" in none.how and "--master-addr" in none.how
    assert slurm.choose_master_addr("node1", "bad.invalid", ("localhost",), resolver).addr is None  # given: only it


def test_scontrol_fields_and_job_queries(tmp_path):
    line = "NodeName=node1 Arch=x86_64 NodeAddr=localhost NodeHostName=localhost Port=16818 State=IDLE\n"
    assert slurm.parse_fields(line)["NodeAddr"] == "localhost"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in {
        "squeue": 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
        "scontrol": 'echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
        "sacct": 'echo "Slurm accounting storage is disabled" >&2; exit 1',
    }.items():
        (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bindir / name).chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin"}
    gone = slurm.query_job("7", env)
    assert gone.known and gone.state is None and not gone.active  # forgotten, no accounting: known gone
    (bindir / "squeue").write_text(
        "#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\nexit 1\n"
    )
    (bindir / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    assert not slurm.query_job("7", env).known  # no answer: it may be alive (fail closed)
    (bindir / "squeue").write_text("#!/bin/sh\necho COMPLETING\n")
    (bindir / "scontrol").write_text("#!/bin/sh\necho JobId=7 JobState=COMPLETING Restarts=2\n")
    assert slurm.query_job("7", env) == slurm.JobInfo(True, "COMPLETING", 2, "squeue")


def test_a_sigterm_ftlaunch_did_not_ask_for_is_slurms():
    assert stop_requested([{"event": "stop_requested", "job_id": "5"}], "5")
    assert not stop_requested([{"event": "stop_requested", "job_id": "4"}], "5")
    status, message, event = ended_by_slurm(slurm.JobInfo(True, "COMPLETING", 1), 0, "R")
    assert status is RunStatus.QUEUED and event == "requeued_by_slurm" and "requeued by Slurm" in message
    status, message, _ = ended_by_slurm(slurm.JobInfo(True, "PREEMPTED", 0), 0, "R")
    assert status is RunStatus.LOST and message.startswith("preempted") and "ftlaunch resume R" in message
    assert ended_by_slurm(slurm.JobInfo(True, "CANCELLED", 1), 1, "R")[0] is RunStatus.LOST  # not a new requeue


def test_rendezvous_check_completes_or_fails_within_its_bound(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {"NNODES": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    results: dict[int, str | None] = {}

    def node(rank: int) -> None:
        results[rank] = rendezvous.check({**base, "SLURM_NODEID": str(rank)}, timeout=20)

    threads = [threading.Thread(target=node, args=(r,)) for r in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: None, 1: None, 2: None}
    alone = rendezvous.check({**base, "SLURM_NODEID": "1"}, timeout=1)
    assert alone and alone.startswith("not complete within 1 s") and f"127.0.0.1:{port}" in alone
    assert "does not resolve" in rendezvous.check({**base, "MASTER_ADDR": "no-such-host.invalid"}, timeout=1)
    # what the supervisor makes of the line: a rendezvous failure, never retried
    ex = classify(75, f"{rendezvous.FAILED} {alone} (on node2; MASTER_ADDR=127.0.0.1)\n")
    assert ex.kind is FailureKind.RENDEZVOUS
    d = decide(ex, {}, Budget(), recover=True, progressed=False)
    assert d.action.value == "fail" and "not retried" in d.message


@needs_train_stack
def test_the_cpu_site_fix_lets_torch_restore_cpu_0(tmp_path):
    code = (
        "import io, torch\n"
        "b = io.BytesIO(); torch.save({'w': torch.ones(2)}, b); b.seek(0)\n"
        "print(torch.load(b, map_location=torch.device('cpu', 0), weights_only=True)['w'].sum().item())\n"
    )
    env = {**os.environ, "PYTHONPATH": ""}
    bare = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bare.returncode != 0 and "don't know how to restore data location" in bare.stderr  # the bug, as seen
    fixed = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(slurm.CPU_SITE)},
                           capture_output=True, text=True)  # fmt: skip
    assert fixed.returncode == 0 and fixed.stdout.strip() == "2.0", fixed.stderr


def test_without_slurm_on_path_the_error_says_so(tmp_path):
    with pytest.raises(TrainerError, match="not a Slurm login node"):
        slurm.submit(tmp_path / "job.sbatch", {"PATH": str(tmp_path)})
    assert slurm.job_state("1", {"PATH": str(tmp_path)}) is None


def test_status_of_a_slurm_run_without_accounting_and_when_slurm_is_down(tmp_path):
    from ftlaunch.run.state import RunState
    from ftlaunch.run.store import write_state
    from ftlaunch.run.view import run_view

    run_dir = tmp_path / "R"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("")
    write_state(run_dir, RunState(id="R", status=RunStatus.RUNNING, slurm_job_id="7", output_dir=str(tmp_path / "o")))
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def commands(squeue: str, scontrol: str) -> dict[str, str]:
        for name, body in {"squeue": squeue, "scontrol": scontrol, "sacct": "echo disabled >&2; exit 1"}.items():
            (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bindir / name).chmod(0o755)
        return {"PATH": f"{bindir}:/usr/bin:/bin"}

    gone = "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"
    assert run_view(run_dir, env=commands(gone, gone)).status == "lost"  # Slurm forgot it, no final status
    running = commands("echo RUNNING", "echo JobState=RUNNING Restarts=0")
    assert run_view(run_dir, env=running).slurm_state == "RUNNING"
    down = commands("echo 'Unable to contact slurm controller' >&2; exit 1", "exit 1")
    v = run_view(run_dir, env=down)
    assert (v.status, v.slurm_state) == ("running", None)  # no answer: as recorded (fail closed)
