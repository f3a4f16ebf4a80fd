"""The package's floors, checked on the source: no module imports a floor above its own, and the
modules' imports form no circle, function-level imports included (those under ``if TYPE_CHECKING:``
are exempt: they never run). An import by a name in a string (importlib) is allowed only where
DYNAMIC_IMPORTS says why.

Floors, bottom up: the ground (errors, files, locks), plan/ (the planning core: pure but for the
readers tests/test_purity.py lists), present/ (the plan's tables and plan.txt; floor 1.25: above
plan/, below run/, which writes plan.txt, and cli/, which prints), probe/ (the hardware shells: the
probe, the hardware file reader, the runtime GPU sampler; floor 1.5, so plan/ cannot reach them),
hub/ (downloads), run/ (one run's life), estimate/, schedule/, and cli/ on top. A module may import
its own floor and the ones below.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ftlaunch"
FLOORS = {
    "ftlaunch": 0,
    "ftlaunch.errors": 0,
    "ftlaunch.files": 0,
    "ftlaunch.locks": 0,
    "ftlaunch.plan": 1,
    "ftlaunch.present": 1.25,
    "ftlaunch.probe": 1.5,
    "ftlaunch.hub": 2,
    "ftlaunch.run": 3,
    "ftlaunch.estimate": 4,
    "ftlaunch.schedule": 5,
    "ftlaunch.cli": 6,
    "ftlaunch.__main__": 6,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(mod: str) -> int:
    parts = mod.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in FLOORS:
            return FLOORS[".".join(parts[:i])]
    raise AssertionError(f"{mod} sits on no floor: add its package to FLOORS")


# Where an import sits, which says when it runs.
MODULE = "module"  # at the module's level (also under a module-level if/try, or in a class body): on import
FUNCTION = "function"  # inside a def: when the function is first called
TYPE_CHECKING = "type-checking"  # under `if TYPE_CHECKING:`: never at run time


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST, where: str = MODULE):
    """Every import statement under ``node`` with where it sits (MODULE, FUNCTION, TYPE_CHECKING)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, where
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for n in child.body:
                yield from _import_nodes(ast.Module(body=[n], type_ignores=[]), TYPE_CHECKING)
            for n in child.orelse:
                yield from _import_nodes(ast.Module(body=[n], type_ignores=[]), where)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _import_nodes(child, TYPE_CHECKING if where == TYPE_CHECKING else FUNCTION)
        else:
            yield from _import_nodes(child, where)


