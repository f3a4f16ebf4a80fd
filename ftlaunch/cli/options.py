"""What the click edges share: the environment as input, and the option sets, each declared once.

- `target_options`: what to plan for (hardware, batch, memory policy): plan, train, estimate, schedule add.
- `plan_options`: those plus --mirror and --host-ram: plan, train, schedule add.
- `run_options`: those plus how the supervisor behaves (--name, and the recovery policy's options, one
  per row of ftlaunch.run.policy.OPTIONS): every command that starts a run (`train`, `schedule add`).
  Their values become one `RunOptions` (ftlaunch/run/options.py) holding one `RecoveryPolicy`. An
  option that only makes sense for one output_dir or one terminal (--fresh, --follow, --foreground)
  goes on `train` itself.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from ftlaunch.plan.hardware import MAX_CATALOG_GPUS, check_typed_machine
from ftlaunch.run.policy import OPTIONS, Kind, Option

# Bounds on the numbers a user types (issue 31): what exists, or what a run can use. The GPU counts
# (--gpu CARDxN, --nodes, --source-gpus) are ftlaunch.plan.hardware's MAX_GPUS_PER_NODE / MAX_NODES.
MAX_GLOBAL_BATCH = 1 << 20  # samples per optimizer step; the planner lists its divisors
MAX_HOST_RAM_GIB = 65536.0  # 64 TiB, above the largest single machines
# The recovery policy's bounds (MAX_RETRIES, MAX_STALL_TIMEOUT_S) are on its option rows (ftlaunch.run.policy).


class FiniteFloat(click.FloatRange):
    """A float option that must be a finite number within its range: click's FloatRange lets
    ``nan`` through every bound (NaN compares false) and ``inf``/``1e309`` through any lower one."""

    name = "float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number ({self._describe_range()}).", param, ctx)
        return super().convert(rv, param, ctx)


def env_now() -> dict[str, str]:
    """The environment is input, read in one place, at call time."""
    return dict(os.environ)


def stderr_is_tty() -> bool:
    """Whether progress bars may be drawn: asked here, at the edge, and passed in."""
    return sys.stderr.isatty()


def target_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--gpu, --hardware, --source-gpus, --global-batch, --keep-devices, --headroom, --params, --model-config."""
    return _target_options(f, many=False)


def compare_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The target options with --gpu and --hardware repeatable (`estimate` compares machines)."""
    return _target_options(f, many=True)


def _machine_bounded(f: Callable[..., Any]) -> Callable[..., Any]:
    """The command with its typed machine checked before it runs: each --gpu CARDxN at most one node's
    cards and --nodes at most ftlaunch.plan.hardware.MAX_NODES (exit 4 naming the limit)."""

    @functools.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        gpu = kwargs.get("gpu")
        specs = [gpu] if isinstance(gpu, str) else list(gpu or ())
        check_typed_machine(specs, kwargs.get("nodes"))
        return f(*args, **kwargs)

    return checked


def _target_options(f: Callable[..., Any], many: bool) -> Callable[..., Any]:
    more = " Repeat it to compare machines." if many else ""
    f = click.option(
        "--gpu",
        multiple=many,
        help=f"Plan for a catalog card instead of probing: V100-32GB, A100-80GBx4, none.{more}",
    )(f)
    f = click.option(
        "--hardware",
        "hardware_file",
        multiple=many,
        type=click.Path(dir_okay=False),
        help=f"Plan for a machine captured with `ftlaunch env --json`.{more}",
    )(f)
    f = click.option(
        "--source-gpus",
        type=click.IntRange(min=1, max=MAX_CATALOG_GPUS),
        help="GPUs the config was written for (default 1); sets the source global batch.",
    )(f)
    f = click.option(
        "--global-batch", type=click.IntRange(min=1, max=MAX_GLOBAL_BATCH), help="Source global batch, set directly."
    )(f)
    f = click.option(
        "--keep-devices",
        is_flag=True,
        default=None,
        help="Use every GPU even when the global batch does not divide over them (the nearest batch, with a "
        "warning); default: the most GPUs that keep it exactly.",
    )(f)
    f = click.option(
        "--headroom",
        type=FiniteFloat(0.0, 0.9),
        default=0.12,
        show_default=True,
        help="Share of GPU memory kept free.",
    )(f)
    f = click.option("--params", help="Model size when config.json is not at hand, e.g. 7B.")(f)
    f = click.option(
        "--model-config",
        type=click.Path(dir_okay=False, exists=True),
        help="A config.json that sizes the model when the weights are elsewhere (hub id).",
    )(f)
    return _machine_bounded(f)


def plan_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The target options, plus --mirror and --host-ram."""
    f = target_options(f)
    f = click.option(
        "--mirror",
        help="Pre-download the model (and, for train, hub datasets named in the config) first: auto, hf, "
        "hf-mirror, modelscope or a URL (plan fetches config.json only).",
    )(f)
    f = click.option(
        "--host-ram",
        "host_ram_gib",
        type=FiniteFloat(min=1, max=MAX_HOST_RAM_GIB),
        help="Host RAM in GiB to plan with (CPU offload); default: this machine's, or the catalog card's machine.",
    )(f)
    return f


