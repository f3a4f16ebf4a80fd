"""Faults and bad input (issue 13): nothing trained by mistake, nothing lost, no tracebacks.

Each test names the issue's case it covers; docs/reliability.md lists them as a fault matrix.
The trainer is tests/fake_trainer.py (scripted), run by the real supervisor.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.errors import StateError
from ftlaunch.run.recovery import classify, decide, oom_numbers, oom_step
from ftlaunch.run.state import Budget
from ftlaunch.run.store import read_events, read_state, update_state
from ftlaunch.run.supervisor import Supervisor
from ftlaunch.run.view import find_run

from ..conftest import needs_train_stack
from ..fake_trainer import configs_seen, install, write_checkpoint, write_config
from ..helpers import said

OOM_MSG = (
    "Traceback\n  File x, in training_step\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
    "1.79 GiB. GPU 0 has a total capacity of 31.73 GiB of which 1.43 GiB is free."
)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The scripted trainer for in-process commands; returns a function that sets its script."""
    monkeypatch.setenv("FTLAUNCH_LLAMAFACTORY_CLI", str(install(tmp_path)))
    monkeypatch.setenv("FAKE_TRAINER_COUNTER", str(tmp_path / "counter"))

    def script(*steps: dict) -> None:
        monkeypatch.setenv("FAKE_TRAINER_SCRIPT", json.dumps(list(steps)))

    script({"ok": True})
    return script


def starts(tmp_path: Path) -> int:
    counter = tmp_path / "counter"
    return int(counter.read_text()) if counter.exists() else 0


config = write_config


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def train(cfg: Path, *more: str):
    return cli("train", str(cfg), "--gpu", "A10G", "--foreground", *more)


def runs(home: Path) -> list[Path]:
    root = home / "runs"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


# ---------------------------------------------------------------- case 1: a run owns its output_dir


def test_case1_foreign_checkpoints_are_refused_with_the_ways_on(tmp_path, fake, isolated_home):
    write_checkpoint(tmp_path / "out", 4)
    r = train(config(tmp_path, overwrite_output_dir=True))
    assert r.exit_code == 7, r.output
    assert "checkpoint-4" in r.output and "--resume-existing" in r.output and "--fresh" in r.output
    assert starts(tmp_path) == 0 and runs(isolated_home) == []  # nothing trained, no run made


def test_case1_fresh_moves_the_old_content_aside_and_deletes_nothing(tmp_path, fake, isolated_home):
    old = write_checkpoint(tmp_path / "out", 4)
    (tmp_path / "out" / "notes.txt").write_text("mine")
    r = train(config(tmp_path), "--fresh")
    assert r.exit_code == 0, r.output
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.old-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint-4" / "optimizer.pt").exists()
    assert (aside[0] / "notes.txt").read_text() == "mine" and not old.exists()
    assert read_state(runs(isolated_home)[0]).output_dir_moved_to == str(aside[0])


def test_case1_resume_existing_continues_them_and_records_it(tmp_path, fake, isolated_home):
    write_checkpoint(tmp_path / "out", 4)
    r = train(config(tmp_path), "--resume-existing")
    assert r.exit_code == 0, r.output
    run_dir = runs(isolated_home)[0]
    assert read_state(run_dir).adopted_checkpoint == "checkpoint-4"
    assert any(e["event"] == "output_dir_claimed" for e in read_events(run_dir))
    assert [e for e in read_events(run_dir) if e["event"] == "attempt_started"][0]["resume_from"] == "checkpoint-4"


def test_case1_own_unfinished_run_continues_a_succeeded_one_is_not_silently_redone(tmp_path, fake, isolated_home):
    cfg = config(tmp_path)
    fake({"config_error": "boom: must be fixed"})
    assert train(cfg).exit_code == 1  # an ftlaunch run of this config, failed
    (first,) = runs(isolated_home)
    write_checkpoint(tmp_path / "out", 4)
    fake({"ok": True})
    assert train(cfg).exit_code == 0  # its checkpoints are this config's: continued
    (second,) = [r for r in runs(isolated_home) if r != first]
    assert "continuing run" in read_state(second).adopted_because
    r = train(cfg)  # that one succeeded: a fresh train would train nothing and say "succeeded"
    assert r.exit_code == 7 and said("already succeeded", r.output)
    assert starts(tmp_path) == 2


# ---------------------------------------------------------------- case 4: the OOM ladder


