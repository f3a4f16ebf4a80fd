"""One writer of a run's state and events (issue 32): only the journal (ftlaunch/run/journal.py, the
supervisor's records, and ftlaunch/run/transitions.py, everyone else's named transitions) calls the
store's writers; every other module of ftlaunch goes through a named transition. Read from the source
(the AST), so a call hidden in a function, an alias or ``store.update_state`` counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "ftlaunch"

# The store's writers of state.json and events.jsonl.
WRITERS = {"update_state", "append_event", "write_state", "set_aside_state"}
# The modules that may use them: the store (it defines them; create_folder writes a new run's first
# state) and the journal.
ALLOWED = {"run/store.py", "run/journal.py", "run/transitions.py"}


def uses_of_writers(source: str) -> list[str]:
    """Each use of a store writer in ``source``: imported by name, or named as an attribute."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("store"):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in WRITERS]
        elif isinstance(node, ast.Attribute) and node.attr in WRITERS:
            found.append(f"line {node.lineno}: uses .{node.attr}")
    return found


def test_only_the_journal_writes_a_runs_state_and_events():
    bad = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        if uses := uses_of_writers(path.read_text()):
            bad[rel] = uses
    assert not bad, f"write through ftlaunch.run.transitions (or the supervisor's RunJournal) instead: {bad}"


def test_the_check_sees_each_way_of_reaching_a_writer():
    assert uses_of_writers("from ftlaunch.run.store import read_state, update_state") == [
        "line 1: imports update_state"
    ]
    assert uses_of_writers("def f():\n    from ftlaunch.run.store import append_event") == [
        "line 2: imports append_event"
    ]
    assert uses_of_writers("from ftlaunch.run import store\nstore.write_state(d, s)") == ["line 2: uses .write_state"]
    assert uses_of_writers("from ftlaunch.run.store import read_state\nread_state(d)") == []


def test_the_allowed_modules_exist():
    assert all((ROOT / rel).is_file() for rel in ALLOWED)
