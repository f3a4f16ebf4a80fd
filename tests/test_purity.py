"""plan/ is the pure planning core: its modules read no environment, file, clock or process, so a
plan is a function of the values passed in. Checked on the source (AST), module by module.

A module fails when it imports subprocess or the ground's file and lock helpers (ftlaunch.files,
ftlaunch.locks), reads ``os.environ``/``os.getenv``/the cwd, calls ``open``, ``.open``,
``.read_text``/``.write_text`` (or the bytes ones), or reads the clock (``time.time``,
``time.monotonic``, ``time.sleep``). The shells that do are elsewhere (ftlaunch.probe for the
hardware, run/ for processes and state), but for the readers listed in READERS, each with why it
stays in plan/.

run/ is mostly shells (processes, the run folder, the clock), but its decisions over data are held to
the same rules: the modules RUN_PURE lists (the run's values and their exit-code and failure-kind
tables, the classification of an exit and what to do next, the stall and health verdicts, the
accounting, reading progress out of the trainer's records, what `status` shows of a state). They
import from ftlaunch.run only each other, so no decision reads the world through a shell it calls.
What one of them may still do is declared in RUN_EXCEPTIONS, one line each, with why.
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

RUN = PLAN.parent / "run"

# run/'s decisions over data: module (relative to ftlaunch/run) -> what it decides.
RUN_PURE = {
    "state.py": "a run's values: RunState, RunStatus with its exit codes, FailureKind, the retry Budget",
    "staterecords.py": "the state's typed sub-records (progress, stall, health, environment, disk), the engine's job",
    "events.py": "the names of a run's events, one enum: the file format events.jsonl is read back by",
    "policy.py": "the RecoveryPolicy (budgets' maxima, recover, on_diverge, stall timeout), its options, the Budget",
    "recovery.py": "classifying a trainer's exit (OOM, crash, config error, ...) and deciding what to do next",
    "stall.py": "the stall watchdog: what counts as progress, which allowance is in force, when it stalled",
    "health.py": "numeric health: a verdict folded over trainer records, the remedy ladder, roll back or stop",
    "accounting.py": "a run's attempts, rates and GPU-hours, from its events and trainer records",
    "progress.py": "progress from trainer_log.jsonl text: the step, the resume point, the furthest step, the rate",
    "runview.py": "what `status` and `runs` show, from a state and what the shell saw: the status now, ETA, message",
    "secrecy.py": "what is secret (names, values, URL credentials) and how text and environments are cleaned of it",
}

# (module, what the check finds in it) -> why it stays. An exception no longer found is an error too.
RUN_EXCEPTIONS = {
    ("progress.py", "open("): "checkpoint completeness (checkpoint_problems) reads a safetensors header; "
    "it belongs with the checkpoint shell (run/checkpoints.py), still to be moved",
    ("progress.py", ".read_text("): "checkpoint completeness reads trainer_state.json and the shard index (as above)",
    ("runview.py", "imports ftlaunch.run.procs"): "Liveness, the verdict enum procs owns: a value the view "
    "shows, no call into procs",
    ("progress.py", "imports ftlaunch.run.store"): "store.json_lines, the one JSON-lines parser (bytes in, "
    "records out: pure), which the store owns because it reads events.jsonl with it",
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


def run_impurities(name: str, source: str) -> list[str]:
    """What a RUN_PURE module does that its kind may not: the impurities, and each ftlaunch.run
    module it imports that is not in RUN_PURE (as 'imports ftlaunch.run.X')."""
    found = [f.split(": ", 1)[1] for f in impurities(source)]
    pure = {f"ftlaunch.run.{m.removesuffix('.py').replace('/', '.')}" for m in RUN_PURE}
    for n in ast.walk(ast.parse(source)):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
        if isinstance(n, ast.ImportFrom) and not n.level:
            names.append(n.module or "")
            if n.module == "ftlaunch.run":  # from ftlaunch.run import store
                names += [f"ftlaunch.run.{a.name}" for a in n.names]
        found += [f"imports {m}" for m in names if m.startswith("ftlaunch.run.") and m not in pure]
    return sorted(set(found))


def test_run_decisions_are_pure_but_for_the_declared_exceptions():
    found = {name: run_impurities(name, (RUN / name).read_text()) for name in RUN_PURE}
    undeclared = {name: [f for f in fs if (name, f) not in RUN_EXCEPTIONS] for name, fs in found.items()}
    assert {name: fs for name, fs in undeclared.items() if fs} == {}
    assert [key for key in RUN_EXCEPTIONS if key[1] not in found.get(key[0], [])] == []  # the list stays honest


def test_the_run_check_catches_a_call_into_a_shell():
    assert run_impurities("x.py", "from ftlaunch.run.store import read_state") == ["imports ftlaunch.run.store"]
    assert run_impurities("x.py", "import ftlaunch.run.procs") == ["imports ftlaunch.run.procs"]
    assert run_impurities("x.py", "def f():\n    from ftlaunch.run import journal") == ["imports ftlaunch.run.journal"]
    assert run_impurities("x.py", "from ftlaunch.run.state import RunState\nimport time\nt = time.time()") == [
        "time.time"
    ]


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
