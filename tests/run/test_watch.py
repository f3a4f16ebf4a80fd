"""The supervisor's tables and its pure end (issue 32): the policy table names real budgets and decides
as the rows say, and why an attempt ended is a function of its AttemptEnd."""

from __future__ import annotations

import dataclasses

from ftlaunch.run.policy import Retries
from ftlaunch.run.recovery import (
    PATTERNS,
    POLICIES,
    Action,
    AttemptEnd,
    Exit,
    Halt,
    Retry,
    classify,
    decide,
    policy_of,
    why_it_ended,
)
from ftlaunch.run.state import Budget, FailureKind, RunStatus

CONFIG = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
BUDGETS = {f.name for f in dataclasses.fields(Retries)}


def test_every_policy_row_names_a_real_budget_and_says_what_a_spent_one_means():
    for kind, p in POLICIES.items():
        if p.retry is Retry.NEVER:
            assert p.budget is None and p.note, kind
            continue
        assert p.budget in BUDGETS, kind
        assert p.label, kind
        if p.retry is Retry.SAME:
            assert "{n}" in p.spent, kind


def test_each_row_decides_as_it_says():
    for kind, p in POLICIES.items():
        d = decide(Exit(kind, "why"), dict(CONFIG), Budget())
        if p.retry is Retry.NEVER:
            assert d.action is Action.FAIL and d.ends == p.ends, kind
        else:
            assert d.action is Action.RETRY, kind
            assert (d.changes != ()) == (p.retry is Retry.SHRINK), kind


def test_a_spent_same_config_budget_ends_as_its_row_says():
    spent = Budget(crash_used=2, stall_used=2)
    assert decide(Exit(FailureKind.STALLED, "idle"), dict(CONFIG), spent).ends is RunStatus.STALLED
    crashed = decide(Exit(FailureKind.CRASH, "boom"), dict(CONFIG), spent)
    assert crashed.action is Action.FAIL and crashed.ends is None and "crashed 3 times" in crashed.message


def test_a_class_without_a_row_is_an_unbraked_crash():
    assert policy_of(FailureKind.DIVERGED).budget == "crash" and not policy_of(FailureKind.DIVERGED).braked
    assert not policy_of(None).braked


def test_the_last_pattern_always_matches():
    assert PATTERNS[-1](1, "") is not None
    assert classify(1, "").kind is FailureKind.CRASH


def never() -> bool:
    raise AssertionError("stepped() is asked only of a success")


def no_enospc(_text: str) -> str | None:
    return None


def test_a_stall_halt_names_the_end_unless_the_user_stopped_it():
    end = AttemptEnd(-15, "", halts=(Halt(FailureKind.STALLED, "no progress for 20 s"),))
    assert why_it_ended(end, stopped=False, stepped=never, enospc=no_enospc) == Exit(
        FailureKind.STALLED, "no progress for 20 s"
    )
    assert why_it_ended(end, stopped=True, stepped=never, enospc=no_enospc).kind is FailureKind.STOPPED


def test_a_disk_halt_after_a_health_halt_still_names_the_end():
    halts = (Halt(FailureKind.DIVERGED, "numeric health"), Halt(FailureKind.DISK_FULL, "the save at step 8 cannot fit"))
    ex = why_it_ended(AttemptEnd(-15, "", halts=halts), stopped=False, stepped=never, enospc=no_enospc)
    assert ex == Exit(FailureKind.DISK_FULL, "the save at step 8 cannot fit")


def test_an_enospc_in_a_crash_log_is_disk_full():
    log = "Traceback\nRuntimeError: write failed\n"
    ex = why_it_ended(AttemptEnd(1, log), stopped=False, stepped=never, enospc=lambda t: "No space left on device")
    assert ex.kind is FailureKind.DISK_FULL and "No space left on device" in ex.message


def test_a_success_without_a_step_is_a_config_error_and_with_one_a_success():
    assert why_it_ended(AttemptEnd(0, ""), stopped=False, stepped=lambda: False, enospc=no_enospc).kind is (
        FailureKind.CONFIG
    )
    assert why_it_ended(AttemptEnd(0, ""), stopped=False, stepped=lambda: True, enospc=no_enospc).succeeded
    assert why_it_ended(AttemptEnd(0, "", last_step=3), stopped=False, stepped=never, enospc=no_enospc).succeeded
