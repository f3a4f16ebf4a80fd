"""Recovery: classification and decisions (pure), and the supervisor against a scripted trainer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ftlaunch.run.progress import checkpoint_problems, last_complete_checkpoint
from ftlaunch.run.recovery import classify, decide, oom_step
from ftlaunch.run.state import Budget, FailureKind
from ftlaunch.run.store import read_state
from ftlaunch.run.supervisor import Supervisor

from ..fake_trainer import configs_seen, install, write_config

OOM = "Traceback\n  File x, in training_step\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.79 GiB"


@pytest.mark.parametrize(
    "rc,log,kind",
    [
        (0, "done", None),
        (1, OOM, FailureKind.CUDA_OOM),
        (1, "[rank0]: RuntimeError: CUDA out of memory.\nsubprocess.CalledProcessError: exit 1", FailureKind.CUDA_OOM),
        (1, "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate", FailureKind.CUDA_OOM),
        (1, "torch.distributed.DistBackendError: NCCL error: out of memory", FailureKind.CUDA_OOM),
        (1, "in evaluation_loop\n prediction_step\ntorch.OutOfMemoryError: CUDA out of memory", FailureKind.EVAL_OOM),
        (-9, "step 3 of 10", FailureKind.HOST_OOM),
        (137, "step 3 of 10", FailureKind.HOST_OOM),
        (1, "ValueError: Please use FORCE_TORCHRUN=1 to launch DeepSpeed training.", FailureKind.CONFIG),
        (1, "[rank0]: ValueError: Undefined dataset foo.\nCalledProcessError: x", FailureKind.CONFIG),
        (1, "ValueError: Some specified arguments are not used by the HfArgumentParser: ['x']", FailureKind.CONFIG),
        (1, "FileNotFoundError: [Errno 2] No such file or directory: 'data/x.json'", FailureKind.CONFIG),
        (1, "RuntimeError: NCCL watchdog timeout", FailureKind.CRASH),
        (-11, "", FailureKind.CRASH),
    ],
)
def test_classify(rc, log, kind):
    assert classify(rc, log).kind == kind


def test_stop_wins_over_everything():
    assert classify(-15, OOM, stop_requested=True).kind == FailureKind.STOPPED


def test_oom_steps_keep_the_global_batch_then_checkpointing_then_offload_then_give_up():
    cfg = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "disable_gradient_checkpointing": True}
    seen = []
    while (step := oom_step(cfg, offload_ok=True)) is not None:
        cfg = {**cfg, **step[0]}
        seen.append(step[1])
        if "per_device_train_batch_size" in step[0]:
            assert cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"] == 16
    assert seen == [
        "micro-batch 4 x accumulation 4",
        "micro-batch 2 x accumulation 8",
        "micro-batch 1 x accumulation 16",
        "gradient checkpointing on",
        "ZeRO-3 with CPU offload on one GPU",
    ]


def test_next_divisor_when_halving_does_not_divide():
    step, _ = oom_step({"per_device_train_batch_size": 6, "gradient_accumulation_steps": 1}, False)
    assert step == {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2}
    step, _ = oom_step({"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2}, False)
    assert step == {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 6}


def test_budget_is_bounded_and_refills_on_progress():
    cfg = {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1}
    ex = classify(1, OOM)
    b = Budget(oom_max=2)
    d1 = decide(ex, cfg, b, step=10)
    assert d1.action == "retry" and d1.message.startswith("[1/2] OOM at step 10 (micro-batch 64)")
    d2 = decide(ex, {**cfg, **d1.edits}, d1.budget)
    assert d2.action == "retry" and d2.message.startswith("[2/2]")
    assert d2.edits["per_device_train_batch_size"] == 1  # the budget's last try is the bottom rung
    # micro-batch 16 worked for a while (a checkpoint landed), then ran out: the budget refills.
    at16 = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4}
    assert decide(ex, at16, d2.budget).action == "retry"
    refilled = decide(ex, at16, d2.budget, progressed=True)
    assert (
        refilled.action == "retry"
        and refilled.message.startswith("[1/2]")
        and refilled.budget.tried == ("mb16/evalNone/gcon/ds-",)
    )


def test_config_errors_never_retry_and_crashes_are_bounded():
    cfg = {"per_device_train_batch_size": 1}
    assert decide(classify(1, "ValueError: Please use FORCE_TORCHRUN=1"), cfg, Budget()).action == "fail"
    crash = classify(1, "RuntimeError: boom")
    d = decide(crash, cfg, Budget(crash_max=1))
    assert d.action == "retry" and d.edits == {} and d.message.startswith("[1/1] crash")
    assert decide(crash, cfg, d.budget).action == "fail"


def test_eval_oom_shrinks_the_eval_batch_only():
    ex = classify(1, "in evaluation_loop\ntorch.OutOfMemoryError: CUDA out of memory.")
    d = decide(ex, {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 8}, Budget())
    assert d.edits == {"per_device_eval_batch_size": 4}


# ---------------------------------------------------------------- scripted supervisor runs


def make_run(tmp_path: Path, script: list[dict], config: dict | None = None) -> tuple[Path, dict]:
    """A real run directory (via the service layer) whose trainer is tests/fake_trainer.py."""

    from ftlaunch.plan.hardware import catalog_hardware
    from ftlaunch.run.launch import create_run
    from ftlaunch.run.options import SupervisorSettings
    from ftlaunch.run.policy import RecoveryPolicy
    from ftlaunch.run.prepare import PlanRequest, make_plan

    src = write_config(tmp_path, **{"per_device_train_batch_size": 4, **(config or {})})
    env = {
        "FTLAUNCH_HOME": str(tmp_path / "home"),
        "PATH": "/usr/bin:/bin",
        "FAKE_TRAINER_SCRIPT": json.dumps(script),
        "FAKE_TRAINER_COUNTER": str(tmp_path / "counter"),
    }
    env["FTLAUNCH_LLAMAFACTORY_CLI"] = str(install(tmp_path))
    loaded, p = make_plan(PlanRequest(config=str(src), gpu="A10G"), env)
    assert catalog_hardware("A10G").gpu_count == 1
    policy = RecoveryPolicy.from_options(max_retries=3, max_crash_retries=1)
    run_dir = create_run(loaded, p, env, SupervisorSettings(policy=policy))
    return run_dir, env


def test_oom_at_micro_batch_one_gives_up_quickly(tmp_path):
    run_dir, env = make_run(
        tmp_path, [{"oom": True}], {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}
    )
    t0 = time.monotonic()
    code = Supervisor(run_dir, env, poll=0.05).run()
    assert code == 1 and time.monotonic() - t0 < 30
    st = read_state(run_dir)
    assert st.status == "failed" and st.failure_kind == "cuda_oom"
    assert "does not fit" in st.message
    assert len(configs_seen(tmp_path)) == 1  # checkpointing already on (default), no offload: no retry


def test_rank_prefixed_oom_then_success_keeps_global_batch(tmp_path):
    run_dir, env = make_run(tmp_path, [{"oom": True, "rank": True}, {"ok": True}])
    assert Supervisor(run_dir, env, poll=0.05).run() == 0
    cfgs = configs_seen(tmp_path)
    assert [c["per_device_train_batch_size"] for c in cfgs] == [4, 2]
    assert [c["gradient_accumulation_steps"] for c in cfgs] == [2, 4]
    st = read_state(run_dir)
    assert st.status == "succeeded" and st.progress["step"] == 4


def test_exit_137_is_a_host_oom_with_bounded_retries(tmp_path):
    run_dir, env = make_run(tmp_path, [{"signal": 9}])
    trainer_pids = []

    def kernel_log() -> str:  # the kernel's record of killing this attempt's trainer
        trainer_pids.append(read_state(run_dir).trainer_pid)
        return f"[1.0] Out of memory: Killed process {trainer_pids[-1]} (python)"

    assert Supervisor(run_dir, env, poll=0.05, read_kernel_log=kernel_log).run() == 1
    st = read_state(run_dir)
    assert st.failure_kind == "host_oom" and len(configs_seen(tmp_path)) == 2  # 1 + max_crash_retries
    events = (run_dir / "events.jsonl").read_text()
    assert "[1/1] host OOM" in events and "OOM killer killed the trainer" in events


def test_config_error_is_not_retried(tmp_path):
    run_dir, env = make_run(tmp_path, [{"config_error": "Undefined dataset foo in dataset_info.json."}])
    assert Supervisor(run_dir, env, poll=0.05).run() == 1
    assert read_state(run_dir).failure_kind == "config_error" and len(configs_seen(tmp_path)) == 1


def test_eval_oom_halves_eval_batch(tmp_path):
    run_dir, env = make_run(tmp_path, [{"eval_oom": True}, {"ok": True}], {"per_device_eval_batch_size": 8})
    assert Supervisor(run_dir, env, poll=0.05).run() == 0
    cfgs = configs_seen(tmp_path)
    assert cfgs[1]["per_device_eval_batch_size"] == 4 and cfgs[1]["per_device_train_batch_size"] == 4


def test_half_written_checkpoint_is_moved_aside_not_deleted(tmp_path):
    run_dir, env = make_run(tmp_path, [{"half_checkpoint": 6}, {"ok": True}])
    out = tmp_path / "out"
    good = out / "checkpoint-4"
    good.mkdir(parents=True)
    (good / "trainer_state.json").write_text("{}")
    (good / "optimizer.pt").write_bytes(b"x")
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (good / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
    assert checkpoint_problems(good) == []
    assert Supervisor(run_dir, env, poll=0.05).run() == 0
    aside = [p.name for p in out.iterdir() if p.name.startswith("incomplete-checkpoint-6")]
    assert len(aside) == 1 and not (out / "checkpoint-6").exists()
    assert last_complete_checkpoint(out)[0] == 4
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    started = [e for e in events if e["event"] == "attempt_started"]
    assert started[1]["resume_from"] == "checkpoint-4"


def test_a_run_that_gave_up_resumes_by_hand_after_a_change(tmp_path):
    from ftlaunch.errors import ConfigError
    from ftlaunch.run.control import resume_run

    run_dir, env = make_run(
        tmp_path, [{"oom": True}, {"ok": True}], {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}
    )
    assert Supervisor(run_dir, env, poll=0.05).run() == 1
    with pytest.raises(ConfigError, match="cutof_len"):
        resume_run(run_dir, env, foreground=True, overrides=("cutof_len=64",))
    resumed = resume_run(run_dir, env, foreground=True, overrides=("cutoff_len=64",))
    assert (resumed.outcome, resumed.exit_code) == ("foreground", 0)
    assert configs_seen(tmp_path)[-1]["cutoff_len"] == 64
    assert read_state(run_dir).status == "succeeded"
    assert "config_edited" in (run_dir / "events.jsonl").read_text()


def test_host_oom_is_confirmed_from_the_kernel_log_when_readable():
    from ftlaunch.run.supervisor import with_kernel_evidence

    ex = classify(-9, "step 3")
    log = "[123.4] Out of memory: Killed process 4242 (python) total-vm:100kB"
    assert "OOM killer killed the trainer (pid 4242)" in with_kernel_evidence(ex, 4242, read=lambda: log).message
    not_oom = with_kernel_evidence(ex, 7, read=lambda: log)
    assert "no OOM kill" in not_oom.message and not_oom.kind is FailureKind.CRASH
    unknown = with_kernel_evidence(ex, 7, read=lambda: "")
    assert "cause unknown" in unknown.message and "not readable" in unknown.message


def test_secrets_printed_by_the_trainer_never_reach_the_log(tmp_path):
    run_dir, env = make_run(tmp_path, [{"print_env": "HF_TOKEN", "ok": True}])
    env["HF_TOKEN"] = "hf_abcdefghijklmnop"
    assert Supervisor(run_dir, env, poll=0.05).run() == 0
    log = (run_dir / "train.log").read_text()
    assert "printed ***" in log and "hf_abcdefghijklmnop" not in log
    for name in ("state.json", "events.jsonl", "plan.json", "config.yaml"):
        assert "hf_abcdefghijklmnop" not in (run_dir / name).read_text()
