"""The `ftlaunch` group: errors mapped to exit codes, the llamafactory-cli passthrough commands,
and every other command registered from its module.

Commands live by what they touch: plan_cmds (plan, env, download), run_cmds (train, runs, status,
logs, stop, resume), estimate (estimate), plot (plot), schedule (the schedule group). They import
nothing from here, so `python -m ftlaunch.cli.main` and `python -m ftlaunch` build the same group.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from rich.markup import escape

from ftlaunch import __version__
from ftlaunch.cli.estimate import estimate_cmd
from ftlaunch.cli.options import env_now
from ftlaunch.cli.plan_cmds import download, env_cmd, plan
from ftlaunch.cli.plot import plot_cmd
from ftlaunch.cli.render import err_console
from ftlaunch.cli.run_cmds import logs, resume, runs, status, stop, train
from ftlaunch.cli.schedule import schedule_group
from ftlaunch.errors import DoesNotFitError, FtlaunchError, StateError

PASSTHROUGH = ("api", "chat", "eval", "export", "webchat", "webui", "version")


class FtlaunchGroup(click.Group):
    """A click group that maps every FtlaunchError to its message, hint and exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FtlaunchError as exc:
            if os.environ.get("FTLAUNCH_DEBUG") == "1":
                raise
            _report(ctx, exc)
        except OSError as exc:  # FTLAUNCH_HOME full, read-only or not ours: exit 12, not a traceback
            from ftlaunch.files import home
            from ftlaunch.run.disk import HOME_HINT, home_write_problem

            problem = home_write_problem(exc, home(env_now()))
            if problem is None or os.environ.get("FTLAUNCH_DEBUG") == "1":
                raise
            _report(ctx, StateError(problem, hint=HOME_HINT))


def _report(ctx: click.Context, exc: FtlaunchError) -> None:
    """Print an error's message and hint, and exit with its code."""
    err_console.print(f"[red]error:[/red] {escape(exc.message)}", highlight=False, markup=True)
    if isinstance(exc, DoesNotFitError) and exc.alternatives:
        from ftlaunch.plan.render import alternatives_table

        err_console.print(alternatives_table(exc.alternatives))
    if exc.hint:
        err_console.print(f"hint: {exc.hint}", highlight=False, markup=False)
    ctx.exit(int(exc.exit_code))


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


for _cmd in (plan, env_cmd, download, train, runs, status, logs, stop, resume):
    main.add_command(_cmd)
main.add_command(estimate_cmd, "estimate")
main.add_command(plot_cmd, "plot")
main.add_command(schedule_group, "schedule")
for _name in PASSTHROUGH:
    main.add_command(_passthrough(_name))


if __name__ == "__main__":
    main()