def imports_of(source: str, me: str, is_package: bool = False) -> list[tuple[str, int, str]]:
    """(ftlaunch module imported, line, where it sits) for every ftlaunch import in ``source``, the
    source of module ``me``. ``from pkg import name`` counts as importing pkg.name when that is a module."""
    out = []
    for n, where in _import_nodes(ast.parse(source)):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = me.split(".") if is_package else me.split(".")[:-1]
                base = base[: len(base) - (n.level - 1)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            for a in n.names:  # `from pkg import module` names a module
                full = f"{mod}.{a.name}"
                is_mod = (PKG.parent / full.replace(".", "/")).with_suffix(".py").exists() or (
                    PKG.parent / full.replace(".", "/") / "__init__.py"
                ).exists()
                out.append((full if is_mod else mod, n.lineno, where))
        else:
            out += [(a.name, n.lineno, where) for a in n.names]
    return [(m, line, w) for m, line, w in out if m == "ftlaunch" or m.startswith("ftlaunch.")]


def imports(path: Path, top_level_only: bool = False) -> list[tuple[str, int]]:
    """(module imported, line) for every ftlaunch import in ``path``: all of them, or only those that
    run when the module is imported (``top_level_only``)."""
    found = imports_of(path.read_text(), module_name(path), path.name == "__init__.py")
    return [(m, line) for m, line, where in found if not top_level_only or where == MODULE]


def modules() -> list[Path]:
    found = sorted(PKG.rglob("*.py"))
    assert len(found) > 30
    return found


def test_no_module_imports_a_floor_above_its_own():
    upward = [
        f"{module_name(p)} (floor {floor(module_name(p))}) imports {m} (floor {floor(m)}) at line {line}"
        for p in modules()
        for m, line in imports(p, top_level_only=False)
        if floor(m) > floor(module_name(p))
    ]
    assert upward == []


def import_graph() -> dict[str, dict[str, list[str]]]:
    """module -> {module it imports: ['line N' or 'line N in a function']}: every import that can run, at the
    module's level or inside a function (a function-level import still makes a circle: the two
    modules need each other, and the first call finds the other half-loaded or hides the tangle).
    Imports under ``if TYPE_CHECKING:`` are exempt: they never run and only name types."""
    graph: dict[str, dict[str, list[str]]] = {}
    for p in modules():
        me = module_name(p)
        edges = graph.setdefault(me, {})
        for m, line, where in imports_of(p.read_text(), me, p.name == "__init__.py"):
            said = f"line {line}" + (" in a function" if where == FUNCTION else "")
            if where != TYPE_CHECKING and m != me and said not in edges.get(m, []):
                edges.setdefault(m, []).append(said)
    return graph


def circles(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """Each group of modules that import each other (a strongly connected component of more than one
    module), said as one shortest circle through its first module, with the lines of each step."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, {})):
            if w not in graph:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    out = []
    for group in sorted(groups):
        start, members = group[0], set(group)
        paths = {start: [start]}  # breadth first: the shortest way from start to each member
        queue = [start]
        while queue:
            q = queue.pop(0)
            for w in sorted(graph[q]):
                if w in members and w not in paths:
                    paths[w] = [*paths[q], w]
                    queue.append(w)
        last = min((q for q in paths if start in graph[q] and q != start), key=lambda q: len(paths[q]))
        ring = [*paths[last], start]
        steps = " -> ".join(f"{a} ({', '.join(graph[a][b])})" for a, b in zip(ring, ring[1:], strict=False))
        out.append(f"{len(group)} modules ({', '.join(group)}), e.g. {steps} -> {start}")
    return out


def test_imports_form_no_circle_function_level_included():
    assert circles(import_graph()) == []


def test_the_circle_check_reads_function_level_imports_and_exempts_type_checking():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from ftlaunch.plan import flags\n"
        "if TYPE_CHECKING:\n    from ftlaunch.run.view import RunView\n"
        "def f():\n    from ftlaunch.run.store import find_run\n    return find_run\n"
        "class C:\n    from ftlaunch import errors\n"
    )
    found = imports_of(source, "ftlaunch.run.x")
    assert found == [
        ("ftlaunch.plan.flags", 2, MODULE),
        ("ftlaunch.run.view", 4, TYPE_CHECKING),
        ("ftlaunch.run.store", 6, FUNCTION),
        ("ftlaunch.errors", 9, MODULE),
    ]
    graph = {
        "a": {"b": ["line 1"]},
        "b": {"c": ["line 3 in a function"]},
        "c": {"a": ["line 2"], "d": ["line 5"]},
        "d": {},
    }
    assert circles(graph) == ["3 modules (a, b, c), e.g. a (line 1) -> b (line 3 in a function) -> c (line 2) -> a"]
    assert circles({"a": {"b": ["line 1"]}, "b": {}}) == []


# Where a module is imported by a name in a string (importlib), which neither test above can read.
DYNAMIC_IMPORTS = {
    "ftlaunch.cli.main": "LazyCommands imports each command's module (cli/*) on first lookup, so "
    "`ftlaunch plan` loads no run/, estimate/ or schedule/; cli is the top floor, so nothing imports it back",
}


def test_no_module_hides_an_import_in_a_string_but_the_declared_ones():
    dynamic = {
        module_name(p)
        for p in modules()
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Attribute) and n.func.attr == "import_module")
            or (isinstance(n.func, ast.Name) and n.func.id in ("__import__", "import_module"))
        )
    }
    assert dynamic == set(DYNAMIC_IMPORTS)


def test_every_package_says_what_it_owns_and_may_import():
    for init in sorted(PKG.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80 and "import" in doc, f"{init}: its docstring says what it owns and may import"


def test_the_hub_never_touches_the_plans_types():
    """The hub returns plain values (what was fetched, from where, the local paths); planning turns them
    into Changes (plan/prepared.py). So no hub module imports the Plan or Change types, anywhere in
    it, nor a plan module that loads them when imported."""
    anywhere = {module_name(p): {m for m, _ in imports(p, top_level_only=False)} for p in modules()}
    loads = {module_name(p): {m for m, _ in imports(p, top_level_only=True)} for p in modules()}
    types = {"ftlaunch.plan.planner", "ftlaunch.plan.change"}

    def reaches(deps: set[str], seen: set[str]) -> set[str]:
        found = deps & types
        for dep in sorted(deps - types - seen):
            if dep.startswith("ftlaunch.plan"):
                seen.add(dep)
                found |= reaches(loads.get(dep, set()), seen)
        return found

    hub = [m for m in anywhere if m == "ftlaunch.hub" or m.startswith("ftlaunch.hub.")]
    assert len(hub) > 5 and any(m.startswith("ftlaunch.plan") for h in hub for m in anywhere[h])
    assert {h: sorted(reaches(anywhere[h], set())) for h in hub if reaches(anywhere[h], set())} == {}


def test_the_planning_core_draws_nothing():
    """Presentation is ftlaunch.present's: no plan/ module imports rich (nor present/), anywhere in it,
    so planning, its tests and `import ftlaunch.plan.*` never load a renderer."""
    drawing = [
        f"{module_name(p)} imports {m} at line {line}"
        for p in modules()
        if module_name(p).startswith("ftlaunch.plan")
        for m, line in imports(p)
        if m.startswith("ftlaunch.present")
    ]
    drawing += [
        f"{module_name(p)} imports rich at line {n.lineno}"
        for p in modules()
        if module_name(p).startswith("ftlaunch.plan")
        for n in ast.walk(ast.parse(p.read_text()))
        if (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "rich" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "rich")
    ]
    assert drawing == []
