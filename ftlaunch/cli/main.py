"""The command line: parse, call the core and a shell, render, map errors to exit codes.

No decision lives here. Every command's help carries an example.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from ftlaunch import __version__
from ftlaunch.cli.options import env_now, plan_options, run_options
from ftlaunch.cli.render import Out, runs_table
from ftlaunch.errors import DoesNotFitError, ExitCode, FtlaunchError
from ftlaunch.plan.memory.simulate import simulation_line
from ftlaunch.plan.render import alternatives_table

console = Out()
err_console = Out(stderr=True)

PASSTHROUGH = ("api", "chat", "eval", "export", "webchat", "webui", "version")


class FtlaunchGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FtlaunchError as exc:
            if os.environ.get("FTLAUNCH_DEBUG") == "1":
                raise
            err_console.print(f"[red]error:[/red] {escape(exc.message)}", highlight=False, markup=True)
            if isinstance(exc, DoesNotFitError) and exc.alternatives:
                err_console.print(alternatives_table(exc.alternatives))
            if exc.hint:
                err_console.print(f"hint: {exc.hint}", highlight=False, markup=False)
            ctx.exit(int(exc.exit_code))


def _echo_json(obj: Any) -> None:
    from ftlaunch.files import to_json

    click.echo(to_json(obj))


@click.group(cls=FtlaunchGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftlaunch")
def main() -> None:
    """ftlaunch: run LLaMA-Factory fine-tuning on the machine at hand.

    \b
    Example:
      ftlaunch plan  cfg.yaml --gpu V100-32GB
      ftlaunch train cfg.yaml learning_rate=2e-5
      ftlaunch status
    """


def _request(config: str, overrides: tuple[str, ...], strict: bool, **kw: Any):
    from ftlaunch.run.options import RunOptions

    return RunOptions.from_kwargs(dict(kw)).plan_request(config, overrides, strict=strict)


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option(
    "--simulate",
    is_flag=True,
    help="Also measure the chosen setup's peak on fake tensors (a child process with torch; 15-40 s).",
)
def plan(config: str, overrides: tuple[str, ...], as_json: bool, simulate: bool, **kw: Any) -> None:
    """Show how CONFIG would be adapted to this machine; run nothing.

    \b
    Examples:
      ftlaunch plan examples/train_full/qwen3_full_sft.yaml learning_rate=2e-5
      ftlaunch plan cfg.yaml --gpu V100-32GB
      ftlaunch plan cfg.yaml --source-gpus 8 --json
      ftlaunch plan cfg.yaml --gpu V100-32GB --simulate      # also measure it on fake tensors
    """
    from ftlaunch.plan.render import plan_renderables
    from ftlaunch.run.prepare import make_plan

    try:
        _, p = make_plan(_request(config, overrides, False, **kw), env_now())
    except DoesNotFitError as exc:
        if as_json:  # the whole object on stdout too; the error and table still go to stderr, exit 5
            _echo_json({**exc.payload, "error": exc.message, "alternatives": exc.alternatives})
        raise
    sim = None
    if simulate:
        from ftlaunch.plan.memory.simulate import simulate_plan

        err_console.print("simulating two optimizer steps on fake tensors (a child process; 15-40 s on 2 cores) ...")
        sim = simulate_plan(p, kw.get("model_config"))
    if as_json:
        from ftlaunch.plan.config import split_secrets
        from ftlaunch.run.trainer import public_env

        d = p.to_dict()
        d["env"] = public_env(p.env)
        public, secret = split_secrets(d["config"])
        d["config"] = {**public, **dict.fromkeys(secret, "***")}  # secrets never printed
        if sim is not None:
            d["memory"] = {**(d["memory"] or {}), "simulated": sim}
        _echo_json(d)
        return
    for r in plan_renderables(p):
        console.print(r)
    if sim is not None:
        console.print(simulation_line(sim), highlight=False)


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@run_options
@click.option("--foreground", is_flag=True, help="Run attached and exit with the run's code (schedulers, containers).")
@click.option("--follow", "-f", is_flag=True, help="Start detached, then follow the log (Ctrl-C stops following only).")
@click.option(
    "--resume-existing",
    "existing",
    flag_value="resume",
    help="The output_dir holds checkpoints no ftlaunch run of this config left: continue from them.",
)
@click.option(
    "--fresh",
    "existing",
    flag_value="fresh",
    help="Move the output_dir's old content aside into <output_dir>.old-<UTC> (never deleted), then start afresh.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print {"id", "run_dir", "pid"} once started (--foreground: {"id", "run_dir", "exit_code"} at the end;'
    ' --slurm: {"id", "run_dir", "slurm_job_id"}).',
)
@click.option(
    "--simulate/--no-simulate",
    default=None,
    help="Check the plan's peak on fake tensors before starting [default: only when the verdict is tight].",
)
@click.option("--slurm", is_flag=True, help="Submit to Slurm (sbatch) instead of starting here; --gpu names one node.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="--slurm: nodes to ask for.")
@click.option("--partition", help="--slurm: the partition.")
@click.option("--time", "time_limit", help="--slurm: the time limit, e.g. 24:00:00 (a requeue resumes past it).")
@click.option("--account", help="--slurm: the account to charge.")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, help="--slurm: one more #SBATCH option (repeatable).")
def train(
    config: str,
    overrides: tuple[str, ...],
    foreground: bool,
    follow: bool,
    existing: str | None,
    as_json: bool,
    slurm: bool,
    nodes: int,
    partition: str | None,
    time_limit: str | None,
    account: str | None,
    sbatch_args: tuple[str, ...],
    simulate: bool | None,
    **kw: Any,
) -> None:
    """Plan CONFIG, then run `llamafactory-cli train` on the adapted config, supervised.

    Takes the same arguments as `llamafactory-cli train`: a YAML and key=value overrides.
    By default the run is detached: it survives the shell and SSH; follow it with `ftlaunch logs -f`.

    With --slurm, the run is a Slurm batch job over --nodes nodes of --gpu each (torchrun across
    nodes, requeued and resumed when the time limit nears); status, logs, stop work as for any run.

    \b
    Examples:
      ftlaunch train cfg.yaml
      ftlaunch train cfg.yaml learning_rate=2e-5 --follow
      ftlaunch train cfg.yaml --foreground
      ftlaunch train cfg.yaml --slurm --nodes 2 --gpu A100-80GBx8 --partition gpu --time 24:00:00
    """
    from ftlaunch.plan.render import plan_renderables
    from ftlaunch.run.launch import start_run
    from ftlaunch.run.options import RunOptions
    from ftlaunch.run.outdir import Existing

    env = env_now()
    opts = RunOptions.from_kwargs(kw)
    if slurm:
        from ftlaunch.run.slurm.sbatch import SlurmRequest
        from ftlaunch.run.slurm.submit import submit_run

        if foreground or follow:
            raise click.UsageError("--slurm runs as a batch job: follow it with `ftlaunch logs -f`")
        req = SlurmRequest(nodes, 0, partition, time_limit, account, tuple(sbatch_args))
        run_dir, job, p = submit_run(config, overrides, opts, req, env, existing=existing or "refuse")
        if as_json:
            _echo_json({"id": run_dir.name, "run_dir": str(run_dir), "slurm_job_id": job})
            return
        for r in plan_renderables(p):
            err_console.print(r)
        click.echo(
            f"submitted run {run_dir.name} as Slurm job {job} ({nodes} node(s)); script {run_dir / 'job.sbatch'}"
        )
        click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
        click.echo(f"  status: ftlaunch status {run_dir.name}   (queued while Slurm holds it)")
        click.echo(f"  stop:   ftlaunch stop {run_dir.name}     (scancel)")
        return
    if any((nodes != 1, partition, time_limit, account, sbatch_args)):
        raise click.UsageError("--nodes, --partition, --time, --account and --sbatch-arg go with --slurm")

    def created(run_dir: Path, p: Any) -> None:
        if not as_json:
            for r in plan_renderables(p):
                err_console.print(r)
        if foreground:
            err_console.print(f"run {run_dir.name} (foreground); run dir {run_dir}", highlight=False)

    started = start_run(
        opts.plan_request(config, overrides, strict=True),
        env,
        opts.supervisor_settings(),
        existing=Existing(existing or "refuse"),
        simulate=simulate,
        foreground=foreground,
        echo=not as_json,
        on_created=created,
        say=lambda text: err_console.print(text, highlight=False),
    )
    run_dir = started.run_dir
    if foreground:
        if as_json:
            _echo_json({"id": run_dir.name, "run_dir": str(run_dir), "exit_code": started.exit_code})
        sys.exit(started.exit_code)
    if as_json:
        _echo_json({"id": run_dir.name, "run_dir": str(run_dir), "pid": started.pid})
    else:
        click.echo(f"started run {run_dir.name} (supervisor pid {started.pid})")
        click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
        click.echo(f"  status: ftlaunch status {run_dir.name}")
        click.echo(f"  stop:   ftlaunch stop {run_dir.name}")
    if follow:
        _follow_and_exit(run_dir)


# Re-attaching to a live run shows the recent past, not the whole log.
FOLLOW_TAIL_LINES = 20


def _follow_and_exit(run_dir: Path, tail_lines: int | None = None) -> None:
    """Follow to the end, then exit like `status`: 0 succeeded, 1 failed/stopped, 11 still running."""
    from ftlaunch.run.view import run_view

    _follow(run_dir, tail_lines=tail_lines)
    sys.exit(STATUS_EXIT.get(run_view(run_dir)["status"], 1))


@main.command()
@click.argument("repo_id")
@click.option(
    "--mirror",
    default="auto",
    show_default=True,
    help="auto (probe the hub, then hf-mirror.com), hf, hf-mirror, modelscope, or a base URL.",
)
@click.option("--revision", help="Branch, tag or commit.")
@click.option("--repo-type", type=click.Choice(["model", "dataset"]), default="model", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print {path, endpoint, files, bytes, retries}.")
def download(repo_id: str, mirror: str, revision: str | None, repo_type: str, as_json: bool) -> None:
    """Download REPO_ID into the hub cache with retries and resume, then verify every file.

    \b
    Examples:
      ftlaunch download Qwen/Qwen2.5-1.5B-Instruct
      ftlaunch download Qwen/Qwen2.5-1.5B-Instruct --mirror hf-mirror --json
      ftlaunch download tatsu-lab/alpaca --repo-type dataset
    """
    from ftlaunch.hub.model import prefetch_model

    def on_retry(n: int, total: int, exc: BaseException, wait: float) -> None:
        err_console.print(f"[{n}/{total}] {type(exc).__name__}: retrying in {wait:.1f}s", highlight=False, markup=False)

    r = prefetch_model(
        repo_id,
        mirror,
        env_now(),
        revision=revision,
        progress=not as_json and sys.stderr.isatty(),
        on_retry=on_retry,
        repo_type=repo_type,
    )
    if as_json:
        _echo_json({**r.to_dict(), "endpoint_reason": r.endpoint_reason})
    else:
        click.echo(f"{repo_id}: {r.files} files, {r.bytes / 2**20:.1f} MiB from {r.endpoint} ({r.endpoint_reason})")
        click.echo(f"verified snapshot: {r.path}")
        click.echo(f"train offline with: model_name_or_path={r.path} and HF_HUB_OFFLINE=1")


@main.command("env")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable; feed it to --hardware elsewhere.")
def env_cmd(as_json: bool) -> None:
    """What ftlaunch sees: GPUs, driver, RAM, disk, versions.

    \b
    Examples:
      ftlaunch env
      ftlaunch env --json > hw.json   # then elsewhere: ftlaunch plan cfg.yaml --hardware hw.json
    """
    from ftlaunch.plan.hardware import probe
    from ftlaunch.plan.render import hardware_renderables

    hw = probe(env_now())
    if as_json:
        _echo_json(hw.to_dict())
        return
    for r in hardware_renderables(hw):
        console.print(r)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def runs(as_json: bool) -> None:
    """List every run: id, name, status, progress, started, output_dir.

    \b
    Example:
      ftlaunch runs
    """
    from ftlaunch.run.view import all_runs

    rows = all_runs(env_now())
    if as_json:
        _echo_json(rows)
        return
    console.print(runs_table(rows))


STATUS_EXIT = {
    "succeeded": 0,
    "queued": int(ExitCode.RUNNING),
    "running": int(ExitCode.RUNNING),
    "starting": int(ExitCode.RUNNING),
    "recovering": int(ExitCode.RUNNING),
    "stopped": int(ExitCode.FAILED),
    "failed": int(ExitCode.FAILED),
    "lost": int(ExitCode.FAILED),
    "diverged": int(ExitCode.DIVERGED),
}


@main.command()
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True)
def status(run: str | None, as_json: bool) -> None:
    """Status of RUN (id, prefix or name; default the latest). Exit 0 succeeded, 11 running, 1 otherwise.

    \b
    Examples:
      ftlaunch status
      ftlaunch status nightly --json
    """
    from ftlaunch.run.control import resolve_run
    from ftlaunch.run.view import run_view

    view = run_view(resolve_run(env_now(), run))
    if as_json:
        _echo_json(view)
    else:
        _print_status(view)
    sys.exit(STATUS_EXIT.get(view["status"], 1))


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def _print_status(v: dict[str, Any]) -> None:
    from rich.progress_bar import ProgressBar

    t = Table(title=f"run {v['id']} ({v.get('name')}): {v['status']}", show_header=False)
    t.add_column("what")
    t.add_column("value")
    if v.get("total_steps"):
        step = v.get("step") or 0
        t.add_row("progress", ProgressBar(total=v["total_steps"], completed=step, width=40))
        t.add_row("step", f"{step}/{v['total_steps']} ({100 * step / v['total_steps']:.0f}%)")
    for key, label in (
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
        ("message", "message"),
    ):
        if v.get(key) is not None:
            val = v[key]
            t.add_row(label, f"{val:.4g}" if isinstance(val, float) else str(val))
    if v.get("supervisor_alive") == "alive":
        t.add_row("supervisor pid", f"{v['pid']} (trainer {v.get('trainer_pid') or '-'})")
    if v["status"] in ("running", "recovering", "starting"):
        t.add_row("ETA", _fmt_seconds(v.get("eta_seconds")))
    console.print(t)


@main.command()
@click.argument("run", required=False)
@click.option("--follow", "-f", is_flag=True, help="Keep following, across restarts, until the run ends.")
def logs(run: str | None, follow: bool) -> None:
    """Print the log of RUN (default the latest).

    \b
    Examples:
      ftlaunch logs
      ftlaunch logs -f 20261130-1200
    """
    from ftlaunch.run.control import resolve_run

    run_dir = resolve_run(env_now(), run)
    if follow:
        _follow(run_dir)
        return
    with open(run_dir / "train.log", "rb") as f:
        sys.stdout.buffer.write(f.read())


def _tail_offset(f: Any, lines: int, block: int = 8192) -> int:
    """Byte offset where the last `lines` lines of the open binary file `f` start."""
    end = f.seek(0, 2)
    pos, data = end, b""
    while pos > 0 and data.count(b"\n") <= lines:
        pos = max(0, pos - block)
        f.seek(pos)
        data = f.read(end - pos)
    cut = data.split(b"\n")
    keep = b"\n".join(cut[-(lines + 1) :]) if len(cut) > lines + 1 else data
    return end - len(keep)


def _follow(run_dir: Path, tail_lines: int | None = None, poll: float = 0.3) -> None:
    """Print the log (all of it, or its last `tail_lines` lines), then follow until the run ends."""
    from ftlaunch.run.store import RunStatus
    from ftlaunch.run.view import run_view

    path = run_dir / "train.log"
    try:
        with open(path, "rb") as f:
            f.seek(0 if tail_lines is None else _tail_offset(f, tail_lines))
            quiet_since: float | None = None
            while True:
                chunk = f.read()
                if chunk:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                    quiet_since = None
                    continue
                status = RunStatus(run_view(run_dir)["status"])
                if status.is_terminal():
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 1.0:
                        return
                time.sleep(poll)
    except KeyboardInterrupt:
        err_console.print("\n(stopped following; the run goes on)")


@main.command()
@click.argument("run", required=False)
@click.option("--grace", type=float, default=30.0, show_default=True, help="Seconds between SIGTERM and SIGKILL.")
def stop(run: str | None, grace: float) -> None:
    """Stop RUN gracefully: SIGTERM to the trainer's process group, then SIGKILL. Checkpoints stay.

    \b
    Example:
      ftlaunch stop
    """
    from ftlaunch.run.control import resolve_run, stop_run

    click.echo(stop_run(resolve_run(env_now(), run), grace=grace))


@main.command()
@click.argument("args", nargs=-1)
@click.option("--foreground", is_flag=True, help="Run attached instead of detached.")
@click.option(
    "--follow/--no-follow",
    "-f",
    default=None,
    help="Follow the log until the run ends [default: follow a live run, not a restarted one].",
)
@click.option(
    "--allow-global-batch-change",
    is_flag=True,
    help="Accept overrides that change micro-batch x accumulation x world size (what is trained).",
)
def resume(args: tuple[str, ...], foreground: bool, follow: bool | None, allow_global_batch_change: bool) -> None:
    """Re-attach to RUN if alive (follow its log); else restart it from its last complete checkpoint.

    ARGS: [RUN] [key=value ...]. Overrides change the run's adapted config before it restarts
    (a run that gave up, resumed by hand after a change); the global batch should stay the same.
    While following, Ctrl-C stops following only; at the end it exits like `status`.

    \b
    Examples:
      ftlaunch resume            # after SSH loss, a reboot or `ftlaunch stop`
      ftlaunch resume --no-follow
      ftlaunch resume nightly per_device_train_batch_size=1 gradient_accumulation_steps=8
    """
    from ftlaunch.run.control import resolve_run, resume_run

    runs = [a for a in args if "=" not in a]
    overrides = tuple(a for a in args if "=" in a)
    if len(runs) > 1:
        raise click.UsageError(f"one RUN at most, got {', '.join(runs)}")
    run_dir = resolve_run(env_now(), runs[0] if runs else None)
    if overrides:
        from ftlaunch.run.control import preview_run_edit

        for key, before, after, note in preview_run_edit(run_dir, overrides):
            err_console.print(f"  {key}: {before} -> {after}{f'  ({note})' if note else ''}", highlight=False)
    what, value = resume_run(
        run_dir,
        env_now(),
        foreground=foreground,
        overrides=overrides,
        allow_global_batch_change=allow_global_batch_change,
    )
    if what == "alive":
        if follow is False:
            click.echo(
                f"run {run_dir.name} is alive (supervisor pid {value}); follow it: ftlaunch logs -f {run_dir.name}"
            )
            return
        click.echo(f"run {run_dir.name} is alive (supervisor pid {value}); following its log (Ctrl-C stops following)")
        _follow_and_exit(run_dir, tail_lines=FOLLOW_TAIL_LINES)
    elif what == "finished":
        click.echo(f"run {run_dir.name} already succeeded; nothing to do")
    elif what == "foreground":
        sys.exit(value)
    else:
        click.echo(f"run {run_dir.name} restarted (supervisor pid {value})")
        if follow:
            _follow_and_exit(run_dir, tail_lines=FOLLOW_TAIL_LINES)
        click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")


def _passthrough(name: str) -> click.Command:
    @click.command(
        name=name,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        help=f"Pass through to `llamafactory-cli {name}` unchanged.\n\nExample: ftlaunch {name} cfg.yaml",
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cmd(args: tuple[str, ...]) -> None:
        from ftlaunch.run.trainer import find_trainer

        cli = find_trainer(env_now())
        sys.stdout.flush()
        os.execvpe(cli[0], [*cli, name, *args], env_now())

    return cmd


for _name in PASSTHROUGH:
    main.add_command(_passthrough(_name))


def _register_groups() -> None:
    from ftlaunch.cli.estimate import estimate_cmd, plot_cmd
    from ftlaunch.cli.schedule import schedule_group

    main.add_command(schedule_group, "schedule")
    main.add_command(estimate_cmd, "estimate")
    main.add_command(plot_cmd, "plot")


_register_groups()


if __name__ == "__main__":
    main()
