"""The unattended guard (issue 20): the stall watchdog, the restart brake, budgets that refill on
progress and a checkpoint watch that never misses a save. Pure decisions first, then real supervisor
runs of the scripted trainer (tests/fake_trainer.py) for the cases a real run cannot produce cheaply.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ftlaunch.run.checkpoints import CheckpointWatch
from ftlaunch.run.recovery import Action, Exit, decide
from ftlaunch.run.stall import StallPolicy, Watchdog
from ftlaunch.run.state import Budget, FailureKind, RunStatus
from ftlaunch.run.store import read_events, read_state, update_state
from ftlaunch.run.supervisor import Supervisor
from tests.fake_trainer import configs_seen, write_checkpoint
from tests.run.test_recovery import make_run

# ---------------------------------------------------------------- the watchdog's allowances


def test_training_timeout_is_the_floor_until_five_step_gaps_exceed_it():
    w = Watchdog.begin(StallPolicy(), now=0.0)
    w = w.steps(1, 100.0).steps(2, 110.0)  # 10 s between steps
    assert w.timeout() == 600.0 and not w.stalled(110.0 + 600.0) and w.stalled(110.0 + 601.0)
    w = w.steps(3, 310.0)  # a 200 s step: 5x is 1000 s
    assert w.timeout() == 1000.0
    assert "5x the longest step interval" in w.why()


def test_an_explicit_timeout_wins_in_training():
    w = Watchdog.begin(StallPolicy(timeout=20), now=0.0).steps(1, 5.0).steps(2, 6.0)
    assert w.allowance() == 20 and not w.stalled(26.0) and w.stalled(26.5)


def test_loading_has_a_longer_allowance_and_console_output_is_progress_there():
    w = Watchdog.begin(StallPolicy(timeout=20), now=0.0)
    assert w.allowance() == 1800.0  # nothing measured yet: the load floor
    w = w.console("Running tokenizer on dataset: 50%", 1000.0)
    assert w.idle(1000.0) == 0.0
    # an earlier attempt measured the load: 3x that, at least the timeout
    w2 = Watchdog.begin(StallPolicy(timeout=20), now=0.0, earlier={"load_s": 12.0})
    assert w2.allowance() == 36.0 and w2.stalled(37.0)


def test_console_output_in_training_is_not_progress_but_a_save_or_evaluation_opens_a_longer_phase():
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(1, 1.0)
    w = w.console("some warning", 8.0)
    assert w.idle(8.0) == 7.0  # a chatty hung trainer still stalls
    w = w.console("[INFO|trainer.py:3815] >> Saving model checkpoint to /x/checkpoint-4", 9.0)
    assert w.phase == "saving" and w.allowance() == 30.0
    w = w.checkpoint_done(20.0)
    assert w.phase == "training" and w.longest_slow_phase == 11.0
    w = w.console("***** Running Evaluation *****", 21.0)
    assert w.phase == "evaluating" and w.allowance() >= 33.0
    w = w.steps(2, 40.0)
    # the save and the evaluation are not step gaps: the training part only
    assert w.longest_step_gap < 10.0 and w.phase == "training"


def test_a_growing_checkpoint_is_progress():
    w = Watchdog.begin(StallPolicy(timeout=10), now=0.0).steps(1, 1.0)
    w = w.checkpoint_grew(9.0)
    assert w.phase == "saving" and w.idle(9.0) == 0.0


def test_watchdog_view_round_trips_into_the_next_attempt():
    w = Watchdog.begin(StallPolicy(), now=0.0).steps(1, 30.0).steps(2, 40.0)
    d = w.to_dict(now=45.0, wall_now=1000.0)
    assert d["idle_s"] == 5.0 and d["last_progress_at"] == 995.0 and d["load_s"] == 30.0
    nxt = Watchdog.begin(StallPolicy(), now=0.0, earlier=d)
    assert nxt.measured_load == 30.0 and nxt.longest_step_gap == 10.0


# ---------------------------------------------------------------- the restart brake and budgets


def _crash(msg: str = "exit code 1: RuntimeError: boom") -> Exit:
    return Exit(FailureKind.CRASH, msg)


def test_three_crashes_without_a_new_checkpoint_end_no_progress():
    budget, count = Budget(crash_max=2), 0
    actions = []
    for _ in range(3):
        d = decide(_crash(), {}, budget, no_progress=count)
        budget, count = d.budget, d.no_progress
        actions.append((d.action, d.ends))
    assert actions[:2] == [(Action.RETRY, None), (Action.RETRY, None)]
    assert actions[2] == (Action.FAIL, RunStatus.NO_PROGRESS)
    assert count == 3


def test_progress_between_crashes_refills_the_crash_budget_and_resets_the_brake():
    budget, count = Budget(crash_max=2), 0
    for _ in range(6):  # twice the budget, each attempt saved a new checkpoint
        d = decide(_crash(), {}, budget, progressed=True, no_progress=count)
        assert d.action is Action.RETRY
        budget, count = d.budget, d.no_progress
    assert budget.crash_used == 1 and count == 0


def test_the_brake_survives_a_refilled_budget_as_after_a_requeue():
    # a requeue or a plain resume refills the budget; the brake's count is the run's state
    d = decide(_crash(), {}, Budget(crash_max=2), no_progress=2)
    assert d.action is Action.FAIL and d.ends is RunStatus.NO_PROGRESS


def test_a_stall_is_restarted_within_its_own_budget_then_ends_stalled():
    budget = Budget(stall_max=2)
    ex = Exit(FailureKind.STALLED, "no progress for 21 s after step 11")
    d1 = decide(ex, {}, budget, progressed=True)
    d2 = decide(ex, {}, d1.budget, progressed=True)
    d3 = decide(ex, {}, d2.budget, progressed=True)
    assert [d.action for d in (d1, d2, d3)] == [Action.RETRY, Action.RETRY, Action.RETRY]  # progress refills
    s1 = decide(ex, {}, Budget(stall_max=1))
    s2 = decide(ex, {}, s1.budget, no_progress=s1.no_progress)
    assert s1.action is Action.RETRY and "[1/1] stalled" in s1.message
    assert s2.action is Action.FAIL and s2.ends is RunStatus.STALLED


def test_disk_full_is_never_retried():
    d = decide(Exit(FailureKind.DISK_FULL, "no space left on /data"), {}, Budget())
    assert d.action is Action.FAIL and d.ends is RunStatus.DISK_FULL


def test_config_changing_retries_do_not_count_for_the_brake():
    oom = Exit(FailureKind.CUDA_OOM, "CUDA out of memory")
    d = decide(oom, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}, Budget(), no_progress=2)
    assert d.action is Action.RETRY and d.no_progress == 2


# ---------------------------------------------------------------- the checkpoint watch


def test_two_saves_between_polls_are_both_reported(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    watch = CheckpointWatch(out, weights_only=False)
    write_checkpoint(out, 4)
    write_checkpoint(out, 8)
    assert [s for s, _ in watch.landed_all()] == [4, 8]
    assert watch.landed_all() == []


def test_an_older_checkpoint_completing_beside_a_newer_partial_one_is_reported(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    watch = CheckpointWatch(out, weights_only=False)
    (out / "checkpoint-12").mkdir()
    (out / "checkpoint-12" / "model.safetensors").write_bytes(b"\0" * 100)
    assert watch.growth() is True and watch.growth() is False
    write_checkpoint(out, 8)
    assert [s for s, _ in watch.landed_all()] == [8]
    write_checkpoint(out, 12)
    assert [s for s, _ in watch.landed_all()] == [12]
    assert watch.progressed


def test_a_rotated_checkpoint_still_counts(tmp_path):
    import shutil

    out = tmp_path / "out"
    out.mkdir()
    watch = CheckpointWatch(out, weights_only=False)
    write_checkpoint(out, 4)
    assert watch.landed() is not None
    write_checkpoint(out, 8)
    shutil.rmtree(out / "checkpoint-4")  # save_total_limit: 1
    assert [s for s, _ in watch.landed_all()] == [8] and watch.last == 8


# ---------------------------------------------------------------- real supervisor runs


def _events(run_dir: Path, name: str) -> list[dict]:
    """Events of that name (a stall's own events carry its stacks; the run's end is named by its status too)."""
    return [e for e in read_events(run_dir) if e["event"] == name and (name != "stalled" or "stacks" in e)]


def test_a_trainer_that_crashes_before_any_checkpoint_ends_no_progress_after_three_attempts(tmp_path):
    run_dir, env = make_run(tmp_path, [{"crash": "boom"}])
    update_state(run_dir, budget=Budget(crash_max=5))  # a crash budget larger than the brake
    code = Supervisor(run_dir, env, poll=0.05).run()
    st = read_state(run_dir)
    assert (code, st.status) == (16, RunStatus.NO_PROGRESS)
    assert len(configs_seen(tmp_path)) == 6  # max(3, crash_max + 1) attempts
    assert st.no_progress_attempts == 6 and "without a new checkpoint" in st.message


def test_the_default_brake_is_three_attempts(tmp_path):
    run_dir, env = make_run(tmp_path, [{"crash": "boom"}])
    update_state(run_dir, budget=Budget(crash_max=2))
    assert Supervisor(run_dir, env, poll=0.05).run() == 16
    assert len(configs_seen(tmp_path)) == 3


def test_a_trainer_that_saves_between_crashes_keeps_going_past_the_crash_budget(tmp_path):
    script = [{"train": True, "steps": 16, "save_steps": 4, "crash_after_saves": 1}]
    run_dir, env = make_run(tmp_path, script)  # crash budget 1 (make_run)
    code = Supervisor(run_dir, env, poll=0.05).run()
    st = read_state(run_dir)
    # checkpoints 4, 8, 12, 16: a crash after each, the last one at the end of training
    assert [c["step"] for c in _events(run_dir, "checkpoint")] == [4, 8, 12, 16]
    assert st.last_checkpoint == 16 and st.best_checkpoint == 16
    assert (code, st.status) == (0, RunStatus.SUCCEEDED) and len(configs_seen(tmp_path)) == 5
    retries = [e["message"] for e in _events(run_dir, "retry")]
    assert all(m.startswith("[1/1] crash") for m in retries)  # the budget refilled each time


def test_a_hung_trainer_is_stalled_its_stacks_dumped_and_it_is_resumed(tmp_path):
    script = [
        {"train": True, "steps": 12, "save_steps": 4, "hang_at": 6, "step_sleep": 0.02},
        {"train": True, "steps": 12, "save_steps": 4, "step_sleep": 0.02},
    ]
    run_dir, env = make_run(tmp_path, script)
    update_state(run_dir, stall_timeout=1.5)
    t0 = time.monotonic()
    code = Supervisor(run_dir, env, poll=0.05, stop_grace=2).run()
    assert code == 0 and time.monotonic() - t0 < 60
    stalled = _events(run_dir, "stalled")
    assert len(stalled) == 1 and "after step 6" in stalled[0]["message"]
    dump = Path(stalled[0]["stacks"])
    assert dump.is_file() and "fake_trainer" in dump.read_text()
    assert dump.parent == run_dir / "stacks"
    retry = _events(run_dir, "retry")[0]["message"]
    assert "[1/2] stalled at step 6" in retry and "from checkpoint-4" in retry
    steps = [json.loads(x)["current_steps"] for x in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]  # resumed from checkpoint-4
    st = read_state(run_dir)
    assert st.status is RunStatus.SUCCEEDED and st.stall["timeout_s"] == 1.5


def test_a_run_that_stalls_every_time_ends_stalled_with_its_code(tmp_path):
    script = [{"train": True, "steps": 12, "save_steps": 4, "hang_at": 2}]
    run_dir, env = make_run(tmp_path, script)
    update_state(run_dir, stall_timeout=1.0, budget=Budget(stall_max=1, crash_max=1))
    code = Supervisor(run_dir, env, poll=0.05, stop_grace=2).run()
    st = read_state(run_dir)
    assert (code, st.status, st.failure_kind) == (15, RunStatus.STALLED, FailureKind.STALLED)
    assert len(_events(run_dir, "stalled")) == 2 and "stalled 2 times" in st.message


def test_a_requeued_slurm_job_of_a_run_the_brake_ended_stays_down(tmp_path, monkeypatch):
    from ftlaunch.run.slurm import job

    run_dir, env = make_run(tmp_path, [{"ok": True}])
    update_state(run_dir, status=RunStatus.NO_PROGRESS, message="3 attempts in a row ended without a new checkpoint")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert job.main([str(run_dir)], poll=0.01) == 16
    assert not (tmp_path / "counter").exists()  # no trainer, no supervisor started
    assert [e["status"] for e in read_events(run_dir) if e["event"] == "slurm_not_resumed"] == ["no_progress"]


def test_the_next_attempt_waits_until_the_old_trainers_gpu_memory_is_released(tmp_path):
    import functools

    from ftlaunch.run.gpuwait import wait_gpu_released

    run_dir, env = make_run(tmp_path, [{"crash": "boom"}, {"ok": True}])  # planned for one A10G
    readings = iter([300.0, 9000.0, 9000.0, 310.0])  # before the first attempt, then while the old one frees
    asked: list[set[int]] = []

    def probes(pids, visible):
        asked.append(set(pids))
        return (lambda: True), (lambda: next(readings, 310.0))

    wait = functools.partial(wait_gpu_released, poll_s=0.01, bound_s=5.0)
    assert Supervisor(run_dir, env, poll=0.05, gpu_probes=probes, gpu_wait=wait).run() == 0
    waits = [e for e in read_events(run_dir) if e["event"] == "gpu_wait"]
    assert len(waits) == 1 and waits[0]["released"] is True and "310 MiB in use, 300 MiB before" in waits[0]["message"]
    assert asked[0] == set() and len(asked[1]) >= 1  # the baseline, then the first attempt's trainer


def _mount_tmpfs(path: Path, size: str) -> bool:
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0


def test_a_full_ftlaunch_home_does_not_kill_the_trainer_and_is_said_once_it_has_room(tmp_path):
    import os
    import subprocess
    import threading

    import pytest

    home = tmp_path / "home"
    if not _mount_tmpfs(home, "2m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        script = [{"train": True, "steps": 60, "save_steps": 100, "step_sleep": 0.05}]
        run_dir, env = make_run(tmp_path, script)
        assert str(run_dir).startswith(str(home))
        filler = home / "filler"

        def fill_then_free():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (tmp_path / "out" / "trainer_log.jsonl").exists():
                time.sleep(0.02)
            with open(filler, "wb") as f:  # fill every block left
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            time.sleep(2.0)  # progress is written every second: some of it is lost
            os.unlink(filler)

        t = threading.Thread(target=fill_then_free)
        t.start()
        code = Supervisor(run_dir, env, poll=0.05).run()
        t.join()
        st = read_state(run_dir)
        assert code == 0 and st.status is RunStatus.SUCCEEDED and (st.progress or {}).get("step") == 60
        log = (run_dir / "train.log").read_text()
        assert "could not be written while its folder refused writes" in log
        assert "the trainer kept running" in log
    finally:
        subprocess.run(["umount", "-l", str(home)])


def test_a_trainer_that_exits_0_without_a_step_did_not_succeed(tmp_path):
    run_dir, env = make_run(tmp_path, [{"ok": True, "steps": 0}])
    assert Supervisor(run_dir, env, poll=0.05).run() == 1
    st = read_state(run_dir)
    assert (st.status, st.failure_kind) == (RunStatus.FAILED, FailureKind.CONFIG)
    assert "without a single optimizer step" in st.message and len(configs_seen(tmp_path)) == 1


def test_a_missing_package_is_a_setup_error_not_a_crash_to_retry():
    from ftlaunch.run.recovery import classify

    log = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'deepspeed'\n"
    assert classify(1, log).kind is FailureKind.SETUP  # never retried (tests/run/test_import_death.py)


def test_enospc_while_saving_ends_disk_full_after_one_attempt_keeping_complete_checkpoints(tmp_path):
    run_dir, env = make_run(tmp_path, [{"train": True, "steps": 12, "save_steps": 4, "enospc_at": 8}])
    code = Supervisor(run_dir, env, poll=0.05).run()
    st = read_state(run_dir)
    assert (code, st.status, st.failure_kind) == (17, RunStatus.DISK_FULL, FailureKind.DISK_FULL)
    assert len(configs_seen(tmp_path)) == 1  # never retried blindly
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-4"]
    assert "Errno 28" in st.message and "removed the partial checkpoint-8" in st.message
    assert "kept every complete checkpoint (last: checkpoint-4)" in st.message and "free" in st.message
    assert [e["names"] for e in read_events(run_dir) if e["event"] == "partial_checkpoint_removed"] == [
        ["checkpoint-8"]
    ]


def test_the_oom_ladders_offload_rung_keeps_the_plans_processes(tmp_path, monkeypatch):
    """Offload on several GPUs runs as many processes as the plan (issue 21 case 1, at recovery)."""
    import importlib.util
    import json as _json

    from ftlaunch.run import supervisor as sup
    from ftlaunch.run.launch import create_run
    from ftlaunch.run.prepare import PlanRequest, make_plan
    from tests.fake_trainer import install, write_config

    src = write_config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=8)
    env = {
        "FTLAUNCH_HOME": str(tmp_path / "home"),
        "PATH": "/usr/bin:/bin",
        "FAKE_TRAINER_SCRIPT": _json.dumps([{"oom": True}, {"oom": True}, {"ok": True}]),
        "FAKE_TRAINER_COUNTER": str(tmp_path / "counter"),
        "FTLAUNCH_LLAMAFACTORY_CLI": str(install(tmp_path)),
    }
    loaded, p = make_plan(PlanRequest(config=str(src), gpu="A10Gx4", params="0.5B"), env)
    run_dir = create_run(loaded, p, env)
    real = importlib.util.find_spec
    monkeypatch.setattr(sup.importlib.util, "find_spec", lambda n, *a: object() if n == "deepspeed" else real(n, *a))
    assert Supervisor(run_dir, env, poll=0.05).run() == 0
    cfgs = configs_seen(tmp_path)
    assert cfgs[1]["per_device_train_batch_size"] == 1 and "offload" in str(cfgs[2].get("deepspeed"))
    assert read_state(run_dir).trainer_env["NPROC_PER_NODE"] == "4"


def test_a_v1_trainers_step_records_count_as_progress():
    from ftlaunch.run.progress import latest_progress, parse_trainer_log

    text = '{"loss": 2.5, "step": 1, "total_steps": 4}\n{"loss": 2.1, "step": 2, "total_steps": 4}\n'
    recs = parse_trainer_log(text)
    assert [r["current_steps"] for r in recs] == [1, 2]
    assert latest_progress(recs).step == 2 and latest_progress(recs).total_steps == 4


def test_the_oom_ladder_of_a_v1_config_edits_v1_keys_only():
    oom = Exit(FailureKind.CUDA_OOM, "CUDA out of memory")
    d = decide(oom, {"micro_batch_size": 8, "global_batch_size": 64}, Budget())
    assert d.action is Action.RETRY and d.edits == {"micro_batch_size": 4}
    end = decide(oom, {"micro_batch_size": 1, "global_batch_size": 64}, Budget())
    assert end.action is Action.FAIL and "USE_V1" in end.message