def test_case4_ladder_reaches_the_micro_batch_that_fits_within_the_budget(tmp_path, fake, isolated_home):
    # The case: 64 planned, the card runs out above 2 from step 12 (after checkpoint-10).
    fake({"oom_above": 2, "from_step": 12, "steps": 20, "save_steps": 10})
    r = train(config(tmp_path, per_device_train_batch_size=64, gradient_accumulation_steps=1))
    assert r.exit_code == 0, r.output
    micro = [c["per_device_train_batch_size"] for c in configs_seen(tmp_path)]
    assert micro[0] == 64 and micro[-1] == 2 and len(micro) <= 5  # before: 64 32 16 8 4, then gave up
    assert all(
        c["per_device_train_batch_size"] * c["gradient_accumulation_steps"] == 64 for c in configs_seen(tmp_path)
    )


def test_case4_ladder_always_reaches_micro_batch_one_then_checkpointing_then_offload():
    cfg = {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1, "disable_gradient_checkpointing": True}
    ex, budget, seen = classify(1, OOM_MSG), Budget(oom_max=2), []
    while (d := decide(ex, cfg, budget, offload_ok=True)).action == "retry":
        cfg, budget = {**cfg, **d.edits}, d.budget
        seen.append(d.edits)
    assert {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 64} in seen
    assert seen[-2:] == [{"disable_gradient_checkpointing": False}, {"deepspeed": "ds_z3_offload"}]
    assert "does not fit" in d.message and "next try" in d.message and "LoRA" in d.message


def test_case4_oom_numbers_jump_past_halving():
    assert oom_numbers(OOM_MSG) == {"tried_gib": 1.79, "free_gib": 1.43, "total_gib": 31.73}
    old_style = (
        "Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.2 GiB already allocated; 5.00 MiB free"
    )
    assert oom_numbers(old_style)["total_gib"] == 15.78
    assert oom_numbers("CUBLAS_STATUS_ALLOC_FAILED") == {}
    cfg = {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1}
    huge = {"tried_gib": 200.0, "free_gib": 1.0, "total_gib": 80.0}  # at most 64 x 72 / 279 = 16.5 can fit
    assert oom_step(cfg, False)[0]["per_device_train_batch_size"] == 32
    assert oom_step(cfg, False, numbers=huge)[0]["per_device_train_batch_size"] == 16


def test_case4_budget_counts_distinct_configurations():
    cfg = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    ex = classify(1, OOM_MSG)
    d = decide(ex, cfg, Budget(oom_max=3))
    again = decide(ex, cfg, d.budget)  # the same configuration failing again costs nothing more
    assert d.budget.tried == again.budget.tried and again.budget.oom_used == 1


# ---------------------------------------------------------------- case 5: torn and foreign lines


def _finished_run(tmp_path, fake, isolated_home) -> Path:
    assert train(config(tmp_path)).exit_code == 0
    return runs(isolated_home)[0]


@needs_train_stack
def test_case5_torn_multibyte_and_foreign_lines_are_skipped_and_said_once(tmp_path, fake, isolated_home, capsys):
    run_dir = _finished_run(tmp_path, fake, isolated_home)
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write('{"event": "note", "text": "caf\u00e9"}\n'.encode()[:-4] + b"\n")  # a torn UTF-8 character
        f.write(b'42\n[1, 2]\n{"no_event": 1}\n')  # foreign lines
    events = read_events(run_dir)
    assert events and all(isinstance(e["event"], str) for e in events)
    read_events(run_dir)
    assert capsys.readouterr().err.count("skipped 4 unreadable line(s)") == 1
    for args in (
        ("status", run_dir.name, "--json"),
        ("runs", "--json"),
        ("plot", run_dir.name, "--out", str(tmp_path / "p.png")),
    ):
        r = cli(*args)
        assert r.exit_code == 0 and "Traceback" not in r.output, r.output


def test_case5_torn_trainer_log_does_not_break_progress(tmp_path, fake, isolated_home):
    from ftlaunch.run.progress import parse_trainer_log

    data = b'{"current_steps": 1, "loss": 2.0}\n{"current_steps": "x"}\n\xe2\x82\n{"current_steps": 2, "lo'
    assert [r["current_steps"] for r in parse_trainer_log(data)] == [1]


