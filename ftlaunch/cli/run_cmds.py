"""The commands of a run's life: `train`, `runs`, `status`, `logs`, `stop` and `resume`.

Each parses, calls one use case (ftlaunch.run.launch.start_run, whatever the engine,
ftlaunch.run.control.*, ftlaunch.run.view.*) and renders; following a log lives in cli/follow.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ftlaunch.cli.follow import FOLLOW_TAIL_LINES, follow_and_exit, follow_log
from ftlaunch.cli.options import FiniteFloat, env_now, notify_options, run_options, stderr_is_tty
from ftlaunch.cli.render import console, echo_json, err_console, runs_table, status_table
from ftlaunch.run.engines import names as engine_names  # light: the engines' modules load when named

if TYPE_CHECKING:
    from ftlaunch.plan.planner import Plan
    from ftlaunch.run.launch import Started


def _how_to_watch(run_dir: Path, stop_note: str = "") -> None:
    click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
    click.echo(f"  status: ftlaunch status {run_dir.name}")
    click.echo(f"  stop:   ftlaunch stop {run_dir.name}{stop_note}")


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@run_options
@notify_options
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
@click.option(
    "--engine",
    type=click.Choice(engine_names()),
    default=None,
    help="Where the run's supervisor lives [default: local]: local (this machine), slurm (a batch job: sbatch),"
    " ray (a Ray job on the cluster at --address).",
)
@click.option(
    "--address",
    help="--engine ray: the head's dashboard URL, e.g. http://HEAD:8265 [default: $RAY_ADDRESS, else 127.0.0.1:8265].",
)
@click.option("--slurm", is_flag=True, help="Same as --engine slurm: submit to Slurm; --gpu names one node.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="--slurm: nodes to ask for.")
@click.option("--partition", help="--slurm: the partition.")
@click.option("--time", "time_limit", help="--slurm: the time limit, e.g. 24:00:00 (a requeue resumes past it).")
@click.option("--account", help="--slurm: the account to charge.")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, help="--slurm: one more #SBATCH option (repeatable).")
@click.option(
    "--master-addr",
    help="--slurm: the address every node reaches the first one at [default: its NodeAddr from scontrol].",
)
@click.option(
    "--rendezvous-timeout",
    type=FiniteFloat(min=0, max=86400),
    default=300.0,
    show_default=True,
    help="--slurm: seconds for every node to reach MASTER_ADDR before an attempt fails as `rendezvous` (0: no check).",
)
def train(
    config: str,
    overrides: tuple[str, ...],
    foreground: bool,
    follow: bool,
    existing: str | None,
    as_json: bool,
    engine: str | None,
    address: str | None,
    slurm: bool,
    nodes: int,
    partition: str | None,
    time_limit: str | None,
    account: str | None,
    sbatch_args: tuple[str, ...],
    master_addr: str | None,
    rendezvous_timeout: float,
    simulate: bool | None,
    **kw: Any,
) -> None:
    """Plan CONFIG, then run `llamafactory-cli train` on the adapted config, supervised.

    Takes the same arguments as `llamafactory-cli train`: a YAML and key=value overrides.
    By default the run is detached: it survives the shell and SSH; follow it with `ftlaunch logs -f`.

    With --engine slurm (or --slurm), the run is a Slurm batch job over --nodes nodes of --gpu each
    (torchrun across nodes, requeued and resumed when the time limit nears), checked here first as any
    run is (LLaMA-Factory's parser, the disk forecast, a tight plan simulated); status, logs, stop work
    as for any run, and resume submits it again. --gpu none: CPU nodes (fp32, gloo, one process per node).

    With --engine ray, the run is a Ray job on the cluster at --address (or RAY_ADDRESS), planned for
    its largest node's resources; its supervisor is the job's driver, and a job that fails from outside
    (driver killed, node lost) is submitted again and resumes from the last complete checkpoint:
    `ftlaunch train cfg.yaml --engine ray --address http://HEAD:8265 --gpu nonex2` (an example that
    needs a head, so not in the list below, whose every line tests/cli/test_help_examples.py runs).

    \b
    Examples:
      ftlaunch train cfg.yaml
      ftlaunch train cfg.yaml learning_rate=2e-5 --follow
      ftlaunch train cfg.yaml --foreground
      ftlaunch train cfg.yaml --engine slurm --nodes 2 --gpu A100-80GBx8 --partition gpu --time 24:00:00
      ftlaunch train cfg.yaml --slurm --nodes 2 --gpu none --partition cpu
    """
    from ftlaunch.run.launch import start_run
    from ftlaunch.run.options import RunOptions
    from ftlaunch.run.outdir import Existing

    notify = _notify_spec(kw)
    if not notify:  # $FTLAUNCH_HOME/notify.yaml then: checked before anything is written (exit 19)
        from ftlaunch.run.notify import load_file

        load_file(env_now())
    opts = RunOptions.from_kwargs(kw)
    if slurm and engine not in (None, "slurm"):
        raise click.UsageError(f"--slurm is --engine slurm: it does not go with --engine {engine}")
    engine = "slurm" if slurm else engine or "local"
    if address and engine != "ray":
        raise click.UsageError("--address goes with --engine ray")
    eng = _ray_engine(address, foreground, follow) if engine == "ray" else None
    eng = eng or _engine(engine, foreground, follow, as_json, nodes, partition, time_limit, account, sbatch_args,
                         master_addr, rendezvous_timeout)  # fmt: skip
    started = start_run(
        opts.plan_request(config, overrides, strict=True, progress=stderr_is_tty()),
        env_now(),
        opts.supervisor_settings(),
        engine=eng,
        existing=Existing(existing or "refuse"),
        simulate=simulate,
        on_created=lambda run_dir, p: (_keep_notify(run_dir, notify), _show_created(run_dir, p, as_json, foreground)),
        say=lambda text: err_console.print(text, highlight=False),
    )
    if started.job is not None and engine == "ray":
        _show_ray_submitted(started, as_json)
        return
    if started.job is not None:
        _show_submitted(started, nodes, as_json)
        return
    _show_started(started, as_json, foreground)
    if follow:
        follow_and_exit(started.run_dir)


def _engine(
    name: str,
    foreground: bool,
    follow: bool,
    as_json: bool,
    nodes: int,
    partition: str | None,
    time_limit: str | None,
    account: str | None,
    sbatch_args: tuple[str, ...],
    master_addr: str | None,
    rendezvous_timeout: float,
) -> Any:
    """The engine `train` hands the run to, built from its options (each engine's own refused elsewhere)."""
    from ftlaunch.run import engines

    if name == "slurm":
        if foreground or follow:
            raise click.UsageError("--engine slurm runs as a batch job: follow it with `ftlaunch logs -f`")
        from ftlaunch.run.slurm.sbatch import SlurmRequest

        job = SlurmRequest(
            nodes, 0, partition, time_limit, account, tuple(sbatch_args),
            master_addr=master_addr, rendezvous_timeout=rendezvous_timeout,
        )  # fmt: skip
        return engines.get("slurm")(job=job, cwd=os.getcwd())
    if any((nodes != 1, partition, time_limit, account, sbatch_args, master_addr)):
        raise click.UsageError(
            "--nodes, --partition, --time, --account, --sbatch-arg and --master-addr go with --slurm"
        )
    return engines.get(name)(foreground=foreground, echo=not as_json)


def _ray_engine(address: str | None, foreground: bool, follow: bool) -> Any:
    """--engine ray: the head's address from --address, else RAY_ADDRESS (read here, at the edge)."""
    from ftlaunch.run import engines

    if foreground or follow:
        raise click.UsageError("--engine ray runs as a Ray job: follow it with `ftlaunch logs -f`")
    return engines.get("ray")(address=address, env=env_now())


def _show_ray_submitted(started: Started, as_json: bool) -> None:
    """A run submitted as a Ray job: its submission id and how to watch it."""
    run_dir, job = started.run_dir, started.job
    if as_json:
        echo_json({"id": run_dir.name, "run_dir": str(run_dir), "ray_submission_id": job})
        return
    click.echo(f"submitted run {run_dir.name} as Ray job {job}; follower pid {started.pid}")
    click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
    click.echo(f"  status: ftlaunch status {run_dir.name}   (the job's word beside it)")
    click.echo(f"  stop:   ftlaunch stop {run_dir.name}     (never retried)")


def _notify_spec(kw: dict[str, Any]) -> Any:
    """--notify/--notify-cmd/--notify-on taken out of ``kw``, checked (every bad URL listed, exit 2)."""
    import importlib.util

    from ftlaunch.run.notify import NotifySpec, parse_on, url_problems

    urls, cmd, on = tuple(kw.pop("notify_urls", ()) or ()), kw.pop("notify_cmd", None), kw.pop("notify_on", None)
    problems = url_problems(urls, apprise_ok=importlib.util.find_spec("apprise") is not None)
    if problems:
        raise click.BadParameter("; ".join(problems), param_hint="--notify")
    return NotifySpec(urls=urls, cmd=cmd or None, on=parse_on(on))


def _notice_lost(views: list[Any]) -> None:
    """A run found lost (its supervisor dead without an end) tells its notification destinations,
    once per dead supervisor, from a detached child: this command never waits for it."""
    lost = [v for v in views if v.status.value == "lost"]
    if lost:
        from ftlaunch.run.notify import notice_lost

        for v in lost:
            notice_lost(Path(v.run_dir), env_now(), v.pid)


def notify_all() -> frozenset[str]:
    from ftlaunch.run.notify import EVENTS

    return frozenset(EVENTS)


def _keep_notify(run_dir: Path, spec: Any) -> None:
    """The destinations (and the events chosen) go to the run's secrets.json (0600) before its
    supervisor starts."""
    from ftlaunch.run.notify import keep_spec

    if spec or spec.on != notify_all():
        keep_spec(run_dir, spec)


def _show_created(run_dir: Path, p: Plan, as_json: bool, foreground: bool) -> None:
    """Once the run folder exists: its plan on stderr (not with --json), and where a foreground run lives."""
    from ftlaunch.present.render import plan_renderables

    if not as_json:
        for r in plan_renderables(p):
            err_console.print(r)
    if foreground:
        err_console.print(f"run {run_dir.name} (foreground); run dir {run_dir}", highlight=False)


def _show_started(started: Started, as_json: bool, foreground: bool) -> None:
    """A detached run: its id and how to watch it. A foreground run has ended: exit with its code."""
    run_dir = started.run_dir
    if foreground:
        if as_json:
            echo_json({"id": run_dir.name, "run_dir": str(run_dir), "exit_code": started.exit_code})
        sys.exit(started.exit_code)
    if as_json:
        echo_json({"id": run_dir.name, "run_dir": str(run_dir), "pid": started.pid})
        return
    click.echo(f"started run {run_dir.name} (supervisor pid {started.pid})")
    _how_to_watch(run_dir)


def _show_submitted(started: Started, nodes: int, as_json: bool) -> None:
    """A run submitted to a scheduler (Slurm): its job and how to watch it."""
    from ftlaunch.run.store import RunFolder

    for n in started.notes:  # a local filesystem works when every "node" is this machine: say so, do not refuse
        click.echo(f"warning: {n}", err=True)
    run_dir, job = started.run_dir, started.job
    if as_json:
        echo_json({"id": run_dir.name, "run_dir": str(run_dir), "slurm_job_id": job})
        return
    script = RunFolder(run_dir).job_script
    click.echo(f"submitted run {run_dir.name} as Slurm job {job} ({nodes} node(s)); script {script}")
    click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
    click.echo(f"  status: ftlaunch status {run_dir.name}   (queued while Slurm holds it)")
    click.echo(f"  stop:   ftlaunch stop {run_dir.name}     (scancel)")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--watch",
    is_flag=True,
    help="Redraw every run in place (engine, status, step/total, loss sparkline, tokens/s, ETA, restarts,"
    " last event) until q or Ctrl-C.",
)
@click.option(
    "--interval",
    type=FiniteFloat(0.2, 3600),
    default=1.0,
    show_default=True,
    help="--watch: seconds between redraws.",
)
def runs(as_json: bool, watch: bool, interval: float) -> None:
    """List every run: id, name, status, progress, started, output_dir. `--watch` keeps a live view of
    them all (q or Ctrl-C leaves).

    \b
    Example:
      ftlaunch runs
    """
    if watch:
        from ftlaunch.cli.watch import watch_runs

        watch_runs(env_now(), interval)
        return
    from ftlaunch.run.view import all_runs

    rows = all_runs(env_now())
    _notice_lost(rows)
    if as_json:
        echo_json([r.to_json() for r in rows])
        return
    console.print(runs_table(rows))


@click.command()
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True)
def status(run: str | None, as_json: bool) -> None:
    """Status of RUN (id, prefix or name; default the latest). Exit 0 succeeded, 11 running, 1 otherwise.

    \b
    Examples:
      ftlaunch status
      ftlaunch status nightly --json
    """
    from ftlaunch.run.view import find_run, run_view

    view = run_view(find_run(env_now(), run))
    _notice_lost([view])
    if as_json:
        echo_json(view.to_json())
    else:
        console.print(status_table(view))
    sys.exit(view.status.exit_code())


