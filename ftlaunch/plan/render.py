"""Rendering a plan for people (rich tables) and for plan.txt: the changes table, the memory table,
the hardware summary and the alternatives when a setup does not fit. No decisions here.
"""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ftlaunch.plan.change import REMOVED
from ftlaunch.plan.hardware import Hardware
from ftlaunch.plan.planner import Plan


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
        t = Table(title=f"{title}: {len(plan.changes)} change(s) for {plan.hardware.describe()}")
        t.add_column("key", style="bold")
        t.add_column("before")
        t.add_column("after", style="green")
        t.add_column("why")
        for c in plan.changes:
            t.add_row(c.key, _fmt(c.old), _fmt(c.new), c.reason)
        out.append(t)
    else:
        out.append(f"{title}: no changes needed for {plan.hardware.describe()}")
    inv = Table(title="invariants", show_header=False)
    inv.add_column("what")
    inv.add_column("value")
    inv.add_row(
        "global batch",
        f"{plan.global_batch_source} -> {plan.global_batch_target}"
        f" = {plan.micro_batch} micro x {plan.accumulation} accum x {plan.world_size} device(s)"
        + ("" if plan.global_batch_source == plan.global_batch_target else "  (NOT kept exactly)"),
    )
    inv.add_row("devices", plan.hardware.describe())
    inv.add_row("precision", plan.precision)
    if plan.env:
        inv.add_row("trainer env", " ".join(f"{k}={v}" for k, v in sorted(plan.env.items())))
    out.append(inv)
    if plan.memory:
        out.append(memory_table(plan.memory))
    if plan.extra.get("resolved_paths"):
        out.append(
            "paths made absolute (resolved from the current directory, so the adapted config runs "
            f"from anywhere): {', '.join(plan.extra['resolved_paths'])}"
        )
    for w in plan.warnings:
        out.append(f"[yellow]warning:[/yellow] {w}")
    out.extend(f"note: {n}" for n in plan.notes)
    return out


def memory_table(mem: Any) -> Table:
    """The memory model's figures and verdict: fits (within the headroom), tight (runs, with less
    headroom than the target) or does not fit."""
    t = Table(title="memory per GPU (GiB, predicted)", show_header=False)
    t.add_column("component")
    t.add_column("GiB", justify="right")
    for key in (
        "weights_gib",
        "gradients_gib",
        "optimizer_gib",
        "activations_gib",
        "logits_gib",
        "overhead_gib",
        "peak_gib",
        "capacity_gib",
        "usable_gib",
        "host_gib",
    ):
        if mem.get(key) is not None:
            t.add_row(key.removesuffix("_gib"), f"{mem[key]:.2f}")
    if mem.get("optimizer"):
        t.add_row("optimizer", str(mem["optimizer"]))
    verdict = mem.get("verdict") or ("fits" if mem.get("fits") else "does not fit")
    left = ""
    if mem.get("headroom_gib") is not None and mem.get("headroom_share") is not None:
        left = f"{mem['headroom_gib']:.2f} GiB ({mem['headroom_share']:.1%}) free"
    target = f"target headroom {mem['headroom']:.0%}" if mem.get("headroom") is not None else ""
    shown = {"fits": "fits", "tight": "TIGHT", "does_not_fit": "DOES NOT FIT"}.get(verdict, str(verdict).upper())
    t.add_row("verdict", "; ".join(x for x in (shown, left, target) if x))
    if mem.get("correction") not in (None, 1, 1.0):
        t.add_row("correction", f"x{mem['correction']:.3f} {mem.get('correction_note') or ''}".strip())
    if mem.get("host_ram_note"):
        t.add_row("host RAM", str(mem["host_ram_note"]))
    if mem.get("tried"):
        t.add_row("micro-batch tried", ", ".join(f"{b}: {p:.1f}" for b, p in mem["tried"]))
    return t


def plan_text(plan: Plan, title: str = "ftlaunch plan") -> str:
    """The plan as plain text for plan.txt (PIPE_WIDTH columns, like any output that is not a terminal)."""
    buf = io.StringIO()
    console = Console(file=buf, width=PIPE_WIDTH, no_color=True, force_terminal=False)
    for r in plan_renderables(plan, title):
        console.print(r)
    return buf.getvalue()


def hardware_renderables(hw: Hardware) -> list[Any]:
    t = Table(title=f"hardware (probe: {hw.source})")
    for col in ("gpu", "name", "memory GiB", "free GiB", "compute cap.", "bf16"):
        t.add_column(col)
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
    facts = Table(show_header=False)
    facts.add_column("what")
    facts.add_column("value")
    facts.add_row("driver", _fmt(hw.driver_version))
    facts.add_row("host RAM GiB", f"{_fmt(hw.host_ram_gib)} (available {_fmt(hw.host_available_gib)})")
    facts.add_row("disk free GiB", _fmt(hw.disk_free_gib))
    facts.add_row("CPUs", _fmt(hw.cpu_count))
    for k, v in hw.versions.items():
        facts.add_row(k, _fmt(v) if v else "not installed")
    out.append(facts)
    for n in hw.notes:
        out.append(f"note: {n}")
    return out


KIND_TITLES = {  # short: they sit in the option column
    "same-numbers": "same numbers:",
    "numerics": "other numerics:",
    "method": "other method/data:",
    "hardware": "more hardware:",
}


def alternatives_table(alternatives: list[dict[str, Any]]) -> Table:
    """The options when a config does not fit, grouped by how much they change the training; a "no"
    says why (GPU peak or host RAM), a "yes" says what to change and what it costs in speed."""
    t = Table(
        title="what would fit (predicted per GPU; host RAM for offload)",
        caption="ordered by how much each changes the training: same numbers, then numerics, then method or data",
    )
    t.add_column("option", no_wrap=True)
    t.add_column("peak GiB", justify="right", no_wrap=True)
    t.add_column("host GiB", justify="right", no_wrap=True)
    t.add_column("fits", no_wrap=True)
    t.add_column("change / why not", overflow="fold")
    kind = None
    for a in alternatives:
        if a.get("kind") != kind and a.get("kind") in KIND_TITLES:
            if kind is not None:
                t.add_section()
            kind = a.get("kind")
            t.add_row(f"[dim]{KIND_TITLES[str(kind)]}[/dim]", "", "", "", "")
        change = " ".join(f"{k}={v}" for k, v in (a.get("change") or {}).items())
        host = a.get("host_gib")
        if a.get("fits"):
            note = change + (f"  (speed: {a['speed']})" if a.get("speed") and a["speed"] != "same" else "")
        else:
            note = str(a.get("why") or change)
        t.add_row(
            escape(str(a.get("option"))),
            f"{a.get('peak_gib', 0):.1f}",
            "-" if not host else f"{host:.0f}",
            "yes" if a.get("fits") else "no",
            escape(note),
        )
    return t


# Width for output that is not a terminal (CI logs, cron mail, `| tee`): wide enough for the plan
# table's reasons, narrow enough to read in a pager. A terminal gets its own width.
PIPE_WIDTH = 100
