"""`ftlaunch plot` (a run's history from ftlaunch.estimate.history, drawn) and the matplotlib
drawings: a run's loss and throughput, an estimate's lengths.

matplotlib is imported inside the drawing functions (Agg backend), so that importing the command
line stays light.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ftlaunch.cli.options import env_now
from ftlaunch.errors import ExitCode, FtlaunchError
from ftlaunch.files import file_in_the_way

if TYPE_CHECKING:
    from ftlaunch.estimate.history import TrainingHistory


@click.command("plot", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run", required=False)
@click.option("--out", type=click.Path(dir_okay=False), help="PNG to write; default <run dir>/progress.png.")
def plot_cmd(run: str | None, out: str | None) -> None:
    """Draw loss and throughput over steps for RUN as a PNG, with restarts marked.

    RUN is a run id, a unique prefix of one or a run name (default: the latest run), or an
    output_dir holding a trainer_log.jsonl. A PNG that cannot be written there exits 2.

    \b
    Examples:
      ftlaunch plot
      ftlaunch plot 20261130-1200 --out progress.png
      ftlaunch plot saves/qwen3-sft
    """
    from ftlaunch.estimate.history import training_history

    history = training_history(run, env_now())
    path = Path(out) if out else history.default_out
    draw_progress(history, path)
    click.echo(f"wrote {path}")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FtlaunchError("drawing needs matplotlib, which is not installed", hint="pip install matplotlib") from None
    return plt


class CannotWrite(FtlaunchError):
    """A drawing's PNG cannot be written there (read-only, not ours, a file where a folder should be):
    exit 2, as click's own check of the same option (--out naming a folder) exits."""

    exit_code = ExitCode.USAGE

    def __init__(self, path: Path, exc: OSError, option: str = "--out"):
        why = (exc.strerror or str(exc)).lower()
        if exc.errno in (errno.EEXIST, errno.ENOTDIR) and (blocker := file_in_the_way(path.parent)):
            what = f"{blocker} is a file, not a folder"
        elif exc.filename and Path(str(exc.filename)) != path:
            what = f"{exc.filename}: {why}"
        else:
            what = why
        super().__init__(f"cannot write {path}: {what}", hint=f"choose {option} elsewhere, in a folder you can write")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Write the figure as a PNG (its folder made first) and free it; CannotWrite when it cannot be."""
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise CannotWrite(path, exc) from None
    finally:
        plt.close(fig)
    return path


def draw_histogram(stats: Any, padding: Any, path: Path) -> Path:
    """The sample-length histogram (before the cutoff), with the cutoff and percentiles marked."""
    from ftlaunch.estimate.padding import length_percentiles

    plt = _pyplot()
    raw = list(stats.raw_lengths)
    pc = length_percentiles(raw)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if raw:
        ax.hist(raw, bins=min(60, max(5, len(set(raw)))), color="#4c72b0", edgecolor="white")
    ax.axvline(stats.cutoff_len, color="#c44e52", linewidth=2, label=f"cutoff_len {stats.cutoff_len}")
    for key, style in (("p50", ":"), ("p90", "--"), ("p99", "-.")):
        ax.axvline(pc[key], color="#555555", linestyle=style, label=f"{key} {pc[key]}")
    trunc = stats.truncated
    ax.set_title(
        f"{stats.samples:,} samples, {stats.total_tokens:,} tokens"
        + (f", {trunc:,} truncated" if trunc else "")
        + f"; padding {padding.share:.0%} (packed {padding.share_packed:.0%}) at micro-batch {padding.micro_batch}"
    )
    ax.set_xlabel("tokens per sample (llamafactory's template, before the cutoff)")
    ax.set_ylabel("samples")
    ax.legend(loc="upper right")
    return _save(plt, fig, path)


RESTART_COLOR = "#c44e52"
ATTEMPT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")


def progress_figure(history: TrainingHistory) -> tuple[Any, Any]:
    """(pyplot, figure): loss and throughput over steps, one line per attempt (a run's own records,
    ftlaunch.estimate.history), and a dashed marker where each attempt began."""
    from ftlaunch.run.accounting import rate_series

    plt = _pyplot()
    fig, (ax_loss, ax_rate) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5))
    rate_label = "steps/s"
    for i, seg in enumerate(history.segments):
        attempt = history.attempts[i]
        label = f"attempt {attempt}" if attempt is not None else f"segment {i + 1}"
        # One colour per segment on both axes (each axis would otherwise cycle on its own), never
        # the restart marker's red.
        color = ATTEMPT_COLORS[i % len(ATTEMPT_COLORS)]
        steps = [int(r["current_steps"]) for r in seg]
        ax_loss.plot(steps, [float(r["loss"]) for r in seg], label=label, linewidth=1.2, color=color)
        rate_label, series = rate_series(seg)
        if series:
            ax_rate.plot([s for s, _ in series], [v for _, v in series], label=label, linewidth=1.2, color=color)
    for m in history.markers:
        # an attempt logs from its checkpoint's step + 1: the marker sits at the checkpoint
        for ax in (ax_loss, ax_rate):
            ax.axvline(m.step, color=RESTART_COLOR, linestyle="--", linewidth=1, gid=f"attempt-{m.attempt}")
        text = f"attempt {m.attempt}" if m.attempt is not None else "restart"
        ax_loss.annotate(
            text + (f" ({m.why})" if m.why else ""),
            (m.step, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=RESTART_COLOR,
        )
    ax_loss.set_ylabel("loss")
    ax_rate.set_ylabel(rate_label)
    ax_rate.set_xlabel("optimizer step")
    ax_loss.set_title(history.title)
    if len(history.segments) > 1:
        ax_loss.legend(loc="upper right")
        ax_rate.legend(loc="upper right")
    return plt, fig


def draw_progress(history: TrainingHistory, path: Path) -> Path:
    """The run's progress figure (``progress_figure``) as a PNG."""
    plt, fig = progress_figure(history)
    return _save(plt, fig, path)
