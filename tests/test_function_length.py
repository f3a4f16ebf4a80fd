"""No function in ftlaunch/run/ is over 60 lines (issue 32): a longer one is split into named helpers,
its decisions into pure functions (docs/architecture.md). Checked on the source with ast; a def's
lines run from its ``def`` to its last line, docstring and comments included.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

RUN = Path(__file__).resolve().parent.parent / "ftlaunch" / "run"
MAX_LINES = 60
KNOWN: set[str] = set()  # "path::name" over the limit, each with its issue; none now


def _defs(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function under ``node``: methods and nested functions too."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{child.name}", child
            yield from _defs(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _defs(child, f"{prefix}{child.name}.")
        else:
            yield from _defs(child, prefix)


def long_functions(root: Path, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """("path::qualified name", lines) of every function under ``root`` longer than ``limit``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent.parent).as_posix()
        for name, fn in _defs(ast.parse(path.read_text(), str(path))):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > limit:
                found.append((f"{rel}::{name}", lines))
    return found


def test_no_function_in_run_over_60_lines():
    over = [f"{where} ({n} lines)" for where, n in long_functions(RUN) if where not in KNOWN]
    assert not over, f"split these into named helpers (at most {MAX_LINES} lines each): {over}"


def test_known_exceptions_are_still_long():
    # An exception that got short is taken off the list, so the list never hides a new long one.
    long = {where for where, _ in long_functions(RUN)}
    assert KNOWN <= long, f"no longer over {MAX_LINES} lines, drop from KNOWN: {sorted(KNOWN - long)}"


def test_the_walk_finds_a_long_method(tmp_path):
    pkg = tmp_path / "ftlaunch" / "run"
    pkg.mkdir(parents=True)
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))  # with its def: one line too many
    (pkg / "m.py").write_text(f"class C:\n    def short(self):\n        pass\n\n    def long(self):\n{body}\n")
    assert long_functions(pkg) == [("ftlaunch/run/m.py::C.long", MAX_LINES + 1)]
