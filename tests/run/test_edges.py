"""Issue 26 items 6-7: one status-to-exit-code table for `status` and the supervisor's own exit, and
one way a health or recovery decision's edits reach the next attempt's config."""

from __future__ import annotations

from ftlaunch.errors import ExitCode
from ftlaunch.plan.offload import ZERO3_OFFLOAD, offload_config_path
from ftlaunch.run.state import STOPPED_EXIT, RunStatus
from ftlaunch.run.supervisor import Supervisor


def test_one_table_gives_status_and_supervisor_exit_codes():
    assert RunStatus.STOPPED.exit_code() == int(ExitCode.FAILED)  # `status` of a stopped run
    assert RunStatus.STOPPED.exit_code(trainer_rc=-15) == STOPPED_EXIT == 130  # the supervisor stopped
    assert RunStatus.FAILED.exit_code(trainer_rc=3) == 3  # a plain failure keeps the trainer's code
    assert RunStatus.FAILED.exit_code(trainer_rc=-9) == int(ExitCode.FAILED)
    assert RunStatus.DIVERGED.exit_code(trainer_rc=0) == RunStatus.DIVERGED.exit_code() == int(ExitCode.DIVERGED)
    assert RunStatus.SUCCEEDED.exit_code(trainer_rc=0) == 0 and RunStatus.RUNNING.exit_code() == int(ExitCode.RUNNING)


def test_health_and_recovery_edits_are_applied_the_same_way():
    values = {"learning_rate": 1e-4, "deepspeed": None, "per_device_train_batch_size": 4}
    env: dict[str, str] = {}
    Supervisor._apply(values, {"learning_rate": 5e-5}.items(), env, 2)  # a health rollback
    assert values["learning_rate"] == 5e-5 and env == {}
    Supervisor._apply(values, [("per_device_train_batch_size", 2), ("deepspeed", ZERO3_OFFLOAD)], env, 2)  # a retry
    assert values["per_device_train_batch_size"] == 2 and values["deepspeed"] == offload_config_path()
    assert env.get("NPROC_PER_NODE") == "2", env  # launched as the plan's processes, never one