def notify_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--notify URL (repeatable), --notify-cmd CMD, --notify-on EVENTS: the supervisor's notifications
    (ftlaunch.run.notify); the destinations are kept in the run's secrets.json only."""
    f = click.option(
        "--notify",
        "notify_urls",
        multiple=True,
        metavar="URL",
        help="Send the run's events here (repeatable): an http(s) URL gets a JSON POST; json://, slack://, "
        "mailto://, dingtalk://, ntfy:// ... go through apprise (pip install 'ftlaunch[notify]'). "
        "FTLAUNCH_NOTIFY adds more; with none given, $FTLAUNCH_HOME/notify.yaml's. Kept in the run's "
        "secrets.json, shown as ***.",
    )(f)
    f = click.option(
        "--notify-cmd",
        metavar="CMD",
        help="Run this command on the run's events, the message as JSON on stdin and in FTLAUNCH_* variables.",
    )(f)
    f = click.option(
        "--notify-on",
        metavar="EVENTS",
        help="Which events notify, comma-separated [default: all]: started, succeeded, failed, stalled, "
        "oom_recovered, no_progress, diverged, disk_full, disk_forecast, env_changed, stopped, lost.",
    )(f)
    return f


def run_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The plan options, plus the supervisor's: --name and the recovery policy's (`recovery_options`)."""
    f = plan_options(f)
    f = click.option("--name", "run_name", help="A name for the run (default: the output_dir's last part).")(f)
    return recovery_options(f)


def recovery_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """One click option per row of the recovery policy's table (ftlaunch.run.policy.OPTIONS): --max-retries,
    --max-crash-retries, --no-recover, --on-diverge, --stall-timeout, --max-stall-restarts."""
    for row in OPTIONS:
        f = click.option(row.flag, row.dest, help=row.help, **_typed(row))(f)
    return f


def _typed(row: Option) -> dict[str, Any]:
    """The click keywords of an option row's kind: its type, bounds and default."""
    if row.kind is Kind.OFF:
        return {"is_flag": True, "default": None}
    if row.kind is Kind.SECONDS:
        return {"type": FiniteFloat(min=row.low, max=row.high), "default": row.default}
    if row.kind is Kind.CHOICE and row.choices is not None:
        choices = row.choices
        return {
            "type": click.Choice([m.value for m in choices]),
            "default": row.default.value,
            "show_default": True,
            # parsed here, at the edge: the run's options carry the enum
            "callback": lambda _ctx, _param, value: None if value is None else choices(value),
        }
    return {"type": click.IntRange(min=int(row.low), max=int(row.high)), "default": row.default, "show_default": True}