def test_case5_a_bad_byte_in_state_is_exit_12_not_a_traceback(tmp_path, fake, isolated_home):
    run_dir = _finished_run(tmp_path, fake, isolated_home)
    raw = (run_dir / "state.json").read_bytes()
    (run_dir / "state.json").write_bytes(raw[:20] + b"\xff" + raw[21:])
    r = cli("status", run_dir.name)
    assert r.exit_code == 12 and "unreadable" in r.output


@pytest.mark.parametrize("value", ["-2", "0", "-1"])
def test_case5_6_a_bad_batch_is_exit_3_naming_the_key(tmp_path, value):
    r = cli("plan", str(config(tmp_path)), f"per_device_train_batch_size={value}", "--gpu", "A10G")
    assert r.exit_code == 3 and "per_device_train_batch_size" in r.output, r.output


def test_case5_unusable_home_is_exit_12_before_anything_starts(tmp_path, fake, monkeypatch):
    (tmp_path / "home-file").write_text("x")
    monkeypatch.setenv("FTLAUNCH_HOME", str(tmp_path / "home-file" / "ftl"))
    r = train(config(tmp_path))
    assert r.exit_code == 12 and "FTLAUNCH_HOME" in r.output and starts(tmp_path) == 0


def test_case5_hardware_file_of_the_wrong_shape_is_exit_4(tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text('{"gpus": "x"}')
    r = cli("plan", str(config(tmp_path)), "--hardware", str(hw))
    assert r.exit_code == 4 and "malformed: gpus must be a list" in " ".join(r.output.split())


# ---------------------------------------------------------------- case 6: invalid values


@pytest.mark.parametrize(
    "over,key",
    [
        ("gradient_accumulation_steps=0", "gradient_accumulation_steps"),
        ("num_train_epochs=0", "num_train_epochs"),
        ("max_steps=0", "max_steps"),
        ("per_device_eval_batch_size=0", "per_device_eval_batch_size"),
    ],
)
def test_case6_invalid_values_are_named_not_replaced(tmp_path, fake, isolated_home, over, key):
    r = train(config(tmp_path), over)
    assert r.exit_code == 3 and key in r.output and starts(tmp_path) == 0


def test_case6_empty_yaml_is_refused(tmp_path, fake):
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    r = train(tmp_path / "empty.yaml")
    assert r.exit_code == 3 and "empty" in r.output and starts(tmp_path) == 0


def test_case6_resume_override_that_changes_the_global_batch_needs_the_flag(tmp_path, fake, isolated_home):
    fake({"config_error": "Undefined dataset x"}, {"ok": True})
    assert train(config(tmp_path)).exit_code == 1
    run_dir = runs(isolated_home)[0]
    r = cli("resume", run_dir.name, "per_device_train_batch_size=-1", "--foreground")
    assert r.exit_code == 3 and "per_device_train_batch_size" in r.output
    r = cli("resume", run_dir.name, "per_device_train_batch_size=3", "--foreground")
    assert r.exit_code == 3 and said("global batch: 4 -> 6", r.output) and "--allow-global-batch-change" in r.output
    assert starts(tmp_path) == 1
    r = cli("resume", run_dir.name, "per_device_train_batch_size=3", "--foreground", "--allow-global-batch-change")
    assert r.exit_code == 0, r.output
    assert configs_seen(tmp_path)[-1]["per_device_train_batch_size"] == 3
    r = cli("resume", run_dir.name, "per_device_train_batch_size=1", "gradient_accumulation_steps=6")
    assert r.exit_code == 0  # a succeeded run is left alone; the same global batch needs no flag


# ---------------------------------------------------------------- case 7: unwritable output_dir


def test_case7_unwritable_output_dir_is_found_before_started(tmp_path, fake, isolated_home):
    (tmp_path / "a-file").write_text("x")
    r = cli("train", str(config(tmp_path, output_dir=str(tmp_path / "a-file" / "out"))), "--gpu", "A10G")
    assert r.exit_code == 3 and said("not writable", r.output) and "started" not in r.output
    assert runs(isolated_home) == [] and starts(tmp_path) == 0


# ---------------------------------------------------------------- case 8: secrets


def test_case8_secret_config_keys_never_reach_disk_in_clear(tmp_path, fake, isolated_home):
    token, key = "hf_SeCrEtToKeN12345", "sk-ApIkEy98765"
    fake({"print_env": "HF_TOKEN", "ok": True})
    cfg = config(tmp_path, hub_token=token)
    r = train(cfg, f"swanlab_api_key={key}")
    assert r.exit_code == 0, r.output
    assert token not in r.output and key not in r.output
    seen = configs_seen(tmp_path)[0]
    assert "hub_token" not in seen and "swanlab_api_key" not in seen  # through the environment (issue 24)
    run_dir = runs(isolated_home)[0]
    assert "printed ***" in (run_dir / "train.log").read_text()  # the trainer's HF_TOKEN is the token
    written = [p for p in (*isolated_home.rglob("*"), *(tmp_path / "out").rglob("*")) if p.is_file()]
    holders = [p for p in written if token.encode() in p.read_bytes() or key.encode() in p.read_bytes()]
    assert [p.name for p in holders] == ["secrets.json"]
    assert stat.S_IMODE(os.stat(holders[0]).st_mode) == 0o600
    assert not (run_dir / ".trainer-config.yaml").exists()  # the trainer's copy is gone after the attempt


# ---------------------------------------------------------------- case 9: state of another version


def test_case9_state_of_an_unknown_version_is_refused_never_overwritten(tmp_path, fake, isolated_home):
    run_dir = _finished_run(tmp_path, fake, isolated_home)
    future = {**read_state(run_dir).to_json(), "version": 99, "budget": {"oom_max": 9}}
    (run_dir / "state.json").write_text(json.dumps(future))
    with pytest.raises(StateError, match="version 99"):
        update_state(run_dir, progress={"step": 1})
    assert cli("status", run_dir.name).exit_code == 12
    r = cli("resume", run_dir.name, "--foreground")  # not rebuilt over either
    assert r.exit_code == 12 and "version 99" in " ".join(r.output.split())
    assert json.loads((run_dir / "state.json").read_text()) == future
    assert not list(run_dir.glob("state.json.corrupt-*"))


def test_case9_keys_of_another_minor_version_are_kept_and_an_unknown_status_is_refused(tmp_path, fake, isolated_home):
    run_dir = _finished_run(tmp_path, fake, isolated_home)
    newer = {**read_state(run_dir).to_json(), "future_field": {"a": [1, 2]}}
    (run_dir / "state.json").write_text(json.dumps(newer))
    state = update_state(run_dir, message="edited")
    assert state.extra == {"future_field": {"a": [1, 2]}} and state.message == "edited"
    assert json.loads((run_dir / "state.json").read_text())["future_field"] == {"a": [1, 2]}
    unknown = {**newer, "status": "hibernating"}
    (run_dir / "state.json").write_text(json.dumps(unknown))
    with pytest.raises(StateError, match="hibernating"):
        update_state(run_dir, message="x")
    r = cli("resume", run_dir.name, "--foreground")  # not rebuilt over
    assert r.exit_code == 12 and json.loads((run_dir / "state.json").read_text()) == unknown
    assert not list(run_dir.glob("state.json.corrupt-*"))


# ---------------------------------------------------------------- case 10


def test_case10_recovering_ends_once_the_trainer_passes_the_failed_step(tmp_path, fake, isolated_home):
    fake({"oom_above": 2, "from_step": 12, "steps": 40, "save_steps": 10})
    assert train(config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1)).exit_code == 0
    run_dir = runs(isolated_home)[0]
    events = read_events(run_dir)
    recovered = [e for e in events if e["event"] == "recovered"]
    assert len(recovered) == 1 and recovered[0]["step"] > 12 and recovered[0]["attempt"] == 2


