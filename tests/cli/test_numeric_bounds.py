"""Every number a user types, fed nan, inf, 1e309, huge and negative (issue 31 item 4 and "Bounds").

`--stall-timeout nan|inf|1e309` was accepted: the watchdog never fired, state.json got a NaN token and
`status` exited 1 with a traceback. The options are enumerated from the click commands themselves, so a
new numeric option is covered the day it is added; the `key=value` overrides are the config keys of a
number kind (LLaMA-Factory's key list) that ftlaunch's own code reads, found in its source. Each value
ends in a clean error (exit 2 naming the option; exit 3/4/5 for a config, a machine or a fit), or is
accepted where it is legal: never a traceback, a hang, or a non-finite number in a plan."""

from __future__ import annotations

import ast
import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main
from ftlaunch.plan.config import known_keys
from ftlaunch.run.state import RunState, RunStatus
from ftlaunch.run.store import RunFolder

from ..helpers import flat, said

ROOT = Path(__file__).resolve().parents[2]
BAD = ["nan", "inf", "-inf", "1e309", "99999999999999999999", "-5"]

CONFIG = """\
model_name_or_path: org/model
stage: sft
do_train: true
finetuning_type: lora
dataset: alpaca_en_demo
template: default
output_dir: out
per_device_train_batch_size: 2
gradient_accumulation_steps: 4
learning_rate: 1.0e-4
num_train_epochs: 3.0
bf16: true
"""

# Options whose commands belong elsewhere and still take these values (strict: a fix makes them pass,
# and the mark must then go). They are one `type=` each; cli/options.FiniteFloat is the float type.
KNOWN_GAPS: dict[tuple[str, str], set[str]] = {}
# Accepted by the parser and refused by the command before anything runs (exit 4, the limit named).
MACHINE_CHECKED = {"--nodes"}


