# ruff: noqa: F811  (the imported `fake` fixture is taken as a parameter)
"""The recovery policy as one record (issue 32): the command-line options come from its table, it goes
whole into a run's state and comes back out of it, records written before it still read the same,
and `resume` keeps a run's policy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click
import pytest

from ftlaunch.cli.main import main
from ftlaunch.cli.options import recovery_options
from ftlaunch.cli.schedule import schedule_group
from ftlaunch.run import policy as pol
from ftlaunch.run.health import OnDiverge
from ftlaunch.run.options import RunOptions
from ftlaunch.run.policy import OPTIONS, Budget, Kind, Option, RecoveryPolicy, Retries
from ftlaunch.run.recovery import POLICIES
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import read_state, update_state
from ftlaunch.schedule.records import ScheduleRecord

from .test_reliability import cli, config, fake, runs, train  # noqa: F401  (fake: the scripted trainer)

OLD = Path(__file__).resolve().parents[1] / "data" / "policy-main-ed0dbf5"
# What main at ed0dbf5 wrote those records with (tests/data/policy-main-ed0dbf5/README.md).
OLD_POLICY = RecoveryPolicy(Retries(oom=7, crash=5, stall=3), False, OnDiverge.STOP, 900.0)
ODD = ["--max-retries", "7", "--max-crash-retries", "5", "--no-recover", "--on-diverge", "stop"]
ODD += ["--stall-timeout", "900", "--max-stall-restarts", "3"]


def params(command: click.Command) -> dict[str, click.Parameter]:
    return {p.opts[0]: p for p in command.params}


@pytest.mark.parametrize("command", [main.commands["train"], schedule_group.commands["add"]], ids=["train", "add"])
def test_the_recovery_options_are_the_tables_rows(command):
    got = params(command)
    for row in OPTIONS:
        p = got[row.flag]
        assert (p.name, p.help, p.default) == (row.dest, row.help, row.default), row.flag
        assert p.is_flag == (row.kind is Kind.OFF), row.flag
    # every field of the policy, and every budget, is set by exactly one row
    targets = [o.field for o in OPTIONS]
    budgets = [f"retries.{b}" for b in Retries.names()]
    others = [f.name for f in dataclasses.fields(RecoveryPolicy) if f.name != "retries"]
    assert sorted(targets) == sorted(budgets + others)
    assert {p.budget for p in POLICIES.values() if p.budget} <= set(Retries.names())


def test_a_new_row_is_a_new_option(monkeypatch):
    """Adding a budget is a row: the option is generated from it, typed by its kind."""
    row = Option("retries.oom", "--max-oom-halvings", "max_oom_halvings", Kind.COUNT, "A budget of tomorrow.")
    monkeypatch.setattr("ftlaunch.cli.options.OPTIONS", (*OPTIONS, row))
    command = recovery_options(click.Command("x", callback=lambda **kw: None))
    p = params(command)["--max-oom-halvings"]
    assert (p.name, p.default, p.help) == ("max_oom_halvings", 4, "A budget of tomorrow.")
    assert isinstance(p.type, click.IntRange) and (p.type.min, p.type.max) == (0, pol.MAX_RETRIES)


def test_the_options_make_one_policy_carried_whole_to_the_settings():
    kw = {"run_name": "n", "max_retries": 7, "max_crash_retries": 5, "no_recover": True}
    kw |= {"on_diverge": OnDiverge.STOP, "stall_timeout": 900.0, "max_stall_restarts": 3, "config": "c.yaml"}
    opts = RunOptions.from_kwargs(kw)
    assert kw == {"config": "c.yaml"}  # the rest stays for the command
    assert opts.policy == OLD_POLICY and opts.supervisor_settings().policy is opts.policy
    assert RunOptions.from_kwargs({"no_recover": None, "max_retries": None}).policy == RecoveryPolicy()


def test_a_policy_round_trips_through_state_json(tmp_path, fake, isolated_home):
    r = train(config(tmp_path), *ODD)
    assert r.exit_code == 0, r.output
    (run_dir,) = runs(isolated_home)
    state = read_state(run_dir)
    assert RecoveryPolicy.of_state(state) == OLD_POLICY
    raw = json.loads((run_dir / "state.json").read_text())
    assert RecoveryPolicy.of_state(RunState.from_json(json.loads(json.dumps(raw)))) == OLD_POLICY


def test_the_state_keeps_the_keys_it_always_had():
    """A new state's policy reads in an ftlaunch of before the record (it would keep a new key aside
    and run with the default policy): the same keys as tests/data/policy-main-ed0dbf5/state.json."""
    old = json.loads((OLD / "state.json").read_text())
    new = RunState(id="x", **OLD_POLICY.state_fields()).to_json()
    assert set(new["budget"]) == set(old["budget"])
    assert {k: new[k] for k in ("recover", "on_diverge", "stall_timeout")} == {
        k: old[k] for k in ("recover", "on_diverge", "stall_timeout")
    }
    assert {k: v for k, v in new["budget"].items() if k.endswith("_max")} == {
        k: v for k, v in old["budget"].items() if k.endswith("_max")
    }


def test_a_state_written_by_main_before_the_record_reads_with_the_same_policy():
    state = RunState.from_json(json.loads((OLD / "state.json").read_text()))
    assert RecoveryPolicy.of_state(state) == OLD_POLICY
    assert (state.budget.oom_max, state.budget.crash_max, state.budget.stall_max) == (7, 5, 3)
    assert state.budget.used == Retries.zero() and state.budget.tried == ()
    assert RunState.from_json(state.to_json()) == state  # written back, it reads the same


def test_a_schedule_record_written_before_the_record_reads_and_writes_back_the_same():
    data = json.loads((OLD / "schedule.json").read_text())
    rec = ScheduleRecord.from_json(data, "schedule.json")
    assert rec.run.policy == OLD_POLICY and rec.run.run_name == "old-policy" and rec.extra == {}
    assert rec.to_json() == data
    assert RunOptions.from_dict(RunOptions(policy=OLD_POLICY).to_dict()).policy == OLD_POLICY


def test_budget_spells_its_budgets_as_state_json_does():
    b = Budget(crash_max=5, stall_used=1, tried=["mb4"])
    assert (b.limits, b.used, b.tried) == (Retries(crash=5), Retries(0, 0, 1), ("mb4",))
    assert (b.crash_max, b.stall_used, b.most("oom"), b.spent("stall")) == (5, 1, 4, 1)
    assert Budget.from_json(b.to_json()) == b and dataclasses.replace(b, tried=()) == Budget(crash_max=5, stall_used=1)
    assert b.refilled() == Budget(Retries(crash=5)) and b.spending("oom", 2).oom_used == 2
    with pytest.raises(TypeError, match="crash_maxx"):
        Budget(crash_maxx=1)
    with pytest.raises(AttributeError):
        _ = b.crash_min


def test_resume_keeps_the_runs_policy(tmp_path, fake, isolated_home):
    fake({"crash": "boom"})
    r = train(config(tmp_path), *[a for a in ODD if a != "--no-recover"], "--max-crash-retries", "1")
    assert r.exit_code != 0, r.output
    (run_dir,) = runs(isolated_home)
    ran = read_state(run_dir)
    assert ran.status is RunStatus.FAILED and ran.budget.crash_used == 1
    policy = dataclasses.replace(OLD_POLICY, retries=Retries(7, 1, 3), recover=True)
    assert RecoveryPolicy.of_state(ran) == policy
    fake({"ok": True})
    assert cli("resume", run_dir.name, "--foreground").exit_code == 0
    resumed = read_state(run_dir)
    assert resumed.status is RunStatus.SUCCEEDED and RecoveryPolicy.of_state(resumed) == policy
    assert resumed.budget.used == Retries.zero()  # a resume by hand refills what was used, not the maxima


def test_a_hand_edited_budget_keeps_the_rest_of_the_policy(tmp_path, fake, isolated_home):
    assert train(config(tmp_path), *ODD).exit_code == 0
    (run_dir,) = runs(isolated_home)
    update_state(run_dir, budget=Budget(crash_max=9))
    assert RecoveryPolicy.of_state(read_state(run_dir)) == dataclasses.replace(OLD_POLICY, retries=Retries(crash=9))
