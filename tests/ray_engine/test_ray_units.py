"""The Ray engine's pure pieces (fast lane, no Ray needed): the cluster as the planner's machine,
LLaMA-Factory's Ray-mode preflight, the follower's decision, the job's env; and that nothing but
the Ray engine's job calls imports ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ftlaunch.errors import HardwareError
from ftlaunch.run.ray import jobs
from ftlaunch.run.ray.cluster import Node, card_of, hardware_for, parse_nodes, ray_mode_refusal, wants_ray_mode
from ftlaunch.run.ray.follow import Step, next_step
from ftlaunch.run.ray.submit import entrypoint, job_env
from ftlaunch.run.state import RunStatus

from ..conftest import write_yaml
from ..helpers import said

# An answer of the dashboard's /api/v0/nodes?detail=1 (Ray 2.60.0), trimmed: a CPU head of 4 CPUs.
NODES_ANSWER = {
    "result": True,
    "data": {
        "result": {
            "total": 2,
            "result": [
                {
                    "node_ip": "10.0.0.1",
                    "is_head_node": True,
                    "state": "ALIVE",
                    "resources_total": {"CPU": 4.0, "memory": 24053938944.0, "object_store_memory": 5e8},
                },
                {"node_ip": "10.0.0.9", "state": "DEAD", "resources_total": {"CPU": 64.0, "GPU": 8.0}},
            ],
        }
    },
}


def gpu_node(ip: str = "10.0.0.2", gpus: int = 8, cpus: float = 32, accel: str | None = "A100-80G") -> Node:
    return Node(ip, cpus, gpus, 1000.0, accel)


def test_parse_nodes_keeps_the_alive_nodes_with_their_resources():
    (head,) = parse_nodes(NODES_ANSWER)
    assert (head.ip, head.cpus, head.gpus, head.head) == ("10.0.0.1", 4.0, 0, True)
    assert head.memory_gib == pytest.approx(22.4, abs=0.01)


def test_a_cpu_cluster_plans_cpu_processes_and_refuses_more_than_a_node_has():
    nodes = parse_nodes(NODES_ANSWER)
    hw = hardware_for(nodes, "nonex2", "http://h:8265")
    assert (hw.gpus, hw.cpu_processes, hw.world_size, hw.cpu_count) == ((), 2, 2, 4)
    assert hw.host_ram_gib == pytest.approx(22.4, abs=0.01) and hw.source == "ray:http://h:8265"
    assert hardware_for(nodes, None, "h").world_size == 1
    with pytest.raises(HardwareError) as e:
        hardware_for(nodes, "nonex8", "h")
    assert said("the largest node of the Ray cluster at h has 4 CPUs", e.value.message)
    with pytest.raises(HardwareError, match="has no GPU"):
        hardware_for(nodes, "A100-80GBx2", "h")


def test_a_gpu_cluster_plans_the_largest_node_with_the_card_ray_names():
    nodes = (gpu_node(gpus=4), gpu_node("10.0.0.3", gpus=8))
    hw = hardware_for(nodes, None, "h")
    assert hw.gpu_count == 8 and hw.gpus[0].name == "NVIDIA A100-SXM4-80GB"
    assert hardware_for(nodes, "A100-80GBx2", "h").gpu_count == 2
    with pytest.raises(HardwareError) as e:
        hardware_for(nodes, "A100-80GBx16", "h")
    assert said("the largest node of the Ray cluster at h has 8", e.value.message)
    assert said("a Ray run trains on one node", e.value.hint)
    with pytest.raises(HardwareError, match="Ray says its GPUs are A100-80G"):
        hardware_for(nodes, "H100x2", "h")
    # Ray's bare "A100" could be either: the smaller is planned for, and said.
    card, note = card_of("A100")
    assert card == "A100-40GB" and said("name it with --gpu A100-80GBxN", note)
    with pytest.raises(HardwareError, match="not in the catalog"):
        hardware_for((gpu_node(accel="MI300X"),), None, "h")


def test_lf_ray_mode_demand_is_checked_against_the_cluster():
    cpu_head = (Node("127.0.0.1", 4, 0, 20.0),)
    why = ray_mode_refusal(cpu_head, 2, "http://h:8265")
    assert said("would wait forever for its placement group", why)
    assert said("4 bundles of {CPU: 10}", why) and said("no --num-cpus fits", why)
    # GPU nodes: 10 CPUs per GPU fit; fewer do not, and the fitting `ray start` is named.
    assert ray_mode_refusal((gpu_node(gpus=8, cpus=80),), 2, "h") is None
    why = ray_mode_refusal((gpu_node(gpus=8, cpus=32),), 2, "h")
    assert said("ray start --num-cpus=80", why) and said("holds 3 of them", why)
    assert said("ray_num_workers 16 is more than the 8 GPUs", ray_mode_refusal((gpu_node(cpus=80),), 16, "h"))
    assert wants_ray_mode({"ray_num_workers": 2}, {}) and wants_ray_mode({}, {"USE_RAY": "1"})
    assert not wants_ray_mode({}, {"USE_RAY": "0"})


def running(status: str = "RUNNING", **kw) -> jobs.JobInfo:
    return jobs.JobInfo(status=status, **kw)


@pytest.mark.parametrize(
    ("job", "recorded", "stop", "progressed", "no_progress", "step", "status"),
    [
        (None, RunStatus.RUNNING, False, False, 0, Step.UNREACHABLE, None),  # never "failed"
        (running(), RunStatus.RUNNING, False, False, 0, Step.WAIT, None),
        (running("PENDING"), RunStatus.QUEUED, False, False, 0, Step.WAIT, None),
        (running("SUCCEEDED"), RunStatus.SUCCEEDED, False, False, 0, Step.DONE, None),
        (running("FAILED"), RunStatus.FAILED, False, False, 0, Step.DONE, None),  # the supervisor's own end
        (running("STOPPED"), RunStatus.RUNNING, False, False, 0, Step.DONE, RunStatus.STOPPED),
        (running("FAILED"), RunStatus.STOPPED, True, False, 0, Step.DONE, RunStatus.STOPPED),  # never retried
        (
            running("FAILED", driver_exit_code=-9),
            RunStatus.RUNNING,
            False,
            True,
            2,
            Step.RESUBMIT,
            RunStatus.RECOVERING,
        ),
        (running("FAILED"), RunStatus.RUNNING, False, False, 1, Step.RESUBMIT, RunStatus.RECOVERING),
        (running("FAILED"), RunStatus.RUNNING, False, False, 2, Step.DONE, RunStatus.NO_PROGRESS),  # the brake
        (running("SUCCEEDED"), RunStatus.RUNNING, False, False, 0, Step.DONE, RunStatus.LOST),
    ],
)
def test_the_follower_decides_from_the_job_and_the_recorded_state(
    job, recorded, stop, progressed, no_progress, step, status
):
    n = next_step(
        job, recorded, submission_id="s-1", stop_requested=stop, progressed=progressed, no_progress=no_progress
    )
    assert (n.step, n.status) == (step, status), n
    if step is Step.RESUBMIT:
        assert n.no_progress == (0 if progressed else no_progress + 1) and "[" in n.message


def test_the_job_env_carries_path_home_and_the_plan_env_but_no_secret(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "FTLAUNCH_HOME": str(tmp_path / "home"),
        "HF_HOME": "/cache/hf",
        "HF_TOKEN": "hf_secret",
        "MY_API_KEY": "k",
        "WANDB_API_KEY": "w",
        "UNRELATED": "x",
        "PYTHONPATH": "/inject",
    }
    got = job_env(env, {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}, "/venv/bin/python")
    assert got["PATH"] == "/venv/bin:/usr/bin:/bin"  # torchrun beside the trainer, else "not found"
    assert got["FTLAUNCH_HOME"] == str(tmp_path / "home") and got["HF_HOME"] == "/cache/hf"
    assert (got["FORCE_TORCHRUN"], got["NPROC_PER_NODE"], got["PYTHONPATH"]) == ("1", "2", "/inject")
    assert not {"HF_TOKEN", "MY_API_KEY", "WANDB_API_KEY", "UNRELATED"} & set(got)


def test_the_entrypoint_is_the_supervisor_then_a_foreground_resume(tmp_path):
    run = tmp_path / "runs" / "20260101-000000-abcd"
    assert entrypoint(run, "/v/bin/python", True) == f"exec /v/bin/python -P -m ftlaunch.run.supervisor {run}"
    assert entrypoint(run, "/v/bin/python", False).endswith("resume 20260101-000000-abcd --foreground --no-follow")


def test_the_address_comes_from_the_option_then_ray_address():
    assert jobs.address_of(None, {}) == "http://127.0.0.1:8265"
    assert jobs.address_of(None, {"RAY_ADDRESS": "10.0.0.1:8265"}) == "http://10.0.0.1:8265"
    assert jobs.address_of("http://h:1/", {"RAY_ADDRESS": "x:2"}) == "http://h:1"
    with pytest.raises(HardwareError, match="dashboard"):
        jobs.address_of("ray://h:10001", {})


def test_a_head_that_does_not_answer_is_engine_unreachable():
    port = __import__("socket").socket()
    port.bind(("127.0.0.1", 0))
    address = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    with pytest.raises(jobs.EngineUnreachable) as e:
        jobs.nodes(address, timeout=2)
    assert said("engine unreachable", e.value.message) and "failed" not in e.value.message.split("(")[0]


def test_planning_status_and_runs_never_import_ray(tmp_path):
    trap = tmp_path / "trap"
    trap.mkdir()
    (trap / "ray.py").write_text("raise SystemExit('ray was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(trap)}
    cfg = write_yaml(
        tmp_path / "c.yaml",
        {
            "model_name_or_path": "Qwen/Qwen2.5-1.5B",
            "stage": "sft",
            "do_train": True,
            "dataset": "a",
            "output_dir": "o",
        },
    )

    def py(*args: str) -> str:
        r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
        return r.stdout + r.stderr

    assert "ray was imported" in py("-c", "import ray")  # the trap works
    for args in (["plan", str(cfg), "--gpu", "A10G", "--params", "1.5B"], ["runs"], ["status"]):
        assert "ray was imported" not in py("-m", "ftlaunch", *args), args
    probe = "import ftlaunch.run.ray.follow, ftlaunch.run.ray.machine, sys; print('ray' in sys.modules)"
    assert py("-c", probe).strip() == "False"


def test_without_the_extra_a_ray_run_is_refused_before_it_is_planned(monkeypatch):
    import importlib.util

    from ftlaunch.errors import TrainerError
    from ftlaunch.run.engines.ray import Ray
    from ftlaunch.run.prepare import PlanRequest

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(TrainerError) as e:
        Ray(address="http://127.0.0.1:1", env={}).request(PlanRequest(config="never-read.yaml"))
    assert e.value.exit_code == 13 and said("pip install 'ftlaunch[ray]'", e.value.hint)