def test_case10_recovering_status_during_a_resumed_attempt(tmp_path):
    from ftlaunch.run.state import RunStatus

    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"ok": True, "steps": 6}])
    update_state(run_dir, attempt=1, progress={"step": 3})  # a run that reached step 3, then was resumed
    statuses = []
    sup = Supervisor(run_dir, env, poll=0.01)
    original = sup._attempt

    def watch(*a, **kw):
        statuses.append(read_state(run_dir).status)
        return original(*a, **kw)

    sup._attempt = watch
    assert sup.run() == 0
    assert statuses == [RunStatus.RECOVERING.value]
    assert any(e["event"] == "recovered" and e["step"] > 3 for e in read_events(run_dir))


def test_case10_a_truncated_state_keeps_the_run_findable_by_name(tmp_path, fake, isolated_home):
    run_dir = _finished_run(tmp_path, fake, isolated_home)
    name = read_state(run_dir).name
    (run_dir / "state.json").write_text('{"version": 1, "na')
    assert find_run(dict(os.environ), name) == run_dir


def test_case2_a_stop_while_the_run_is_being_started_waits_for_its_supervisor(tmp_path):
    import threading
    import time

    from ftlaunch.run.control import _wait_while_starting
    from ftlaunch.run.outdir import acquire_output_lock

    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"ok": True}])
    st = read_state(run_dir)
    assert st.status == "starting" and not st.pid
    assert _wait_while_starting(run_dir, st, env).pid is None  # nobody is starting it: no wait
    lock = acquire_output_lock(env, st.output_dir, run_dir.name)  # a `resume` in the middle of starting

    def supervisor_takes_over():
        time.sleep(0.3)
        update_state(run_dir, pid=os.getpid(), status="running")
        lock.close()

    threading.Thread(target=supervisor_takes_over).start()
    assert _wait_while_starting(run_dir, st, env).pid == os.getpid()  # a stop now reaches that pid