@click.command()
@click.argument("run", required=False)
@click.option("--follow", "-f", is_flag=True, help="Keep following, across restarts, until the run ends.")
def logs(run: str | None, follow: bool) -> None:
    """Print the log of RUN (default the latest).

    \b
    Examples:
      ftlaunch logs
      ftlaunch logs -f 20261130-1200
    """
    from ftlaunch.run.store import RunFolder
    from ftlaunch.run.view import find_run

    run_dir = find_run(env_now(), run)
    if follow:
        follow_log(run_dir)
        return
    with open(RunFolder(run_dir).train_log, "rb") as f:
        sys.stdout.buffer.write(f.read())


@click.command()
@click.argument("run", required=False)
@click.option(
    "--grace",
    type=FiniteFloat(min=0, max=3600),
    default=30.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL (0 to 3600).",
)
def stop(run: str | None, grace: float) -> None:
    """Stop RUN gracefully: SIGTERM to the trainer's process group, then SIGKILL. Checkpoints stay.

    \b
    Example:
      ftlaunch stop
    """
    from ftlaunch.run.control import stop_run
    from ftlaunch.run.view import find_run

    env = env_now()
    click.echo(stop_run(find_run(env, run), env, grace=grace))


@click.command()
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
@click.option(
    "--allow-env-change",
    is_flag=True,
    help="Resume from the checkpoint although torch/transformers/llamafactory/peft/... changed since (else exit 18).",
)
@click.option(
    "--gpu",
    "gpu",
    help="Re-plan the run for this machine first (catalog card[xN], none, or nonexN: N CPU processes), "
    "the global batch kept exactly; the changes are shown. A name not in the catalog: exit 4, the names listed.",
)
@click.option(
    "--hardware",
    "hardware_file",
    type=click.Path(dir_okay=False),
    help="Re-plan the run for a machine captured there with `ftlaunch env --json` (as --gpu).",
)
@notify_options
def resume(
    args: tuple[str, ...],
    foreground: bool,
    follow: bool | None,
    allow_global_batch_change: bool,
    allow_env_change: bool,
    gpu: str | None,
    hardware_file: str | None,
    **notify_kw: Any,
) -> None:
    """Re-attach to RUN if alive (follow its log); else restart it from its last complete checkpoint.

    A Slurm run is never trained where `resume` is typed: while Slurm holds its job nothing is done
    (the job resumes when it runs); else its job.sbatch is submitted again (sbatch).
    --notify/--notify-cmd/--notify-on replace the run's notification settings from this start on.

    ARGS: [RUN] [key=value ...]. Overrides change the run's adapted config before it restarts
    (a run that gave up, resumed by hand after a change); the global batch should stay the same.
    While following, Ctrl-C stops following only; at the end it exits like `status`.

    --gpu/--hardware: resume on other hardware. The run is planned again for that machine with its
    global batch kept (micro-batch x accumulation x processes), from its last complete checkpoint:
    weights, optimizer, scheduler, step and data position; the same rows in the same order as an
    uninterrupted run (a warning says where not: group_by_length, streaming, a last partial batch).
    Refused before anything changes (exit 3) where that cannot hold: a global batch that cannot be
    kept, a DeepSpeed checkpoint on another process count. Without either option the run resumes as it
    was planned (this machine is not probed).

    \b
    Examples:
      ftlaunch resume            # after SSH loss, a reboot or `ftlaunch stop`
      ftlaunch resume --no-follow
      ftlaunch resume nightly per_device_train_batch_size=1 gradient_accumulation_steps=8
      ftlaunch resume nightly --gpu none     # a run of 2 processes goes on in 1, global batch kept
      ftlaunch resume nightly --gpu nonex2   # ... and back in 2 CPU processes
      ftlaunch resume nightly --hardware hw.json   # a machine captured with `ftlaunch env --json`
    """
    from ftlaunch.run.control import ResumeOutcome, preview_run_edit, resume_run
    from ftlaunch.run.view import find_run

    runs = [a for a in args if "=" not in a]
    overrides = tuple(a for a in args if "=" in a)
    if len(runs) > 1:
        raise click.UsageError(f"one RUN at most, got {', '.join(runs)}")
    run_dir = find_run(env_now(), runs[0] if runs else None)
    notify = _notify_spec(notify_kw)
    if notify or notify.on != notify_all():
        from ftlaunch.run.notify import keep_spec

        keep_spec(run_dir, notify)  # read by the supervisor this resume starts (a live one keeps its own)
    from ftlaunch.run.notify import read_spec

    read_spec(run_dir, env_now())  # a run with no destination of its own: notify.yaml's, checked (exit 19)
    hardware = None
    if gpu is not None or hardware_file is not None:
        from dataclasses import replace

        from ftlaunch.plan.hardware import check_typed_machine
        from ftlaunch.present.render import plan_renderables
        from ftlaunch.run.control import preview_replan
        from ftlaunch.run.prepare import PlanRequest, get_hardware
        from ftlaunch.run.store import RunFolder

        check_typed_machine([gpu] if gpu is not None else [])
        request = PlanRequest(config=str(RunFolder(run_dir).config), gpu=gpu, hardware_file=hardware_file)
        hardware = get_hardware(request, env_now())
        r = preview_replan(run_dir, hardware)
        for item in plan_renderables(replace(r.plan, changes=r.changes), title=f"resume {run_dir.name}"):
            err_console.print(item)
        err_console.print(f"resumes from {r.checkpoint or 'the start (no complete checkpoint)'}", highlight=False)
        for note in r.notes:
            err_console.print(f"note: {note}", highlight=False)
        for warning in r.warnings:
            err_console.print(f"warning: {warning}", highlight=False)
    if overrides:
        for key, before, after, note in preview_run_edit(run_dir, overrides):
            err_console.print(f"  {key}: {before} -> {after}{f'  ({note})' if note else ''}", highlight=False)
    resumed = resume_run(
        run_dir,
        env_now(),
        foreground=foreground,
        overrides=overrides,
        allow_global_batch_change=allow_global_batch_change,
        allow_env_change=allow_env_change,
        cwd=os.getcwd(),
        hardware=hardware,
    )
    pid = resumed.pid
    if resumed.outcome is ResumeOutcome.ALIVE:
        where = f"supervisor pid {pid}" if pid else f"{resumed.engine_label} job {resumed.job}"
        alive = f"run {run_dir.name} is alive ({where})"
        if follow is False:
            click.echo(f"{alive}; follow it: ftlaunch logs -f {run_dir.name}")
            return
        click.echo(f"{alive}; following its log (Ctrl-C stops following)")
        follow_and_exit(run_dir, tail_lines=FOLLOW_TAIL_LINES)
    elif resumed.outcome is ResumeOutcome.FINISHED:
        click.echo(f"run {run_dir.name} already succeeded; nothing to do")
    elif resumed.outcome is ResumeOutcome.IN_SLURM:
        click.echo(
            f"run {run_dir.name} is Slurm job {resumed.job} ({str(resumed.slurm_state).lower()}): it resumes from its "
            "last complete checkpoint when it runs; nothing submitted"
        )
        click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
    elif resumed.outcome is ResumeOutcome.RESUBMITTED:
        click.echo(f"run {run_dir.name} submitted again as {resumed.engine_label} job {resumed.job}; it resumes when the job runs")
        click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
    elif resumed.outcome is ResumeOutcome.FOREGROUND:
        sys.exit(resumed.exit_code)
    else:
        click.echo(f"run {run_dir.name} restarted (supervisor pid {pid})")
        if follow:
            follow_and_exit(run_dir, tail_lines=FOLLOW_TAIL_LINES)
        click.echo(f"  follow: ftlaunch logs -f {run_dir.name}")
