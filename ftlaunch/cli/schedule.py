"""`ftlaunch schedule ...`: the click edge of ``ftlaunch.schedule``. Parse, call, render; no decisions.

Errors are FtlaunchError subclasses; the top-level group (``ftlaunch.cli.main``) maps them to exit codes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ftlaunch.cli.options import env_now, run_options
from ftlaunch.cli.render import Out

console = Out()
err_console = Out(stderr=True)


def _echo_json(obj: Any) -> None:
    from ftlaunch.files import to_json

    click.echo(to_json(obj))


@click.group("schedule")
def schedule_group() -> None:
    """Retrain on a schedule: cron calls `ftlaunch schedule run NAME`; runs never overlap.

    Each run trains into <output_dir>/<NAME>-<UTC time>; <output_dir>/latest points at the newest
    success. See docs/schedule.md.

    \b
    Example:
      ftlaunch schedule add nightly cfg.yaml --cron "0 2 * * *" --keep 5
      ftlaunch schedule list
      ftlaunch schedule remove nightly
    """


@schedule_group.command("add")
@click.argument("name")
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--cron", "cron_expr", required=True, help='When: 5 cron fields or @daily etc., e.g. "0 2 * * *".')
@click.option(
    "--keep", type=click.IntRange(min=1, max=10_000), help="Keep the N newest successful outputs; prune older ones."
)
@click.option(
    "--only-if-changed",
    is_flag=True,
    help="Skip when config and dataset files are unchanged since the last success.",
)
@click.option("--notify", help="On success and failure: POST a JSON summary to this URL, or run this command.")
@click.option(
    "--notify-cmd",
    metavar="CMD",
    help="As `train --notify-cmd`: each run's supervisor runs this command on the run's events (JSON on stdin).",
)
@click.option(
    "--notify-on",
    metavar="EVENTS",
    help="As `train --notify-on`: which events of each run notify, comma-separated [default: all].",
)
@run_options
@click.option(
    "--print",
    "print_only",
    is_flag=True,
    help="Register the schedule and print the crontab line and systemd units; install nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print {name, line, units, installed, next} as JSON.")
def add(
    name: str,
    config: str,
    overrides: tuple[str, ...],
    cron_expr: str,
    keep: int | None,
    only_if_changed: bool,
    notify: str | None,
    notify_cmd: str | None,
    notify_on: str | None,
    print_only: bool,
    as_json: bool,
    **kw: Any,
) -> None:
    """Schedule CONFIG as NAME: check the cron expression, plan the config now, install one crontab line.

    Takes every option `train` takes (hardware, batch, memory, --mirror, --name, retries), so a
    scheduled run is the same run. The line calls this same Python environment by absolute path and
    carries FTLAUNCH_HOME, never secrets. Every other line of your crontab stays as it is.

    \b
    Example:
      ftlaunch schedule add nightly cfg.yaml --cron "0 2 * * *" --keep 5 --only-if-changed
      ftlaunch schedule add weekly cfg.yaml learning_rate=1e-5 --cron @weekly --notify https://hooks.example/x
      ftlaunch schedule add monthly cfg.yaml --cron "0 3 1 * *" --gpu A100-80GB --print   # install it yourself
    """
    from ftlaunch.run.notify import parse_on
    from ftlaunch.run.options import RunOptions
    from ftlaunch.schedule.manage import ScheduleSpec, add_schedule

    spec = ScheduleSpec(
        name=name,
        config=config,
        cron=cron_expr,
        overrides=tuple(overrides),
        keep=keep,
        only_if_changed=only_if_changed,
        notify=notify,
        notify_cmd=notify_cmd or None,
        notify_on=tuple(sorted(parse_on(notify_on))) if notify_on else None,
        run=RunOptions.from_kwargs(kw),
        cwd=os.getcwd(),
    )
    a = add_schedule(spec, env_now(), install=not print_only)
    nxt = a.next_time.strftime("%Y-%m-%d %H:%M") if a.next_time else "never"
    if as_json:
        _echo_json({"name": name, "line": a.line, "units": a.units, "installed": a.installed, "next": nxt})
        return
    if print_only:
        click.echo("# crontab line (run `crontab -e` and paste it):")
        click.echo(a.line)
        click.echo("\n# or a systemd user timer: save both files, then")
        click.echo("#   systemctl --user daemon-reload && systemctl --user enable --now " + f"ftlaunch-{name}.timer")
        for fname, text in a.units.items():
            click.echo(f"\n# ~/.config/systemd/user/{fname}")
            click.echo(text, nl=False)
        err_console.print(f"registered schedule {name} (next {nxt}); nothing installed", highlight=False, markup=False)
        return
    click.echo(f"added schedule {name}: {a.record.cron} (next {nxt} local time)")
    click.echo(f"  crontab: {a.line}")
    click.echo(f"  now:     ftlaunch schedule run {name}")


@schedule_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="One object per schedule.")
def list_cmd(as_json: bool) -> None:
    """List schedules: name, cron, config, last run, result, next time.

    \b
    Example:
      ftlaunch schedule list
      ftlaunch schedule list --json
    """
    from ftlaunch.schedule.views import list_views

    rows = list_views(env_now())
    if as_json:
        _echo_json(rows)
        return
    from ftlaunch.present.tables import Col, Grid

    # name, cron and next whole; the config path wraps at its slashes; last run (a time and a run
    # id) and result wrap between words only
    t = Grid(
        Col("name"),
        Col("cron"),
        Col("config", "path"),
        Col("last run", "prose"),
        Col("result", "prose"),
        Col("next"),
        title=f"{len(rows)} schedule(s)",
    )
    for r in rows:
        t.add_row(
            r["name"],
            str(r.get("cron") or "-"),
            str(r.get("config") or "-"),
            f"{r['last_run']} ({r['run_id']})" if r.get("run_id") else str(r.get("last_run") or "-"),
            str(r.get("result") or "-"),
            str(r.get("next") or "-")[:16].replace("T", " "),  # local time, to the minute
        )
    console.print(t)


@schedule_group.command("remove")
@click.argument("name")
def remove(name: str) -> None:
    """Remove schedule NAME: its own crontab line and its record. Outputs and runs stay.

    \b
    Example:
      ftlaunch schedule remove nightly
    """
    from ftlaunch.schedule.manage import remove_schedule

    r = remove_schedule(name, env_now())
    what = "its crontab line removed" if r.entries_removed else "no crontab line was installed"
    click.echo(f"removed schedule {name} ({what})")


@schedule_group.command("run")
@click.argument("name")
def run(name: str) -> None:
    """Run schedule NAME once, in the foreground: what cron calls; also usable by hand.

    Exits with the run's code; 7 at once if NAME is already running (the skip is recorded);
    0 when --only-if-changed found nothing new.

    \b
    Example:
      ftlaunch schedule run nightly
    """
    from ftlaunch.schedule.runner import run_schedule

    def say(text: str) -> None:
        err_console.print(text, highlight=False, markup=False)

    r = run_schedule(name, env_now(), echo=sys.stdout.isatty(), say=say)
    if r.notify_error:
        say(f"schedule {name}: notification failed (the run's result stands): {r.notify_error}")
    sys.exit(r.exit_code)
