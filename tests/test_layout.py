"""The package's layout holds: rooms in floors, no import circle, no module a newcomer cannot
hold, and measurement apart from rendering (docs/architecture.md).

Read from the source with `ast`, importing nothing. Every import statement counts: at module
level, inside functions and under `TYPE_CHECKING` alike, since a circle through a lazy or
type-only import is still two modules that each need the other to be understood (and one
refactor away from failing at import time).

That `import torchtune_magic` (the Python API, a report rendered as text or HTML) loads
neither IPython nor ipywidgets is run, in a fresh interpreter, by
tests/test_engine.py::test_engine_imports_neither_ipython_nor_ipywidgets and
tests/test_install.py::test_the_engine_imports_no_front_end_package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtune_magic"
NAME = PACKAGE.name
MAX_LINES = 800
# The rooms, lowest floor first: a room imports only from its own floor and the ones below,
# so what several rooms share sits below all of them.
FLOORS = ["distributed", "kernel", "cell", "probe", "checks", "measuring"]
# Top-level modules a room may import: the report's plain dataclasses and the run's options.
SHARED_VALUES = {"report", "options"}
# Measurement: the rooms and the flow that drives them. None of them renders anything (the
# entry points, `api.py` and `magic.py`, may look for IPython).
MEASUREMENT = {*FLOORS, "session", "reporting", "own_failures"}
FRONT_END = ("IPython", "ipywidgets", "anywidget")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """Every name an import statement in `module` reaches: the package's own modules by
    their dotted names, other packages by their top-level name."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    reached = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            reached.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                reached.add(submodule if submodule in MODULES else source)
    return reached


IMPORTS = {module: _imported(module, path) for module, path in MODULES.items()}
GRAPH = {m: {d for d in deps if d in MODULES and d != m} for m, deps in IMPORTS.items()}


def _room(module: str) -> str:
    """`probe` for `torchtune_magic.probe.steps`; the module's own name at the top level."""
    return module.split(".")[1] if module != NAME else ""


def _circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(GRAPH[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_inside_the_package() -> None:
    circles = _circles()
    assert not circles, "\n".join(
        " <-> ".join(m.removeprefix(f"{NAME}.") for m in circle) for circle in circles
    )


def test_no_module_over_800_lines() -> None:
    lengths = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in lengths.items() if n > MAX_LINES} == {}


def test_each_room_imports_only_its_floor_and_those_below() -> None:
    upward = []
    for module, targets in GRAPH.items():
        room = _room(module)
        if room not in FLOORS:
            continue
        for target in targets:
            other = _room(target)
            allowed = other in SHARED_VALUES or (
                other in FLOORS and FLOORS.index(other) <= FLOORS.index(room)
            )
            if not allowed:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_room_is_named_in_the_floors() -> None:
    rooms = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    # above the floors: the renderers, and the whole-program entry points (`check`, `scan`)
    # that drive a session as `cli.py` and `magic.py` do
    assert rooms - {"render", "programs"} == set(FLOORS)


def test_measurement_never_imports_rendering_or_the_front_end() -> None:
    found = []
    for module, reached in IMPORTS.items():
        if _room(module) not in MEASUREMENT:
            continue
        for name in reached:
            top = name.split(".")[0]
            if name.startswith(f"{NAME}.render") or top in FRONT_END:
                found.append(f"{module} -> {name}")
    assert found == []
