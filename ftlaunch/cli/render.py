"""Rendering plans, hardware and runs for people (rich) and machines (JSON). No decisions here.

Owns the two consoles every command prints to (`console`, `err_console`), `echo_json`, the table of
runs, a run's status table and the JSON form of a plan (secrets masked).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console

from ftlaunch.plan.render import PIPE_WIDTH
from ftlaunch.plan.tables import Bar, Cell, Col, Grid, kv_table

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan


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


def runs_table(rows: list[dict[str, Any]]) -> Grid:
    """`ftlaunch runs`: ids, names (what commands take), progress and numbers whole; output_dir wraps
    at its slashes; too narrow for that, one block per run."""
    t = Grid(
        *(Col(c) for c in ("id", "name", "status", "try", "progress", "loss", "started UTC")),
        Col("output_dir", "path"),
        title=f"{len(rows)} run(s)",
    )
    for r in rows:
        prog = f"{r.get('step')}/{r.get('total_steps')}" if r.get("total_steps") else "-"
        loss = f"{r['loss']:.4f}" if isinstance(r.get("loss"), (int, float)) else "-"
        t.add_row(
            r["id"],
            str(r.get("name") or "-"),
            r["status"],
            str(r.get("attempt") or "-"),
            prog,
            loss,
            str(r.get("created") or "-")[5:16].replace("T", " ") or "-",  # MM-DD HH:MM
            str(r.get("output_dir") or "-"),
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


STATUS_ROWS = (
    ("attempt", "attempt"),
    ("loss", "loss"),
    ("tokens_per_second", "tokens/s"),
    ("gpu_hours", "GPU-hours so far"),
    ("gpu_hours_projected", "GPU-hours projected"),
    ("steps_per_second", "steps/s"),
    ("micro_batch", "micro-batch"),
    ("accumulation", "accumulation"),
    ("last_checkpoint", "last checkpoint"),
    ("health", "health"),
    ("gpu_memory_gib", "GPU memory GiB"),
    ("predicted_peak_gib", "GPU peak GiB predicted"),
    ("observed_peak_gib", "GPU peak GiB observed"),
    ("output_dir", "output_dir"),
    ("run_dir", "run_dir"),
    ("environment_changed", "environment"),
    ("message", "message"),
)


STATUS_PATHS = {"output_dir", "run_dir"}  # wrap at their slashes; every other value is prose (tokens whole)


def status_table(v: dict[str, Any]) -> Grid:
    """`ftlaunch status`: one run's view (ftlaunch.run.view.run_view) as a two-column table."""
    rows: list[tuple[str, str | Cell | Bar]] = []
    if v.get("total_steps"):
        step = v.get("step") or 0
        rows.append(("progress", Bar(completed=step, total=v["total_steps"])))
        rows.append(("step", Cell(f"{step}/{v['total_steps']} ({100 * step / v['total_steps']:.0f}%)", "word")))
    for key, label in STATUS_ROWS:
        if v.get(key) is not None:
            val = v[key]
            text = f"{val:.4g}" if isinstance(val, float) else str(val)
            rows.append((label, Cell(text, "path") if key in STATUS_PATHS else text))
    if v.get("supervisor_alive") == "alive":
        rows.append(("supervisor pid", f"{v['pid']} (trainer {v.get('trainer_pid') or '-'})"))
    if v["status"] in ("running", "recovering", "starting"):
        rows.append(("ETA", fmt_seconds(v.get("eta_seconds"))))
    if v.get("seconds_since_progress") is not None:
        allowance = v.get("stall_timeout_seconds")
        limit = f" of {fmt_seconds(allowance)} allowed ({v.get('stall_timeout_why')})" if allowance else ""
        rows.append(("last progress", f"{fmt_seconds(v['seconds_since_progress'])} ago, {v.get('stall_phase')}{limit}"))
    if v.get("no_progress_attempts"):
        rows.append(("attempts without a new checkpoint", str(v["no_progress_attempts"])))
    return kv_table(f"run {v['id']} ({v.get('name')}): {v['status']}", rows)
