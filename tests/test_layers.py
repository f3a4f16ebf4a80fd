"""The package's floors, checked on the source: no module imports a floor above its own, and the
modules' top-level imports form no circle.

Floors, bottom up: the ground (errors, files, locks), plan/ (the planning core: pure but for the
readers tests/test_purity.py lists), probe/ (the hardware shells: the probe, the hardware file
reader, the runtime GPU sampler; floor 1.5, so plan/ cannot reach them), hub/ (downloads), run/ (one
run's life), estimate/, schedule/, and cli/ on top. A module may import its own floor and the ones
below.
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


def imports(path: Path, top_level_only: bool) -> list[tuple[str, int]]:
    """(module imported, line) for every ftlaunch import in ``path``."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    me = module_name(path)
    out = []
    for n in nodes:
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = base[: len(base) - (n.level - 1)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            for a in n.names:  # `from pkg import module` names a module
                full = f"{mod}.{a.name}"
                is_mod = (PKG.parent / full.replace(".", "/")).with_suffix(".py").exists() or (
                    PKG.parent / full.replace(".", "/") / "__init__.py"
                ).exists()
                out.append((full if is_mod else mod, n.lineno))
        elif isinstance(n, ast.Import):
            out += [(a.name, n.lineno) for a in n.names]
    return [(m, line) for m, line in out if m == "ftlaunch" or m.startswith("ftlaunch.")]


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


def test_top_level_imports_form_no_circle():
    graph = {module_name(p): {m for m, _ in imports(p, top_level_only=True)} for p in modules()}
    circles = []
    state: dict[str, int] = {}

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if dep == mod or dep not in graph:
                continue
            if state.get(dep) == 1:
                circles.append(" -> ".join([*path[path.index(dep) :], dep]) if dep in path else f"{mod} -> {dep}")
            elif dep not in state:
                visit(dep, [*path, dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert circles == []


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
