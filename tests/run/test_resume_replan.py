"""`resume RUN --gpu ...` at the plan level (issue 34), no GPU and no real trainer: the ddp_backend that
ftlaunch set for CPU processes (gloo; none for one process) is taken back when a run is re-planned onto
GPUs, the user's own value restored, and set again when it moves back to the CPU; what-if cards from
the catalog stand for the GPUs. A typo'd card is a clear error (exit 4) listing the catalog's names,
before the run is touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.plan.change import REMOVED
from ftlaunch.plan.hardware import catalog_hardware
from ftlaunch.plan.planner import plan
from ftlaunch.run.control import data_order_warnings, examples_in_log, own_values, preview_replan
from ftlaunch.run.store import read_state

from ..fake_trainer import write_config
from ..helpers import said
from .test_reliability import fake  # noqa: F401  (the scripted trainer, in-process)

CFG = {"stage": "sft", "do_train": True, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}


def _rows(changes) -> dict:
    return {c.key: (c.old, c.new) for c in changes}


# ------------------------------------------------------------------ pure: the planner and the records


@pytest.mark.parametrize(("own", "after"), [(None, REMOVED), ("nccl", "nccl")])
def test_gloo_set_for_cpu_processes_is_taken_back_on_gpus(own, after):
    adapted = {**CFG, "ddp_backend": "gloo", "bf16": False}
    p = plan(adapted, catalog_hardware("A100-80GBx2"), meta={"world_size": 2, "own_values": {"ddp_backend": own}})
    assert _rows(p.changes)["ddp_backend"] == ("gloo", after)
    assert p.config.get("ddp_backend") == own
    assert p.env == {"FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"}
    reason = next(c.reason for c in p.changes if c.key == "ddp_backend")
    assert said("ftlaunch's choice for the CPU is taken back", reason)


def test_a_users_own_gloo_on_gpus_is_kept():
    p = plan({**CFG, "ddp_backend": "gloo"}, catalog_hardware("A100-80GBx2"), meta={"world_size": 2})
    assert "ddp_backend" not in _rows(p.changes) and p.config["ddp_backend"] == "gloo"


def test_the_reverse_gpus_onto_cpu_processes_get_gloo_and_one_cpu_process_none():
    nccl = {**CFG, "ddp_backend": "nccl"}
    two = plan(nccl, catalog_hardware("nonex2"), meta={"world_size": 2})
    assert _rows(two.changes)["ddp_backend"] == ("nccl", "gloo")
    one = plan(nccl, catalog_hardware("none"), meta={"world_size": 2})
    assert _rows(one.changes)["ddp_backend"] == ("nccl", REMOVED)


def test_own_values_follow_the_runs_records_in_order():
    created_on_cpu = [{"key": "ddp_backend", "old": None, "new": "gloo"}]
    assert own_values(created_on_cpu, []) == {"ddp_backend": None}
    assert own_values([], []) == {}  # never set by ftlaunch: the config's value is the user's
    to_cpu = {"event": "replanned", "changes": [{"key": "ddp_backend", "old": "nccl", "new": "gloo"}]}
    back = {"event": "replanned", "changes": [{"key": "ddp_backend", "old": "gloo", "new": None}]}
    assert own_values([], [to_cpu]) == {"ddp_backend": "nccl"}
    assert own_values([], [to_cpu, back, to_cpu]) == {"ddp_backend": "nccl"}  # the first value is the user's
    edited = {"event": "config_edited", "before": {"ddp_backend": "gloo"}, "after": {"ddp_backend": "gloo"}}
    assert own_values(created_on_cpu, [edited]) == {}  # typed by the user: it stands


# ------------------------------------------------------------------ a run's folder: preview_replan


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def _run(tmp_path: Path, home: Path, gpu: str, exit_code: int | None = 0, **over) -> Path:
    cfg = write_config(tmp_path, **over)
    r = _cli("train", str(cfg), "--gpu", gpu, "--foreground")
    assert exit_code is None or r.exit_code == exit_code, r.output
    return next(p for p in (home / "runs").iterdir() if not p.name.startswith("."))


@pytest.mark.usefixtures("fake")
def test_a_run_of_two_cpu_processes_replanned_onto_two_gpus_drops_gloo(tmp_path, isolated_home):
    run_dir = _run(tmp_path, isolated_home, "nonex2")
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["ddp_backend"] == "gloo"
    r = preview_replan(run_dir, catalog_hardware("A100-80GBx2"))
    rows = _rows(r.changes)
    assert rows["ddp_backend"] == ("gloo", REMOVED) and "ddp_backend" not in r.plan.config
    assert "devices" not in rows and (r.world_before, r.world_after) == (2, 2)
    assert r.plan.global_batch_target == 4 and r.trainer_env["NPROC_PER_NODE"] == "2"
    # and back to the CPU: gloo again (the planner's CPU rule), on one process none
    assert _rows(preview_replan(run_dir, catalog_hardware("nonex2")).changes).get("ddp_backend") is None
    assert _rows(preview_replan(run_dir, catalog_hardware("none")).changes)["ddp_backend"] == ("gloo", REMOVED)


@pytest.mark.usefixtures("fake")
def test_a_gpu_run_with_its_own_nccl_goes_to_cpu_processes_with_gloo_and_back_with_nccl(tmp_path, isolated_home):
    run_dir = _run(tmp_path, isolated_home, "A100-80GBx2", ddp_backend="nccl")
    to_cpu = preview_replan(run_dir, catalog_hardware("nonex2"))
    assert _rows(to_cpu.changes)["ddp_backend"] == ("nccl", "gloo")
    # what resume writes: the re-planned config and a `replanned` event with its changes
    from ftlaunch.run.control import _apply_replan

    _apply_replan(run_dir, to_cpu)
    back = preview_replan(run_dir, catalog_hardware("A100-80GBx2"))
    assert _rows(back.changes)["ddp_backend"] == ("gloo", "nccl") and back.plan.config["ddp_backend"] == "nccl"


# ------------------------------------------------------------------ the CLI: a typo'd card


@pytest.mark.usefixtures("fake")
def test_resume_with_a_typod_card_is_exit_4_listing_the_cards_and_touches_nothing(tmp_path, isolated_home):
    run_dir = _run(tmp_path, isolated_home, "nonex2")
    before = ((run_dir / "config.yaml").read_text(), (run_dir / "state.json").read_text())
    r = _cli("resume", run_dir.name, "--gpu", "A100-8OGBx2")
    assert r.exit_code == 4, r.output
    assert said("A100-80GB", r.output) and said("H100-80GB", r.output) and said("nonexN", r.output)
    assert ((run_dir / "config.yaml").read_text(), (run_dir / "state.json").read_text()) == before
    assert read_state(run_dir).world_size == 2
    assert not any(json.loads(x)["event"] == "replanned" for x in (run_dir / "events.jsonl").read_text().splitlines())


# ------------------------------------------------------------------ the data order: where it is not kept


def test_the_rows_per_epoch_are_read_from_the_trainers_log():
    log = ["[INFO|trainer.py:1470] >>   Num examples = 64", "...", "[INFO|trainer.py:1470] >>   Num examples = 1,024"]
    assert examples_in_log(log) == 1024 and examples_in_log(["no start yet"]) is None


def test_a_resume_on_another_world_size_warns_where_the_rows_would_differ():
    two = {**CFG, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}  # 2 x 1 x 2 processes
    one = {**CFG, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}  # 2 x 2 x 1
    assert data_order_warnings(two, one, (2, 1), 64) == []  # measured equal (test_e2e_resume_anywhere)
    assert data_order_warnings(two, two, (2, 2), 63) == []  # the same world size: nothing moves
    grouped = data_order_warnings(
        {**two, "train_sampling_strategy": "group_by_length"}, {**one, "train_sampling_strategy": "group_by_length"},
        (2, 1), 64,
    )  # fmt: skip
    assert len(grouped) == 1 and said("data order not kept: train_sampling_strategy group_by_length", grouped[0])
    assert said("per process 2 -> 4", grouped[0]) and said("LengthGroupedSampler", grouped[0])
    short = data_order_warnings(two, one, (2, 1), 62)
    assert len(short) == 1 and said("62 rows = 15 x global batch 4 + 2", short[0])
    assert said("even_batches", short[0])
    streamed = data_order_warnings({**two, "streaming": True}, {**one, "streaming": True}, (2, 1), None)
    assert len(streamed) == 1 and said("data order not verified: streaming", streamed[0])


# ------------------------------------------------------------------ --hardware FILE, and both options


def test_resume_on_a_captured_machine_replans_and_keeps_the_change_in_its_event(tmp_path, isolated_home, request):
    # a run that failed (a config error is not retried); its resume trains
    request.getfixturevalue("fake")({"config_error": "Undefined dataset x"}, {"ok": True})
    run_dir = _run(tmp_path, isolated_home, "nonex2", exit_code=None)
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(catalog_hardware("A100-80GBx2").to_dict()))
    r = _cli("resume", run_dir.name, "--hardware", str(hw), "--foreground")
    assert r.exit_code == 0, r.output
    assert said("ddp_backend gloo (removed)", r.output)
    assert "ddp_backend" not in yaml.safe_load((run_dir / "config.yaml").read_text()), r.output
    replanned = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    replanned = next(e for e in replanned if e["event"] == "replanned")
    assert {c["key"]: c["new"] for c in replanned["changes"]}["ddp_backend"] == REMOVED
    assert replanned["warnings"] == [] and read_state(run_dir).status.value == "succeeded"
    both = _cli("resume", run_dir.name, "--hardware", str(hw), "--gpu", "none")
    assert both.exit_code == 4 and said("--gpu and --hardware both given", both.output)
