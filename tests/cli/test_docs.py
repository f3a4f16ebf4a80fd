"""Every command is documented in the README and has help with an example (sqlite-utils test_docs)."""

from __future__ import annotations

import re
import sys
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


ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(pages: list[Path]) -> list[str]:
    """Every relative link of the pages that names no file, or a heading its page does not have."""
    bad = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (frag and dest.suffix == ".md" and frag not in anchors(dest)):
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    return bad


def test_the_link_checker_finds_a_missing_page_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# A page\n## `ftlaunch runs --watch [--interval 1]`\n")
    (tmp_path / "b.md").write_text("[ok](a.md#a-page) [ok](a.md#ftlaunch-runs---watch---interval-1) "
                                   "[no](c.md) [no](a.md#nothing) [web](https://x.org/y)\n")  # fmt: skip
    assert broken_links([tmp_path / "b.md"]) == ["b.md: c.md", "b.md: a.md#nothing"]


def test_links_of_the_readme_and_docs_are_relative_and_valid():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert broken_links(pages) == []


def test_the_readme_is_a_guide_the_reference_is_in_docs():
    lines = README.splitlines()
    assert len(lines) <= 400, len(lines)
    first = "\n".join(lines[:60])
    assert "bash scripts/demo.sh" in first and "bash scripts/test.sh" in first
    for page in ("commands-plan.md", "commands-run.md", "commands-setup.md", "testing.md", "layout.md"):
        assert f"docs/{page}" in README and (ROOT / "docs" / page).is_file(), page
