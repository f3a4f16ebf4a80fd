"""Issue 40's Ray pieces that are pure (fast lane, no Ray needed): the record of the next job after a
re-plan (`resume --gpu`), and the follower's words for a stop it did not ask for."""

from __future__ import annotations

from ftlaunch.run.ray.follow import Step, next_step
from ftlaunch.run.ray.jobs import JobInfo
from ftlaunch.run.ray.record import RayRecord
from ftlaunch.run.ray.submit import replanned
from ftlaunch.run.state import RunState, RunStatus

TWO = {"FORCE_TORCHRUN": "1", "NNODES": "1", "NPROC_PER_NODE": "2"}


def test_a_replan_to_one_process_drops_the_old_launch_variables_and_asks_one_cpu():
    record = RayRecord("http://h:8265", cpus=2.0, env_vars={**TWO, "HF_HOME": "/hf", "PATH": "/v/bin"})
    before = RunState(id="r", world_size=2, gpu_count=0, trainer_env=TWO)
    after = RunState(id="r", world_size=1, gpu_count=0, trainer_env={"NNODES": "1"})
    new = replanned(record, before, after)
    assert new.cpus == 1.0 and new.gpus is None
    assert new.env_vars == {"NNODES": "1", "HF_HOME": "/hf", "PATH": "/v/bin"}


def test_a_replan_to_gpus_asks_them_and_takes_the_new_values():
    record = RayRecord("http://h:8265", cpus=1.0, env_vars={"NPROC_PER_NODE": "1", "PATH": "/v/bin"})
    before = RunState(id="r", world_size=1, gpu_count=0, trainer_env={"NPROC_PER_NODE": "1"})
    after = RunState(id="r", world_size=4, gpu_count=4, trainer_env={"NPROC_PER_NODE": "4", "HF_TOKEN": "***"})
    new = replanned(record, before, after)
    assert (new.cpus, new.gpus) == (1.0, 4.0)
    assert new.env_vars == {"NPROC_PER_NODE": "4", "PATH": "/v/bin"}  # a secret's mask is never a value


def test_nothing_changed_keeps_the_record():
    record = RayRecord("http://h:8265", cpus=1.0, env_vars={"PATH": "/v/bin"})
    state = RunState(id="r", world_size=1, gpu_count=0, trainer_env={})
    assert replanned(record, state, state) is record


def test_a_stop_ftlaunch_did_not_ask_for_is_named_as_rays_from_outside():
    stopped = JobInfo("STOPPED")
    outside = next_step(
        stopped, RunStatus.STOPPED, submission_id="s-1", stop_requested=False, progressed=False, no_progress=0
    )
    assert outside.step is Step.DONE and outside.status is RunStatus.STOPPED
    assert "from outside the run, by Ray" in outside.message and "not by `ftlaunch stop`" in outside.message
    asked = next_step(
        stopped, RunStatus.RUNNING, submission_id="s-1", stop_requested=True, progressed=False, no_progress=0
    )
    assert asked.message.startswith("stopped by `ftlaunch stop` (job s-1)")
