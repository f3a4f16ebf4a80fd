"""`ftlaunch estimate`: parse, call one use case (ftlaunch.estimate.usecase: one machine or a
comparison of several), draw the length histogram (cli/plot.py), render the tables.

Heavy imports (matplotlib) happen inside functions so that ``import ftlaunch.cli.main`` stays light.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from ftlaunch.cli.options import compare_options, env_now
from ftlaunch.files import to_json
from ftlaunch.run.options import RunOptions


def _say(text: str) -> None:
    click.echo(text, err=True)


@click.command("estimate", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@compare_options
@click.option(
    "--price",
    "prices",
    multiple=True,
    help="Price per GPU-hour of a card, e.g. --price A100-80GB=1.9 (repeatable): adds a cost column.",
)
@click.option(
    "--probe-steps",
    type=click.IntRange(min=2),
    help="Also run N real optimizer steps here (scratch output_dir) and measure sustained throughput.",
)
@click.option(
    "--warmup-steps",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="Probe steps run first and not measured.",
)
@click.option(
    "--histogram",
    type=click.Path(dir_okay=False),
    help="Where to draw the length histogram (PNG); default $FTLAUNCH_HOME/estimates/<config>-lengths.png.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def estimate_cmd(
    config: str,
    overrides: tuple[str, ...],
    gpu: tuple[str, ...],
    hardware_file: tuple[str, ...],
    prices: tuple[str, ...],
    source_gpus: int | None,
    global_batch: int | None,
    headroom: float,
    params: str | None,
    model_config: str | None,
    probe_steps: int | None,
    warmup_steps: int,
    histogram: str | None,
    as_json: bool,
) -> None:
    """Estimate CONFIG before training: exact tokens, lengths, padding, steps, memory, time, GPU-hours.

    Token counts come from llamafactory's own preprocessing (template, cutoff, packing), run in a
    child process. The time is a range: from a short real run with --probe-steps, else a guess from
    the card's peak FLOP/s and a stated utilisation. Nothing is written to the config's output_dir.
    Several --gpu / --hardware compare machines in one table (tokens counted once), fastest first.

    \b
    Examples:
      ftlaunch estimate cfg.yaml
      ftlaunch estimate cfg.yaml --gpu A100-80GB --json
      ftlaunch estimate cfg.yaml --probe-steps 30 num_train_epochs=2
      ftlaunch estimate cfg.yaml --gpu V100-32GB --gpu A100-80GB --gpu H100-80GBx8 --price A100-80GB=1.9
    """
    from ftlaunch.cli.plot import draw_histogram
    from ftlaunch.estimate.compare import parse_prices
    from ftlaunch.estimate.usecase import compare_machines, estimate_one
    from ftlaunch.files import home

    if probe_steps and (gpu or hardware_file):
        raise click.UsageError("--probe-steps measures this machine; it cannot be combined with --gpu or --hardware")
    try:
        price_table = parse_prices(prices)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--price") from None
    machines = [("gpu", g) for g in gpu] + [("hardware_file", h) for h in hardware_file]
    env = env_now()
    base = RunOptions(
        source_gpus=source_gpus, global_batch=global_batch, headroom=headroom, params=params, model_config=model_config
    )
    if len(machines) > 1:
        out = compare_machines(config, overrides, machines, base, price_table, env, _say)
        if as_json:
            click.echo(to_json(out))
        else:
            _render_comparison(out)
        return
    one = estimate_one(
        config,
        overrides,
        replace(base, **dict(machines)),
        env,
        prices=price_table,
        probe_steps=probe_steps,
        warmup_steps=warmup_steps,
        say=_say,
    )
    hist = Path(histogram) if histogram else home(env) / "estimates" / f"{Path(config).stem}-lengths.png"
    draw_histogram(one.stats, one.estimate.padding, hist)
    out = {**one.to_dict(), "histogram": str(hist)}
    if as_json:
        click.echo(to_json(out))
    else:
        _render(out)


def _fmt_range_hours(pair: Sequence[float] | None) -> str:
    """[0.02, 0.17] -> "1.1-10 min"; [1.5, 4.2] -> "1.5-4.2 h" (one unit for both ends)."""
    if not pair:
        return "-"
    lo, hi = pair
    if hi < 1:
        return f"{lo * 60:.2g}-{hi * 60:.2g} min"
    return f"{lo:.2g}-{hi:.2g} h" if hi < 100 else f"{lo:,.0f}-{hi:,.0f} h"


def _render_comparison(out: Mapping[str, Any]) -> None:
    from rich.table import Table

    from ftlaunch.cli.render import Out, add_id_column

    console = Out()
    tok = out.get("tokens") or {}
    title = "machines, fastest first"
    if tok:
        title += f" ({tok.get('samples'):,} samples, {tok.get('total_tokens'):,} tokens per epoch)"
    t = Table(title=title)
    add_id_column(t, "machine", [m["machine"] for m in out["machines"]])
    for col in ("fits", "precision", "micro x acc", "tokens/s", "wall time", "GPU-hours"):
        t.add_column(col, no_wrap=True)
    with_cost = any(m.get("cost") for m in out["machines"])
    if with_cost:
        t.add_column("cost", no_wrap=True)
    notes: list[str] = []
    for m in out["machines"]:
        if not m["fits"]:
            alt = m.get("alternative")
            best = f"{alt.get('option')} ({alt.get('peak_gib', 0):.1f} GiB)" if alt else "none"
            notes.append(f"{m['machine']}: does not fit as asked; best option that fits: {best}")
            cells = [m["machine"], "no", *["-"] * 5]
        else:
            gh = m.get("gpu_hours")
            cells = [
                m["machine"],
                "yes" if m.get("verdict") in (None, "fits") else str(m["verdict"]),
                str(m.get("precision") or "-"),
                f"{m['micro_batch']} x {m['accumulation']}",
                "-" if m.get("tokens_per_second") is None else f"{m['tokens_per_second']:,.0f}",
                _fmt_range_hours(m.get("wall_hours")),
                "-" if not gh else f"{gh[0]:.2f}-{gh[1]:.2f}",
            ]
        if with_cost:
            cost = m.get("cost")
            cells.append("-" if not cost else f"{cost[0]:,.2f}-{cost[1]:,.2f}")
        t.add_row(*cells)
        notes += [n for n in m.get("notes") or () if n not in notes]
    console.print(t)
    from ftlaunch.estimate.core import UTILISATION

    band = f"{UTILISATION[0]:.0%}-{UTILISATION[1]:.0%}"
    for n in [f"times: each card's peak FLOP/s x a {band} utilisation band (a guess, not a measurement)", *notes]:
        console.print(f"  - {n}", highlight=False, markup=False)


def _fmt_hours(pair: Sequence[float] | None) -> str:
    if not pair:
        return "-"
    lo, hi = pair

    def one(h: float) -> str:
        return f"{h * 60:.1f} min" if h < 1 else f"{h:.1f} h"

    return f"{one(lo)} - {one(hi)}"


def _render(out: Mapping[str, Any]) -> None:
    from rich.table import Table

    from ftlaunch.cli.render import Out
    from ftlaunch.plan.render import memory_table

    console = Out()
    pc = out["length_percentiles"]
    data = Table(title=f"data (stage {out['stage']}, as llamafactory tokenizes it)", show_header=False)
    data.add_column("what")
    data.add_column("value", justify="right")
    rows = [
        ("samples", f"{out['samples']:,}"),
        ("rows per epoch" + (" (packed)" if out["packing"] else ""), f"{out['rows']:,}"),
        ("tokens per epoch (no padding)", f"{out['total_tokens']:,}"),
        ("label tokens per epoch (trained on)", f"{out['label_tokens']:,}"),
        ("length p50 / p90 / p99 / max", f"{pc['p50']} / {pc['p90']} / {pc['p99']} / {pc['max']}"),
        ("cutoff_len", str(out["cutoff_len"])),
        ("truncated by the cutoff", "-" if out["truncated"] is None else f"{out['truncated']:,}"),
        (
            f"padding at micro-batch {out['micro_batch']} ({out['sampling']})",
            f"{out['padding_share']:.1%} without packing, {out['padding_share_packed']:.1%} with",
        ),
    ]
    if out.get("eval_rows"):
        rows.append(("eval rows / tokens", f"{out['eval_rows']:,} / {out['eval_tokens']:,}"))
    for k, v in rows:
        data.add_row(k, v)
    console.print(data)
    steps = Table(title="steps", show_header=False)
    steps.add_column("what")
    steps.add_column("value", justify="right")
    steps.add_row("global batch (rows per optimizer step)", str(out["global_batch"]))
    steps.add_row("optimizer steps per epoch", f"{out['steps_per_epoch']:,}")
    steps.add_row("epochs", f"{out['epochs']:g}")
    steps.add_row("optimizer steps in total", f"{out['optimizer_steps']:,}")
    console.print(steps)
    if out.get("memory"):
        console.print(memory_table(out["memory"]))
    else:
        console.print(f"memory: not modelled for {out.get('hardware')} (the memory model is per GPU)")
    t = Table(title=f"time on {out.get('hardware')} ({out['precision']})", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row(
        "source", {"probe": "measured (probe)", "peak-flops": "GUESS from peak FLOP/s"}.get(out["time_source"], "none")
    )
    if out.get("tokens_per_second") is not None:
        t.add_row("sustained tokens/s", f"{out['tokens_per_second']:,.0f}")
    if out.get("seconds_per_step") is not None:
        t.add_row("seconds per optimizer step", f"{out['seconds_per_step']:.4g}")
    t.add_row("wall time", _fmt_hours(out.get("wall_hours")))
    gh = out.get("gpu_hours")
    t.add_row(f"GPU-hours ({out['gpus']} GPU)", f"{gh[0]:.2f} - {gh[1]:.2f}" if gh else "-")
    console.print(t)
    console.print("[bold]assumptions[/bold]")
    for a in out["assumptions"]:
        console.print(f"  - {a}", highlight=False, markup=False)
    if out["levers"]:
        lv = Table(title="what would change it most")
        lv.add_column("change")
        lv.add_column("estimated effect")
        for item in out["levers"]:
            lv.add_row(item["change"], item["effect"])
        console.print(lv)
    for w in out.get("plan_warnings") or []:
        console.print(f"[yellow]warning:[/yellow] {w}")
    console.print(f"length histogram: {out['histogram']}", highlight=False)
