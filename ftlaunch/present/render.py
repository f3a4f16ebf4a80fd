"""Rendering a plan for people (rich tables) and for plan.txt: the changes table, the memory table,
the hardware summary and the alternatives when a setup does not fit. No decisions here; every table
is a ftlaunch.present.tables.Grid (keys and numbers whole at any width).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from ftlaunch.plan.change import REMOVED
from ftlaunch.plan.hardware import Hardware
from ftlaunch.plan.memory.prediction import Alternative, Kind, MemoryPrediction
from ftlaunch.plan.planner import Plan
from ftlaunch.present.tables import Cell, Col, Grid, Para, kv_table


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if v is REMOVED or v == REMOVED:
        return "(removed)"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def plan_renderables(plan: Plan, title: str = "ftlaunch plan") -> list[Any]:
    out: list[Any] = []
    if plan.changes:
        t = Grid(
            Col("key", style="bold"),
            Col("before", "path"),  # a value is a word, or a path (deepspeed, dataset_dir)
            Col("after", "path", style="green"),
            Col("why", "prose"),
            title=f"{title}: {len(plan.changes)} change(s) for {plan.hardware.describe()}",
        )
        for c in plan.changes:
            t.add_row(c.key, _fmt(c.old), _fmt(c.new), c.reason)
        out.append(t)
    else:
        out.append(f"{title}: no changes needed for {plan.hardware.describe()}")
    rows = [
        (
            "global batch",
            f"{plan.global_batch_source} -> {plan.global_batch_target}"
            f" = {plan.micro_batch} micro x {plan.accumulation} accum x {plan.world_size} device(s)"
            + (f" ({plan.nodes} nodes x {plan.processes_per_node})" if plan.nodes > 1 else "")
            + ("" if plan.global_batch_source == plan.global_batch_target else "  (NOT kept exactly)"),
        ),
        ("devices", plan.hardware.describe()),
        ("precision", plan.precision),
    ]
    if plan.env:  # one NAME=value a line, each whole: what a user copies into a shell
        rows.append(("trainer env", "\n".join(f"{k}={v}" for k, v in sorted(plan.env.items()))))
    out.append(kv_table("invariants", rows))
    if plan.memory:
        out.append(memory_table(plan.memory))
    if plan.resolved_paths:
        out.append(
            Para(
                "paths made absolute (resolved from the current directory, so the adapted config runs "
                f"from anywhere): {', '.join(plan.resolved_paths)}"
            )
        )
    out += [Para(Text.assemble(("warning:", "yellow"), f" {w}")) for w in plan.warnings]
    out += [Para(f"note: {n}") for n in plan.notes]
    return out


def memory_table(mem: MemoryPrediction) -> Grid:
    """The memory model's figures and verdict: fits (within the headroom), tight (runs, with less
    headroom than the target) or does not fit. Every figure row is GiB: the optimizer is named in its
    row's label, and host RAM for offloaded states shows only when there are some (never on a CPU plan,
    where the whole table is host memory)."""
    t = Grid(
        Col("component"),
        Col("GiB", "prose"),
        title="host memory of the training process (GiB, predicted)"
        if mem.device == "host"
        else "memory per GPU (GiB, predicted)",
        show_header=False,
    )
    e = mem.estimate
    for name, gib in (
        ("weights", e.weights_gib),
        ("gradients", e.gradients_gib),
        (f"optimizer ({mem.optimizer})" if mem.optimizer else "optimizer", e.optimizer_gib),
        ("activations", e.activations_gib),
        ("logits", e.logits_gib),
        ("overhead", e.overhead_gib),
        ("peak", e.peak_gib),
        ("capacity", mem.capacity_gib),
        ("usable", mem.usable_gib),
        ("host (offloaded states)", e.host_gib if e.host_gib and mem.device != "host" else None),
    ):
        if gib is not None:
            t.add_row(name, f"{gib:.2f}")
    left = f"{mem.headroom_gib:.2f} GiB ({mem.headroom_share:.1%}) free"
    t.add_row("verdict", "; ".join((mem.verdict.shown, left, f"target headroom {mem.headroom:.0%}")))
    if mem.correction != 1:
        t.add_row("correction", f"x{mem.correction:.3f} {mem.correction_note or ''}".strip())
    if mem.host_ram_note:
        t.add_row("host RAM", mem.host_ram_note)
    if mem.tried:
        # micro-batch:peak GiB, no space inside a pair: a line breaks between pairs only
        t.add_row("micro-batch tried", ", ".join(f"{b}:{p:.1f}" for b, p in mem.tried))
    return t


def plan_text(plan: Plan, title: str = "ftlaunch plan") -> str:
    """The plan as plain text for plan.txt (PIPE_WIDTH columns, like any output that is not a terminal)."""
    buf = io.StringIO()
    console = Console(file=buf, width=PIPE_WIDTH, no_color=True, force_terminal=False)
    for r in plan_renderables(plan, title):
        console.print(r)
    return buf.getvalue()


def hardware_renderables(hw: Hardware) -> list[Any]:
    t = Grid(
        *(Col(c) for c in ("gpu", "name", "memory GiB", "free GiB", "compute cap.", "bf16")),
        title=f"hardware (probe: {hw.source})",
    )
    for g in hw.gpus:
        cc = g.compute_capability
        t.add_row(
            str(g.index),
            g.name,
            f"{g.total_gib:.1f}",
            "-" if g.free_mib is None else f"{g.free_mib / 1024:.1f}",
            f"{cc[0]}.{cc[1]}" if cc else "?",
            "yes" if g.bf16 else "no",
        )
    out: list[Any] = [t if hw.gpus else "no GPU visible: training runs on the CPU in fp32"]
    facts = [
        ("driver", _fmt(hw.driver_version)),
        ("host RAM GiB", f"{_fmt(hw.host_ram_gib)} (available {_fmt(hw.host_available_gib)})"),
        ("disk free GiB", _fmt(hw.disk_free_gib)),
        ("CPUs", _fmt(hw.cpu_count)),
        *((k, _fmt(v) if v else "not installed") for k, v in hw.versions.items()),
    ]
    out.append(kv_table(None, facts))
    out += [Para(f"note: {n}") for n in hw.notes]
    return out


KIND_TITLES = {  # short: they sit in the option column
    Kind.SAME_NUMBERS: "same numbers:",
    Kind.NUMERICS: "other numerics:",
    Kind.METHOD: "other method/data:",
    Kind.HARDWARE: "more hardware:",
}


def alternatives_table(alternatives: Sequence[Alternative | Mapping[str, Any]]) -> Grid:
    """The options when a config does not fit, grouped by how much they change the training; a "no"
    says why (GPU peak or host RAM), a "yes" says what to change and what it costs in speed. Rows as
    the memory model makes them, or as a DoesNotFitError carries them (JSON)."""
    t = Grid(
        Col("option"),
        Col("peak GiB", justify="right"),
        Col("host GiB", justify="right"),
        Col("fits"),
        Col("change / why not", "prose"),  # key=value pairs are single tokens: never broken
        title="what would fit (predicted per GPU; host RAM for offload)",
        caption="ordered by how much each changes the training: same numbers, then numerics, then method or data",
    )
    kind = None
    for row in alternatives:
        a = row if isinstance(row, Alternative) else Alternative.from_dict(row)
        if a.kind != kind:
            if kind is not None:
                t.add_section()
            kind = a.kind
            t.add_row(Cell(KIND_TITLES[kind], style="dim"), "", "", "", "")
        change = " ".join(f"{k}={v}" for k, v in a.change.items())
        if a.fits:
            note = change + (f"  (speed: {a.speed})" if a.speed and a.speed != "same" else "")
        else:
            note = a.reason or change
        t.add_row(
            a.option,
            f"{a.peak_gib:.1f}",
            "-" if not a.host_gib else f"{a.host_gib:.0f}",
            "yes" if a.fits else "no",
            note,
        )
    return t


# Width for output that is not a terminal (CI logs, cron mail, `| tee`): wide enough for the plan
# table's reasons, narrow enough to read in a pager. A terminal gets its own width.
PIPE_WIDTH = 100
