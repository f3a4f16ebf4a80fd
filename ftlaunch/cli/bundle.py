"""`ftlaunch bundle`: one tar.gz of a run to attach to an issue (ftlaunch.run.bundle), secrets redacted."""

from __future__ import annotations

from pathlib import Path

import click

from ftlaunch.cli.options import env_now


@click.command()
@click.argument("run", required=False)
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the archive (default ./ftlaunch-bundle-<id>.tar.gz).",
)
def bundle_cmd(run: str | None, output: Path | None) -> None:
    """Write a support bundle of RUN (default the latest): plan, configs, hardware, environment, events,
    log tails, stacks, the last checkpoint's trainer_state.json and a failure summary, every secret
    redacted (secrets.json is never included).

    \b
    Examples:
      ftlaunch bundle
      ftlaunch bundle 20261130-1200 -o bug-report.tar.gz
    """
    from ftlaunch.run.bundle import write_bundle
    from ftlaunch.run.view import find_run

    env = env_now()
    run_dir = find_run(env, run)
    out = output if output is not None else Path.cwd() / f"ftlaunch-bundle-{run_dir.name}.tar.gz"
    b = write_bundle(run_dir, out.absolute(), env)
    click.echo(f"wrote {b.path} ({b.size:,} bytes, {len(b.members)} files); secrets redacted, secrets.json left out")
