"""plan/ is the pure planning core: its modules read no environment, file, clock or process, so a
plan is a function of the values passed in. Checked on the source (AST), module by module.

A module fails when it imports subprocess or the ground's file and lock helpers (ftlaunch.files,
ftlaunch.locks), reads ``os.environ``/``os.getenv``/the cwd, calls ``open``, ``.open``,
``.read_text``/``.write_text`` (or the bytes ones), or reads the clock (``time.time``,
``time.monotonic``, ``time.sleep``). The shells that do are elsewhere (ftlaunch.probe for the
hardware, run/ for processes and state), but for the readers listed in READERS, each with why it
stays in plan/.
"""

from __future__ import annotations

import ast
from pathlib import Path

PLAN = Path(__file__).resolve().parent.parent / "ftlaunch" / "plan"

# module (relative to ftlaunch/plan) -> why it may read
READERS = {
    "config.py": "the config loader: reads the YAML as llamafactory-cli does (OmegaConf) and "
    "dataset_info.json; it is what turns a file into the values planning works on",
    "keyschema.py": "reads the key lists shipped as package data (ftlaunch/data/llamafactory_keys.json), "
    "once: the schema both config and v1 check against",
    "modelspec.py": "load_config_json reads a local model's config.json, the one reader of model shapes",
    "memory/adapt.py": "model_spec_for reads --model-config FILE (the glue that finds a model's shape)",
    "memory/store.py": "the learned-memory store: $FTLAUNCH_HOME/learned.json, written under a lock",
    "memory/simulate.py": "the simulator runs its torch child process (subprocess, timed) so the "
    "planner's process never imports torch",
}

_BANNED_MODULES = {"subprocess", "ftlaunch.files", "ftlaunch.locks"}
_BANNED_ATTRS = {
    ("os", "environ"),
    ("os", "getenv"),
    ("os", "getcwd"),
    ("Path", "cwd"),
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "sleep"),
}
_FILE_METHODS = {"open", "read_text", "write_text", "read_bytes", "write_bytes"}


def impurities(source: str) -> list[str]:
    """What in ``source`` reads or writes the outside world, as 'line N: what'."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            found += [f"line {n.lineno}: import {a.name}" for a in n.names if a.name in _BANNED_MODULES]
        elif isinstance(n, ast.ImportFrom) and (n.module or "") in _BANNED_MODULES:
            found.append(f"line {n.lineno}: from {n.module} import ...")
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            if (n.value.id, n.attr) in _BANNED_ATTRS:
                found.append(f"line {n.lineno}: {n.value.id}.{n.attr}")
        if isinstance(n, ast.Call):
            if isinstance(n.func, ast.Name) and n.func.id == "open":
                found.append(f"line {n.lineno}: open(")
            elif isinstance(n.func, ast.Attribute) and n.func.attr in _FILE_METHODS:
                found.append(f"line {n.lineno}: .{n.func.attr}(")
    return found


def plan_modules() -> dict[str, Path]:
    found = {p.relative_to(PLAN).as_posix(): p for p in sorted(PLAN.rglob("*.py"))}
    assert len(found) > 15
    return found


def test_plan_modules_are_pure_but_for_the_declared_readers():
    impure = {name: impurities(path.read_text()) for name, path in plan_modules().items() if name not in READERS}
    assert {name: found for name, found in impure.items() if found} == {}


def test_every_declared_reader_exists_and_still_reads():
    """A reader made pure leaves the list (so the list stays honest)."""
    modules = plan_modules()
    assert {name: bool(impurities(modules[name].read_text())) for name in READERS if name in modules} == dict.fromkeys(
        READERS, True
    )


def test_the_check_catches_each_kind_of_impurity():
    cases = {
        "import subprocess": "import subprocess",
        "from ftlaunch.files import home": "from ftlaunch.files",
        "import os\nx = os.environ.get('A')": "os.environ",
        "import os\nx = os.getenv('A')": "os.getenv",
        "x = open('f').read()": "open(",
        "from pathlib import Path\nx = Path('f').read_text()": ".read_text(",
        "def f(p):\n    p.write_text('x')": ".write_text(",
        "import time\nx = time.time()": "time.time",
        "from pathlib import Path\nx = Path.cwd()": "Path.cwd",
    }
    assert {src: any(want in f for f in impurities(src)) for src, want in cases.items()} == dict.fromkeys(cases, True)
    assert impurities("import json\nfrom ftlaunch.plan.flags import truthy\nx = truthy('1')") == []