def test_case2_a_stop_that_read_the_state_just_before_the_supervisor_wrote_its_pid_reads_it_again(
    tmp_path, monkeypatch
):
    """The race the test above met under load, made certain: the stop finds the lock busy and reads the
    state (no pid yet); the supervisor then writes its pid and lets go of the lock (its run ended) before
    the stop's next try, which gets the lock. The stop goes on with the state as it is now, not as read."""
    from ftlaunch.run import outdir
    from ftlaunch.run.control import _wait_while_starting

    from .test_recovery import make_run

    run_dir, env = make_run(tmp_path, [{"ok": True}])
    st = read_state(run_dir)
    real, tries = outdir.acquire_output_lock, []

    def acquire(env, output_dir, run_id):
        tries.append(run_id)
        if len(tries) == 1:  # the starter holds it; the stop sleeps, then reads a state with no pid
            raise outdir.OutputDirBusy(output_dir, run_dir.name)
        update_state(run_dir, pid=os.getpid())  # after that read: the supervisor took over, and let go
        return real(env, output_dir, run_id)

    monkeypatch.setattr(outdir, "acquire_output_lock", acquire)
    assert _wait_while_starting(run_dir, st, env).pid == os.getpid()
    assert len(tries) == 2


def test_a_new_run_never_replaces_a_folder_already_under_its_id(tmp_path, fake, isolated_home, monkeypatch):
    """create_folder's rename met a runs/<id> that was there already (ENOTEMPTY under load, once): a new
    run is refused with a clear StateError (exit 12), whatever is there is left as it was (a full or an
    empty folder, a file), nothing hidden is left behind, and the output_dir is free for the next train."""
    from ftlaunch.run import prepare

    taken = "20260101-000000-abcd"
    root = isolated_home / "runs"
    for kind in ("full", "empty", "file"):
        dest = root / taken
        if kind == "file":
            dest.write_text("not a run")
        else:
            dest.mkdir(parents=True)
            if kind == "full":
                (dest / "state.json").write_text('{"someone": "else"}')
        with monkeypatch.context() as m:
            m.setattr(prepare, "new_run_id", lambda: taken)
            r = train(config(tmp_path))
        assert r.exit_code == 12, r.output
        assert "already exists" in r.output and "Traceback" not in r.output
        if kind == "file":
            assert dest.read_text() == "not a run"
            dest.unlink()
        else:
            assert [x.name for x in dest.iterdir()] == (["state.json"] if kind == "full" else [])
            if kind == "full":
                assert (dest / "state.json").read_text() == '{"someone": "else"}'
            for x in dest.iterdir():
                x.unlink()
            dest.rmdir()
        assert list(root.iterdir()) == []  # no hidden .<id>.tmp left
    r = train(config(tmp_path))  # the lock was let go: the next run starts
    assert r.exit_code == 0, r.output
    assert starts(tmp_path) == 1


def test_the_latest_run_is_the_last_created_even_within_one_second(tmp_path, isolated_home):
    from ftlaunch.run.store import list_runs

    root = isolated_home / "runs"
    for name in ("20260101-000000-ffff", "20260101-000000-0000"):  # created in this order, same second
        (root / name).mkdir(parents=True)
        (root / name / "source.yaml").write_text("x")
        os.utime(root / name / "source.yaml", ns=(1, 10**9 if name.endswith("ffff") else 2 * 10**9))
    assert [p.name for p in list_runs(dict(os.environ))] == ["20260101-000000-ffff", "20260101-000000-0000"]
    assert find_run(dict(os.environ), None).name == "20260101-000000-0000"
