"""Rendering plans, hardware and runs for people (rich) and machines (JSON). No decisions here.

Owns the two consoles every command prints to (`console`, `err_console`), `echo_json`, the table of
runs, a run's status table and the JSON form of a plan (secrets masked).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console

from ftlaunch.present.render import PIPE_WIDTH
from ftlaunch.present.tables import Bar, Cell, Col, Grid, kv_table

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan
    from ftlaunch.run.runview import CostView
    from ftlaunch.run.view import RunView


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Out:
    """A rich console bound at print time to the current stdout/stderr (click's test runner swaps them).

    A terminal gets its real width; anything else PIPE_WIDTH columns and no colour.
    """

    def __init__(self, stderr: bool = False) -> None:
        self.stderr = stderr

    def console(self) -> Console:
        stream = sys.stderr if self.stderr else sys.stdout
        return Console(file=stream, width=None if _isatty(stream) else PIPE_WIDTH)

    def print(self, *objects: Any, **kw: Any) -> None:
        self.console().print(*objects, **kw)


console = Out()
err_console = Out(stderr=True)


def echo_json(obj: Any) -> None:
    """One JSON object on stdout (numpy scalars, paths and dataclasses made plain)."""
    import click

    from ftlaunch.files import to_json

    click.echo(to_json(obj))


def plan_json(p: Plan, simulated: dict[str, Any] | None = None) -> dict[str, Any]:
    """`plan --json`: the plan as one object; secret config keys and env values are never printed."""
    from ftlaunch.plan.config import split_secrets
    from ftlaunch.run.trainer import public_env

    d = (p if simulated is None else replace(p, simulated=simulated)).to_dict()
    d["env"] = public_env(p.env)
    public, secret = split_secrets(d["config"])
    d["config"] = {**public, **dict.fromkeys(secret, "***")}
    return d


def runs_table(rows: list[RunView]) -> Grid:
    """`ftlaunch runs`: ids, names (what commands take), progress and numbers whole; output_dir wraps
    at its slashes; too narrow for that, one block per run."""
    t = Grid(
        *(Col(c) for c in ("id", "name", "status", "try", "progress", "loss", "started UTC")),
        Col("output_dir", "path"),
        title=f"{len(rows)} run(s)",
    )
    for r in rows:
        prog = f"{r.step}/{r.total_steps}" if r.total_steps else "-"
        loss = f"{r.loss:.4f}" if isinstance(r.loss, (int, float)) else "-"
        t.add_row(
            r.id,
            str(r.name or "-"),
            r.status.value,
            str(r.attempt or "-"),
            prog,
            loss,
            str(r.created or "-")[5:16].replace("T", " ") or "-",  # MM-DD HH:MM
            str(r.output_dir or "-"),
        )
    return t


def fmt_seconds(s: float | None) -> str:
    """3725 -> "1h02m"; 65 -> "1m05s"; None -> "-"."""
    if s is None:
        return "-"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


STATUS_PATHS = {"output_dir", "run_dir"}  # wrap at their slashes; every other value is prose (tokens whole)


def _cost_rows(cost: CostView) -> tuple[tuple[str, Any], ...]:
    """What the run has cost: GPU-hours on GPUs; on the CPU (no GPU planned) the time it has run,
    since its GPU-hours are 0 by definition."""
    if cost.gpus == 0:
        return (("CPU run, time so far", fmt_seconds(cost.wall_seconds)),)
    return (("GPU-hours so far", cost.gpu_hours), ("GPU-hours projected", cost.gpu_hours_projected))


def _status_rows(v: RunView) -> tuple[tuple[str, Any], ...]:
    """The rows of `status` under its progress bar, in order: label and value (None: not shown)."""
    return (
        ("attempt", v.attempt),
        ("loss", v.loss),
        ("tokens/s", v.cost.tokens_per_second),
        *_cost_rows(v.cost),
        ("steps/s", v.steps_per_second),
        ("micro-batch", v.micro_batch),
        ("accumulation", v.accumulation),
        ("last checkpoint", v.last_checkpoint),
        ("health", v.health),
        ("GPU memory GiB", v.gpu_memory_gib),
        ("GPU peak GiB predicted", v.predicted_peak_gib),
        ("GPU peak GiB observed", v.observed_peak_gib),
        ("output_dir", v.output_dir),
        ("run_dir", v.run_dir),
        ("environment", v.environment_changed),
        ("message", v.message),
    )


def status_table(v: RunView) -> Grid:
    """`ftlaunch status`: one run's view (ftlaunch.run.view.RunView) as a two-column table."""
    from ftlaunch.run.procs import Liveness
    from ftlaunch.run.state import RunStatus

    rows: list[tuple[str, str | Cell | Bar]] = []
    if v.total_steps:
        step = v.step or 0
        rows.append(("progress", Bar(completed=step, total=v.total_steps)))
        rows.append(("step", Cell(f"{step}/{v.total_steps} ({100 * step / v.total_steps:.0f}%)", "word")))
    for label, val in _status_rows(v):
        if val is not None:
            text = f"{val:.4g}" if isinstance(val, float) else str(val)
            rows.append((label, Cell(text, "path") if label in STATUS_PATHS else text))
    if v.supervisor_alive is Liveness.ALIVE:
        rows.append(("supervisor pid", f"{v.pid} (trainer {v.trainer_pid or '-'})"))
    if v.status in (RunStatus.RUNNING, RunStatus.RECOVERING, RunStatus.STARTING):
        rows.append(("ETA", fmt_seconds(v.eta_seconds)))
    stall = v.stall
    if stall.seconds_since_progress is not None:
        allowance = stall.timeout_seconds
        limit = f" of {fmt_seconds(allowance)} allowed ({stall.timeout_why})" if allowance else ""
        rows.append(("last progress", f"{fmt_seconds(stall.seconds_since_progress)} ago, {stall.phase}{limit}"))
    if stall.no_progress_attempts:
        rows.append(("attempts without a new checkpoint", str(stall.no_progress_attempts)))
    return kv_table(f"run {v.id} ({v.name}): {v.status.value}", rows)
