"""`ftlaunch bundle`: one tar.gz of a run to attach to an issue (ftlaunch.run.bundle), secrets redacted.

Where it goes is ftlaunch.outfile's to say (``-o -`` is stdout; a symlink is followed; a FIFO or a
character device is written through, never replaced); here: ``-o ''`` is a usage error, and a
terminal is never sent the compressed bytes (as gzip refuses).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ftlaunch.cli.options import env_now


def _output(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value == "":
        raise click.BadParameter("is empty: name a file, or - for stdout", ctx=ctx, param=param)
    return value


@click.command()
@click.argument("run", required=False)
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(dir_okay=False, allow_dash=True),
    callback=_output,
    help="Where to write the archive (default ./ftlaunch-bundle-<id>.tar.gz); - streams it to stdout. "
    "A symlink is followed (what it points to is written, the link stays); a FIFO or a character "
    "device is written through, never replaced; a regular file is replaced whole or not at all.",
)
def bundle_cmd(run: str | None, output: str | None) -> None:
    """Write a support bundle of RUN (default the latest): plan, configs, hardware, environment, events,
    log tails, stacks, the last checkpoint's trainer_state.json and a failure summary, every secret
    redacted (secrets.json is never included).

    \b
    Examples:
      ftlaunch bundle
      ftlaunch bundle 20261130-1200 -o bug-report.tar.gz
      ftlaunch bundle 20261130-1200 -o - | tar tzf -
    """
    from ftlaunch.run.bundle import write_bundle
    from ftlaunch.run.view import find_run

    env = env_now()
    run_dir = find_run(env, run)
    to_stdout = output == "-"
    stdout = sys.stdout.buffer  # looked up now: a test's CliRunner swaps sys.stdout
    if to_stdout and stdout.isatty():
        raise click.UsageError("-o - would write compressed bytes to a terminal: pipe or redirect it")
    out = output if output is not None else str(Path.cwd() / f"ftlaunch-bundle-{run_dir.name}.tar.gz")
    try:
        b = write_bundle(run_dir, out, env, stdout=stdout)
    except Exception:
        if to_stdout:
            _quiet_stdout()
        raise
    how = f", {b.how}" if b.how.startswith("through") else ""
    click.echo(
        f"wrote {b.path} ({b.size:,} bytes, {len(b.members)} files{how}); secrets redacted, secrets.json left out",
        err=to_stdout,  # stdout holds the archive
    )


def _quiet_stdout() -> None:
    """After a failed stream (a reader gone), stdout points at /dev/null, so the interpreter's last
    flush of what is buffered raises nothing more (the error itself is reported on stderr)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return  # not a real stream (tests' CliRunner)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
