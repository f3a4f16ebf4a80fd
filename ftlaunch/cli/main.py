"""The `ftlaunch` group: errors mapped to exit codes, the llamafactory-cli passthrough commands,
and every other command, imported from its module only when it is run (or listed).

Commands live by what they touch: plan_cmds (plan, env, download), run_cmds (train, runs, status,
logs, stop, resume), estimate (estimate), plot (plot), schedule (the schedule group). They import
nothing from here, so `python -m ftlaunch.cli.main` and `python -m ftlaunch` build the same group.
A plan imports planning only: not the supervisor, the estimator, matplotlib or the scheduler
(scripts/bench_plan.py times it).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import click

from ftlaunch import __version__
from ftlaunch.cli.options import env_now
from ftlaunch.errors import DoesNotFitError, FtlaunchError, StateError

PASSTHROUGH = ("api", "chat", "eval", "export", "webchat", "webui", "version")

# module under ftlaunch.cli -> {command name: attribute}; each command is imported when looked up
_BY_MODULE: Mapping[str, Mapping[str, str]] = {
    "plan_cmds": {"plan": "plan", "env": "env_cmd", "download": "download"},
    "run_cmds": {name: name for name in ("train", "runs", "status", "logs", "stop", "resume")},
    "estimate": {"estimate": "estimate_cmd"},
    "plot": {"plot": "plot_cmd"},
    "schedule": {"schedule": "schedule_group"},
    "bundle": {"bundle": "bundle_cmd"},
}
COMMANDS: Mapping[str, tuple[str, str]] = {
    name: (f"ftlaunch.cli.{module}", attr) for module, names in _BY_MODULE.items() for name, attr in names.items()
}


class LazyCommands(MutableMapping[str, click.Command]):
    """The group's ``commands``: names known up front, each command imported on first lookup.

    click reads a group's commands only through this mapping (``get``, ``sorted(...)``, ``[name] =``),
    so `ftlaunch plan` imports cli.plan_cmds and nothing of run/, estimate/ or schedule/."""

    def __init__(self, specs: Mapping[str, tuple[str, str]]) -> None:
        self._specs = dict(specs)
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            module, attr = self._specs[name]  # KeyError: no such command
            self._loaded[name] = getattr(importlib.import_module(module), attr)
        return self._loaded[name]

    def __setitem__(self, name: str, cmd: click.Command) -> None:
        self._specs.pop(name, None)
        self._loaded[name] = cmd

    def __delitem__(self, name: str) -> None:
        if name not in self._specs and name not in self._loaded:
            raise KeyError(name)
        self._specs.pop(name, None)
        self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self._specs, *self._loaded]))

    def __len__(self) -> int:
        return len(set(self._specs) | set(self._loaded))


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
    from rich.markup import escape

    from ftlaunch.cli.render import err_console

    err_console.print(f"[red]error:[/red] {escape(exc.message)}", highlight=False, markup=True)
    if isinstance(exc, DoesNotFitError) and exc.alternatives:
        from ftlaunch.present.render import alternatives_table

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


main.commands = LazyCommands(COMMANDS)  # type: ignore[assignment]  # click reads it as a mapping
for _name in PASSTHROUGH:
    main.add_command(_passthrough(_name))


if __name__ == "__main__":
    main()