def _commands(cmd: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            yield from _commands(cmd.commands[name], (*path, name))
    else:
        yield path, cmd


def numeric_options() -> list[tuple[tuple[str, ...], click.Command, click.Option]]:
    """Every option of every command whose value click converts to an int or a float."""
    out = []
    for path, cmd in _commands(main):
        for p in cmd.params:
            if isinstance(p, click.Option) and isinstance(
                p.type, (click.types.IntParamType, click.types.FloatParamType)
            ):
                out.append((path, cmd, p))
    return out


def _argv(cmd: click.Command, cfg: Path) -> list[str]:
    """The command's required arguments and options, with harmless values."""
    argv: list[str] = []
    for p in cmd.params:
        if isinstance(p, click.Option) and p.required:
            argv += [p.opts[0], {"cron": "@daily"}.get(p.name or "", "x")]
    for p in cmd.params:
        if isinstance(p, click.Argument) and p.required:
            argv.append({"config": str(cfg), "name": "nightly"}.get(p.name or "", "x"))
    return argv


def _cases() -> list:
    cases = []
    for path, _cmd, opt in numeric_options():
        for value in BAD:
            gap = value in KNOWN_GAPS.get((" ".join(path), opt.opts[0]), set())
            marks = [pytest.mark.xfail(strict=True, reason="accepted: see KNOWN_GAPS")] if gap else []
            cases.append(
                pytest.param(path, opt.opts[0], value, marks=marks, id=f"{' '.join(path)} {opt.opts[0]}={value}")
            )
    return cases


def test_the_enumeration_finds_the_options_of_issue_31():
    found = {(" ".join(path), opt.opts[0]) for path, _cmd, opt in numeric_options()}
    assert {("train", "--stall-timeout"), ("schedule add", "--stall-timeout"), ("plan", "--headroom")} <= found
    assert {("train", "--nodes"), ("estimate", "--source-gpus"), ("stop", "--grace")} <= found
    assert len(found) >= 25


@pytest.mark.parametrize(("path", "opt", "value"), _cases())
def test_a_non_finite_huge_or_negative_number_is_a_clean_error_naming_the_option(
    path, opt, value, tmp_path, isolated_home
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    cmd = dict(_commands(main))[path]
    argv = [*_argv(cmd, cfg), opt, value]
    try:
        ctx = cmd.make_context(" ".join(path), list(argv))
    except click.UsageError as exc:  # BadParameter included: refused by the parser, as a usage error
        assert said(opt, exc.format_message()), exc.format_message()
        r = CliRunner().invoke(main, [*path, *argv])
        assert r.exit_code == 2 and said(opt, r.output), r.output
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        return
    param = next(p for p in cmd.params if opt in p.opts)
    accepted = ctx.params[param.name]
    assert opt in MACHINE_CHECKED, f"{' '.join(path)} {opt} {value} was accepted as {accepted!r}"
    r = CliRunner().invoke(main, [*path, *argv])  # refused before the command does anything
    assert r.exit_code == 4 and said("at most", r.output), r.output
    assert not (isolated_home / "runs").exists()


def test_legal_values_are_still_accepted(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    for path, cmd, opt in numeric_options():
        low = getattr(opt.type, "min", None)
        value = str(low if low is not None else 1)
        if getattr(opt.type, "min_open", False):
            value = str(low + 1)
        ctx = cmd.make_context(" ".join(path), [*_argv(cmd, cfg), opt.opts[0], value])
        assert float(ctx.params[opt.name]) == float(value), (path, opt.opts[0])
    assert CliRunner().invoke(main, ["train", str(cfg), "--stall-timeout", "inf"]).exit_code == 2


# ---------------------------------------------------------------- key=value overrides ftlaunch reads


def keys_ftlaunch_reads() -> list[str]:
    """Config keys of a number kind that ftlaunch's own code reads (``values.get("key")``,
    ``values["key"]``): a key a new module starts to read is covered from then on."""
    kinds = known_keys()
    found: set[str] = set()
    for source in (ROOT / "ftlaunch").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                if node.func.attr in ("get", "pop", "setdefault") and isinstance(node.args[0], ast.Constant):
                    key = node.args[0].value
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                key = node.slice.value
            if isinstance(key, str) and kinds.get(key) in ("int", "float"):
                found.add(key)
    return sorted(found)


# Overrides that still end badly (strict xfail: fixed, they pass; run=False for a hang). None left:
# the batch keys are bounded (plan/config.py MAX_BATCH_KEY), divisors are found up to sqrt(n)
# (plan/batch.py), and cutoff_len must be >= 1.
OVERRIDE_GAPS: dict[tuple[str, str], str] = {}


def _override_cases() -> list:
    cases = []
    for key in keys_ftlaunch_reads():
        for value in BAD:
            why = OVERRIDE_GAPS.get((key, value))
            marks = [pytest.mark.xfail(strict=True, reason=why, run="hangs" not in why)] if why else []
            cases.append(pytest.param(key, value, marks=marks, id=f"{key}={value}"))
    return cases


class _Hung(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Hung


@pytest.mark.parametrize(("key", "value"), _override_cases())
def test_an_override_ftlaunch_reads_is_refused_or_planned_with_finite_numbers(key, value, tmp_path, isolated_home):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)  # a plan takes ~0.05 s: only a count-sized loop takes this long
    try:
        r = CliRunner().invoke(main, ["plan", str(cfg), "--gpu", "T4", "--params", "1B", "--json", f"{key}={value}"])
    except _Hung:
        pytest.fail(f"plan {key}={value} still ran after 60 s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code in (0, 3, 5), r.output  # planned, a config error, does not fit
    if r.exit_code == 3:
        assert said(key, r.output), flat(r.output)
    if r.exit_code == 0:  # strict JSON: no NaN or Infinity token anywhere in the plan
        json.loads(r.output, parse_constant=lambda c: pytest.fail(f"{key}={value}: the plan holds {c}"))


def test_the_keys_of_issue_31_are_among_those_read():
    assert {"learning_rate", "num_train_epochs", "max_steps", "save_steps", "per_device_train_batch_size"} <= set(
        keys_ftlaunch_reads()
    )


# ---------------------------------------------------------------- a state.json that holds NaN already


def test_status_of_a_run_whose_state_holds_nan_from_an_old_run_has_no_traceback(isolated_home):
    import os

    from ftlaunch.run.procs import start_time

    run_dir = isolated_home / "runs" / "20260101-000000-abcd"
    run_dir.mkdir(parents=True)
    # A live supervisor (this process): status shows the watchdog's figures, where the NaN was.
    me = os.getpid()
    state = RunState(id=run_dir.name, name="old", status=RunStatus.RUNNING, pid=me, pid_start=start_time(me)).to_json()
    nan = float("nan")
    state.update(
        stall_timeout=nan,
        steps_per_second=float("inf"),
        progress_at=nan,
        stall={"phase": "training", "allowance_s": nan, "timeout_s": nan, "last_progress_at": nan, "why": "x"},
        progress={"step": 3, "total_steps": 9, "loss": nan},
    )
    RunFolder(run_dir).state.write_text(json.dumps(state))  # the NaN tokens an old ftlaunch wrote
    assert "NaN" in RunFolder(run_dir).state.read_text()
    for args in (["status", "old"], ["status", "old", "--json"], ["runs"], ["runs", "--json"]):
        r = CliRunner().invoke(main, args)
        assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception))
        assert r.exit_code in (0, 11), (args, r.output)
    view = json.loads(CliRunner().invoke(main, ["status", "old", "--json"]).output)
    assert view["status"] == "running" and view["eta_seconds"] is None and view["steps_per_second"] is None
    assert view["stall_timeout_seconds"] is None
    assert all(not isinstance(v, float) or math.isfinite(v) for k, v in view.items() if k != "loss")
