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
    type=click.IntRange(min=2, max=10_000),
    help="Also run N real optimizer steps here (scratch output_dir) and measure sustained throughput.",
)
@click.option(
    "--warmup-steps",
    type=click.IntRange(min=0, max=10_000),
    default=5,
    show_default=True,
    help="Probe steps run first and not measured.",
)
@click.option(
    "--histogram",
    type=click.Path(dir_okay=False),
    help="Where to draw the length histogram (PNG); default $FTLAUNCH_HOME/estimates/<config>-lengths.png.",
)
@click.option(
    "--mirror",
    help="A hub model's tokenizer and config.json only (not its weights) fetched first, resuming and "
    "retrying: auto, hf, hf-mirror, modelscope or a URL. Without it the counting child loads them itself.",
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
    keep_devices: bool | None,
    headroom: float,
    params: str | None,
    model_config: str | None,
    probe_steps: int | None,
    warmup_steps: int,
    histogram: str | None,
    mirror: str | None,
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
      ftlaunch estimate cfg.yaml --gpu A100-80GB --mirror hf-mirror model_name_or_path=Qwen/Qwen2.5-1.5B-Instruct
    """
    from ftlaunch.cli.plot import CannotWrite, draw_histogram
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
        source_gpus=source_gpus,
        global_batch=global_batch,
        keep_devices=bool(keep_devices),
        headroom=headroom,
        params=params,
        model_config=model_config,
        mirror=mirror,
    )
    if len(machines) > 1:
        out = compare_machines(config, overrides, machines, base, price_table, env, _say)
        if as_json:
            click.echo(to_json(out))
        else:
            _print(comparison_renderables(out))
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
    saved: str | None = str(hist)
    try:
        draw_histogram(one.stats, one.estimate.padding, hist)
    except CannotWrite as exc:  # the estimate is the point: print it, say the drawing was not saved
        _say(f"warning: {exc.message}; the estimate is printed without it (--histogram PATH saves it elsewhere)")
        saved = None
    out = {**one.to_dict(), "histogram": saved}
    if as_json:
        click.echo(to_json(out))
    else:
        _print(estimate_renderables(out))


def _print(renderables: Sequence[Any]) -> None:
    from ftlaunch.cli.render import Out

    console = Out()
    for r in renderables:
        console.print(r, highlight=False)


def _fmt_range_hours(pair: Sequence[float] | None) -> str:
    """[0.02, 0.17] -> "1.1-10 min"; [1.5, 4.2] -> "1.5-4.2 h" (one unit for both ends)."""
    if not pair:
        return "-"
    lo, hi = pair
    if hi < 1:
        return f"{lo * 60:.2g}-{hi * 60:.2g} min"
    return f"{lo:.2g}-{hi:.2g} h" if hi < 100 else f"{lo:,.0f}-{hi:,.0f} h"


def comparison_renderables(out: Mapping[str, Any]) -> list[Any]:
    """`estimate --gpu A --gpu B`: one row a machine, every cell a word (names and figures whole)."""
    from ftlaunch.present.tables import Col, Grid, Para

    tok = out.get("tokens") or {}
    title = "machines, fastest first"
    if tok:
        title += f" ({tok.get('samples'):,} samples, {tok.get('total_tokens'):,} tokens per epoch)"
    with_cost = any(m.get("cost") for m in out["machines"])
    cols = ["machine", "fits", "precision", "micro x acc", "tokens/s", "wall time", "GPU-hours"]
    t = Grid(*(Col(c) for c in cols + ["cost"] * with_cost), title=title)
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
    from ftlaunch.estimate.core import UTILISATION

    band = f"{UTILISATION[0]:.0%}-{UTILISATION[1]:.0%}"
    lines = [f"times: each card's peak FLOP/s x a {band} utilisation band (a guess, not a measurement)", *notes]
    return [t, *(Para(f"  - {n}", hang=4) for n in lines)]


def _fmt_hours(pair: Sequence[float] | None) -> str:
    if not pair:
        return "-"
    lo, hi = pair

    def one(h: float) -> str:
        return f"{h * 60:.1f} min" if h < 1 else f"{h:.1f} h"

    return f"{one(lo)} - {one(hi)}"


def estimate_renderables(out: Mapping[str, Any]) -> list[Any]:
    """`estimate` on one machine: data, steps, memory and time tables, assumptions, levers."""
    from rich.text import Text

    from ftlaunch.plan.memory.prediction import MemoryPrediction
    from ftlaunch.present.render import memory_table
    from ftlaunch.present.tables import Cell, Col, Grid, Para, kv_table

    shown: list[Any] = []
    pc = out["length_percentiles"]
    rows: list[tuple[str, str | Cell]] = [
        ("samples", f"{out['samples']:,}"),
        ("rows per epoch" + (" (packed)" if out["packing"] else ""), f"{out['rows']:,}"),
        ("tokens per epoch (no padding)", f"{out['total_tokens']:,}"),
        ("label tokens per epoch (trained on)", f"{out['label_tokens']:,}"),
        ("length p50 / p90 / p99 / max", Cell(f"{pc['p50']} / {pc['p90']} / {pc['p99']} / {pc['max']}", "word")),
        ("cutoff_len", str(out["cutoff_len"])),
        ("truncated by the cutoff", "-" if out["truncated"] is None else f"{out['truncated']:,}"),
        (
            f"padding at micro-batch {out['micro_batch']} ({out['sampling']})",
            f"{out['padding_share']:.1%} without packing, {out['padding_share_packed']:.1%} with",
        ),
    ]
    if out.get("eval_rows"):
        rows.append(("eval rows / tokens", f"{out['eval_rows']:,} / {out['eval_tokens']:,}"))
    shown.append(kv_table(f"data (stage {out['stage']}, as llamafactory tokenizes it)", rows, justify="right"))
    steps = [
        ("global batch (rows per optimizer step)", str(out["global_batch"])),
        ("optimizer steps per epoch", f"{out['steps_per_epoch']:,}"),
        ("epochs", f"{out['epochs']:g}"),
        ("optimizer steps in total", f"{out['optimizer_steps']:,}"),
    ]
    shown.append(kv_table("steps", steps, justify="right"))
    mem = MemoryPrediction.from_dict(out.get("memory"))
    if mem is not None:
        shown.append(memory_table(mem))
    else:
        shown.append(Para(f"memory: not modelled for {out.get('hardware')} (the memory model is per GPU)"))
    source = {"probe": "measured (probe)", "peak-flops": "GUESS from peak FLOP/s"}.get(out["time_source"], "none")
    time: list[tuple[str, str | Cell]] = [("source", source)]
    if out.get("tokens_per_second") is not None:
        time.append(("sustained tokens/s", f"{out['tokens_per_second']:,.0f}"))
    if out.get("seconds_per_step") is not None:
        time.append(("seconds per optimizer step", f"{out['seconds_per_step']:.4g}"))
    time.append(("wall time", Cell(_fmt_hours(out.get("wall_hours")), "word")))
    gh = out.get("gpu_hours")
    time.append((f"GPU-hours ({out['gpus']} GPU)", Cell(f"{gh[0]:.2f} - {gh[1]:.2f}" if gh else "-", "word")))
    shown.append(kv_table(f"time on {out.get('hardware')} ({out['precision']})", time, justify="right"))
    shown.append(Text("assumptions", style="bold"))
    shown += [Para(f"  - {a}", hang=4) for a in out["assumptions"]]
    if out["levers"]:
        lv = Grid(Col("change", "prose"), Col("estimated effect", "prose"), title="what would change it most")
        for item in out["levers"]:
            lv.add_row(item["change"], item["effect"])
        shown.append(lv)
    shown += [Para(Text.assemble(("warning:", "yellow"), f" {w}")) for w in out.get("plan_warnings") or []]
    if out.get("histogram"):  # None: it could not be saved (said on stderr)
        label = "length histogram: "  # the path's lines go on under its first
        shown.append(Para(label + out["histogram"], "path", hang=len(label)))
    return shown
