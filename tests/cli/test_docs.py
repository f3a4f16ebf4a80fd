"""Every command is documented in the README and has help with an example (sqlite-utils test_docs)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ftlaunch.cli.main import main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def all_commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in group.commands.items():
        out.append((f"{prefix}{name}", cmd))
        if isinstance(cmd, click.Group):
            out += all_commands(cmd, f"{prefix}{name} ")
    return out


@pytest.mark.parametrize("name,cmd", all_commands(main), ids=lambda x: x if isinstance(x, str) else "")
def test_command_in_readme_and_help_has_example(name, cmd):
    assert f"ftlaunch {name}" in README or f"{name}|" in README or f"|{name}" in README, name
    help_text = cmd.help or ""
    assert "Example" in help_text or "example" in help_text.lower(), name


def test_help_runs():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "plan" in r.output


def test_readme_names_the_two_commands_and_ci_calls_the_test_command():
    assert "bash scripts/demo.sh" in README and "bash scripts/test.sh" in README
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci
