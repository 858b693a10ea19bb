"""Where the objects a fix changes were built: the kernel's earlier cells.

A live fix is only half done: the change belongs in the cells that built the objects —
`loader = DataLoader(...)` three cells up, the convs in `class Net`, the optimizer's
constructor. The kernel keeps every cell it ran, by execution count (IPython's `In`). For a
live object reached by a path from the namespace (`loader`, `model.layer1.0.conv1`), this
module finds the constructor call that built it: in the newest earlier cell that binds the
path's name, then along the path through `self.<attr> = ...` in the `__init__` of classes
defined in earlier cells, `nn.Sequential(...)` / `nn.ModuleList([...])` arguments and
factory functions' `return`. Every step is checked against the live objects (the call's
class is the object's class), so an edit never lands on a call that did not build them.

The earlier cells come with the checked cell's `Notebook` (`notebook.py`).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..report import CellChange
from . import codeedit
from .notebook import Notebook

if TYPE_CHECKING:
    from .workload import Workload

CONTAINERS = ("Sequential", "ModuleList")
# nn.Module methods that return the module itself: `nn.Sequential(...).to(device)` built
# the Sequential, whose call is the one to edit
RETURNS_SELF = frozenset(
    {"to", "cuda", "cpu", "train", "eval", "float", "double", "half", "bfloat16", "to_empty"}
)


@dataclass(frozen=True)
class CallEdit:
    """Keyword arguments to give one constructor call in an earlier cell.

    `rebuilds`: the name a top-level statement of that cell binds to this very call, so
    that re-running the statement alone rebuilds the object (`%perfcheck insert` carries
    such statements; a model's convs are not rebuilt that way: that would reset weights)."""

    execution_count: int
    line: int  # the call's position in the cell's run text
    col: int
    callee: str  # the call's last name: "DataLoader", "Conv2d", "Adam"
    values: tuple[tuple[str, str], ...]  # keyword, source text: ("num_workers", "4")
    positional: tuple[tuple[str, int], ...] = ()  # keywords the callee also takes by position
    rebuilds: str | None = None
    statement: tuple[int, int] | None = None  # that statement's lines in the run text

    def applied_to(self, text: str) -> str:
        return codeedit.with_keywords(
            text,
            self.line,
            {self.callee},
            dict(self.values),
            dict(self.positional),
            self.col,
        )


@dataclass(frozen=True)
class RemovedCall:
    """A call statement to remove from an earlier cell: a process-wide switch that cell
    turned on and left on (`torch.autograd.set_detect_anomaly(True)`), found by the call's
    position in the cell's run text. Nothing a statement re-run could carry."""

    execution_count: int
    line: int
    col: int
    callee: str  # the call's last name: "set_detect_anomaly"

    def applied_to(self, text: str) -> str:
        """The text without the statement (`pass` where it leaves a block empty)."""
        try:
            tree = ast.parse(text)
        except SyntaxError as error:
            raise codeedit.EditError(f"the cell does not parse: {error.msg}") from error
        call = codeedit.call_at(tree, self.line, {self.callee}, self.col)
        statement = codeedit.statement_of(tree, call) if call is not None else None
        if statement is None:
            return text
        return codeedit.remove_statement(text, tree, statement)


Edit = CallEdit | RemovedCall


def switched_on(
    notebook: Notebook | None, names: set[str], turns_on: Callable[[ast.Call], bool]
) -> list[RemovedCall]:
    """The statements of earlier cells that turned a process-wide switch on and left it on:
    walking back from the newest cell (and up each cell), every call of `names` standing as
    a statement of its own that turns it on (`turns_on`), until a call that turns it off
    (the switch was off after that one). Calls inside a `def` or `class` are not followed:
    they ran only if called. Only removals that can be made are returned."""
    if notebook is None or notebook.inputs is None:
        return []
    found = []
    for count, tree in notebook.earlier():
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        top = [s for s in tree.body if not isinstance(s, defs)]
        ran = [n for n in _own_nodes(top) if isinstance(n, ast.Call) and _callee(n) in names]
        for call in sorted(ran, key=lambda c: (c.lineno, c.col_offset), reverse=True):
            if not turns_on(call):
                return found
            statement = codeedit.statement_of(tree, call)
            if not (isinstance(statement, ast.Expr) and statement.value is call):
                continue  # `with set_detect_anomaly(True):` ends with its block
            removal = RemovedCall(count, call.lineno, call.col_offset, _callee(call))
            if not codeedit.edited(notebook.inputs.cell(count)[1], removal.applied_to)[1]:
                found.append(removal)
    return found


@dataclass
class _Site:
    """A constructor call found for a live object."""

    count: int
    call: ast.Call
    rebuilds: str | None = None
    statement: ast.stmt | None = None


@dataclass
class _Scope:
    """Where names in an expression are looked up: a cell's top level or a function body."""

    count: int
    body: list[ast.stmt] = field(default_factory=list)


def keyword_edit(
    notebook: Notebook | None,
    namespace: dict[str, Any],
    path: Sequence[str | int],
    values: dict[str, str],
    positional: dict[str, int] | None = None,
) -> CallEdit | None:
    """The edit giving `values` to the call that built the object at `path` (a namespace
    name, then attributes / submodule names / indices), or None when no earlier cell can
    be shown to have built it."""
    if notebook is None or not path or not isinstance(path[0], str):
        return None
    site = _locate(notebook, namespace, path)
    if site is None:
        return None
    span = None
    if site.statement is not None:
        span = (site.statement.lineno, site.statement.end_lineno or site.statement.lineno)
    edit = CallEdit(
        site.count,
        site.call.lineno,
        site.call.col_offset,
        _callee(site.call),
        tuple(values.items()),
        tuple((positional or {}).items()),
        site.rebuilds,
        span,
    )
    inputs = notebook.inputs
    if inputs is not None and codeedit.edited(inputs.cell(site.count)[1], edit.applied_to)[1]:
        return None  # the edit cannot be made: the caller's advice names the change instead
    return edit


def module_path(path: str) -> list[str | int]:
    """`model.layer1.0.conv1` as a path: the name, then submodule names."""
    return list(path.split("."))


def location_path(location: Any) -> list[str | int] | None:
    """A discovery `Location` as a path: the name, attributes, list indices (None for
    dict keys, closure cells and generator locals, which are not followed)."""
    path: list[str | int] = []
    for step in location.steps:
        if step.kind in ("name", "attr") or (step.kind == "item" and isinstance(step.key, int)):
            path.append(step.key)
        else:
            return None
    return path


# finding the call --------------------------------------------------------------------------


def _locate(
    notebook: Notebook, namespace: dict[str, Any], path: Sequence[str | int]
) -> _Site | None:
    name = path[0]
    if name not in namespace:
        return None
    for count, tree in notebook.earlier():
        statement = _last_binding(tree.body, str(name))
        if statement is None:
            continue  # not bound in this cell: look further back
        value = _assigned_value(statement, str(name))
        if value is None:
            return None  # bound some other way (a loop, an import, a tuple): not followed
        site = _follow(notebook, _Scope(count, tree.body), value, namespace[name], list(path[1:]))
        if site is not None and site.call is _unchained(value) and statement in tree.body:
            site.rebuilds, site.statement = str(name), statement
        return site
    return None


def _follow(
    notebook: Notebook, scope: _Scope, expr: ast.expr, live: Any, rest: list[str | int]
) -> _Site | None:
    """The call in `expr` that built `live`'s part at `rest`, checked against the objects."""
    if isinstance(expr, ast.Name):
        statement = _last_binding(scope.body, expr.id)
        value = _assigned_value(statement, expr.id) if statement is not None else None
        return _follow(notebook, scope, value, live, rest) if value is not None else None
    if isinstance(expr, (ast.List, ast.Tuple)) and rest and isinstance(rest[0], int):
        elements = expr.elts
        if rest[0] >= len(elements) or isinstance(elements[rest[0]], ast.Starred):
            return None
        child = _child(live, rest[0])
        return _follow(notebook, scope, elements[rest[0]], child, rest[1:]) if child else None
    if not isinstance(expr, ast.Call):
        return None
    if isinstance(expr.func, ast.Attribute) and expr.func.attr in RETURNS_SELF:
        return _follow(notebook, scope, expr.func.value, live, rest)
    callee = _callee(expr)
    if callee in CONTAINERS and rest and callee == type(live).__name__:
        element = _element(expr, rest[0])
        child = _child(live, rest[0])
        if element is None or child is None:
            return None
        return _follow(notebook, scope, element, child, rest[1:])
    if callee == type(live).__name__:
        if not rest:
            return _Site(scope.count, expr)
        return _through_init(notebook, live, rest)
    factory = _function_definition(notebook, callee)
    if factory is not None:
        count, function = factory
        returned = [n.value for n in _own_nodes(function.body) if isinstance(n, ast.Return)]
        if len(returned) == 1 and returned[0] is not None:
            return _follow(notebook, _Scope(count, function.body), returned[0], live, rest)
    return None


def _through_init(notebook: Notebook, live: Any, rest: list[str | int]) -> _Site | None:
    """`live` is an instance of a class from an earlier cell: the `self.<attr> = ...` of
    its `__init__` (or a base class's) that built the part at `rest`."""
    attr, child = rest[0], _child(live, rest[0])
    if not isinstance(attr, str) or child is None:
        return None
    for cls in type(live).__mro__:
        if cls is object or cls.__module__.split(".")[0] == "torch":
            continue
        found = _class_definition(notebook, cls)
        if found is None:
            continue
        count, class_def = found
        init = next(
            (n for n in class_def.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
            None,
        )
        if init is None or not init.args.args:
            continue
        this = init.args.args[0].arg
        values = [
            node.value
            for node in _own_nodes(init.body)
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(target := node.targets[0], ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == this
            and target.attr == attr
        ]
        if len(values) == 1:
            return _follow(notebook, _Scope(count, init.body), values[0], child, rest[1:])
        if values:
            return None  # assigned more than once (if/else): which one built it is unknown
    return None


def _unchained(expr: ast.expr) -> ast.expr:
    """`nn.Sequential(...)` for `nn.Sequential(...).to(device).train()`."""
    while (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr in RETURNS_SELF
    ):
        expr = expr.func.value
    return expr


def _element(call: ast.Call, key: str | int) -> ast.expr | None:
    """The argument of `nn.Sequential(a, b)` / `nn.ModuleList([a, b])` building child
    `key` (every child, for `*[Block(c) for c in ...]` and list comprehensions)."""
    if not str(key).isdigit():
        return None
    index = int(key)
    args = call.args
    if _callee(call) == "ModuleList":
        if len(args) != 1:
            return None
        items = args[0]
    elif len(args) == 1 and isinstance(args[0], ast.Starred):
        items = args[0].value
    else:
        if any(isinstance(a, ast.Starred) for a in args):
            return None
        return args[index] if index < len(args) else None
    if isinstance(items, (ast.ListComp, ast.GeneratorExp)):
        return items.elt
    if isinstance(items, (ast.List, ast.Tuple)) and index < len(items.elts):
        element = items.elts[index]
        return None if isinstance(element, ast.Starred) else element
    return None


def _child(live: Any, key: str | int) -> Any:
    """The live object one step down: a submodule, an attribute or an item."""
    modules = getattr(live, "_modules", None)
    if isinstance(modules, dict) and str(key) in modules:
        return modules[str(key)]
    if isinstance(key, str) and not key.isdigit():
        return getattr(live, key, None)
    try:
        return live[key if isinstance(key, int) else int(key)]
    except (TypeError, KeyError, IndexError):
        return None


def _class_definition(notebook: Notebook, cls: type) -> tuple[int, ast.ClassDef] | None:
    """The earlier cell's `class` statement that made `cls`: the newest one with its name
    whose `__init__` starts on the line the live class's does (a class redefined after the
    object was built is not the one that built it)."""
    init = vars(cls).get("__init__")
    code = getattr(init, "__code__", None)
    for count, tree in notebook.earlier():
        for node in tree.body:
            if not isinstance(node, ast.ClassDef) or node.name != cls.__name__:
                continue
            defined = next(
                (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                None,
            )
            if code is None or (defined is not None and _def_line(defined) == code.co_firstlineno):
                return count, node
    return None


def _function_definition(notebook: Notebook, name: str) -> tuple[int, ast.FunctionDef] | None:
    """The newest earlier top-level `def name` (a factory the object came from)."""
    for count, tree in notebook.earlier():
        for node in reversed(tree.body):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return count, node
    return None


def _def_line(node: ast.FunctionDef) -> int:
    """The line a function's code object starts on (its first decorator, if any)."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _own_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of these statements, not descending into nested defs, classes, lambdas."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
            ):
                stack.append(child)


def _last_binding(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last statement (in source order) of this scope that binds `name`."""
    last: ast.stmt | None = None
    for statement in _statements(body):
        if name in _bound_names(statement):
            last = statement
    return last


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a scope in source order, inside if/for/with/try blocks too."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field_name in ("body", "orelse", "finalbody"):
            inner = getattr(statement, field_name, None)
            if isinstance(inner, list):
                yield from _statements(inner)
        for handler in getattr(statement, "handlers", []):
            yield from _statements(handler.body)


def _bound_names(statement: ast.stmt) -> set[str]:
    """Names a statement binds in its own scope (not inside its nested blocks)."""
    targets: list[ast.AST] = []
    if isinstance(statement, ast.Assign):
        targets = list(statement.targets)
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        targets = [statement.target]
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in statement.items if item.optional_vars]
    elif isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
    elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    elif isinstance(statement, ast.Delete):
        targets = list(statement.targets)
    names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _assigned_value(statement: ast.stmt, name: str) -> ast.expr | None:
    """The value of `name = value` (or `name: T = value`); None for other bindings."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target = statement.targets[0]
        if isinstance(target, ast.Name) and target.id == name:
            return statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.value
    return None


def _callee(call: ast.Call) -> str:
    return codeedit.dotted_name(call.func).rsplit(".", 1)[-1]


# the cells to edit ------------------------------------------------------------------------


def cell_changes(
    workload: Workload, fixed_versions: list[str], edits: Sequence[Edit]
) -> list[CellChange]:
    """The notebook cells to edit for these changes: each earlier cell once, with all its
    edits (by execution count), then the checked cell (execution count None) with every
    version of it combined, its `%%perfcheck` line as typed."""
    notebook = workload.notebook
    changes = []
    if notebook is not None and notebook.inputs is not None:
        for count, cell_edits in sorted(_by_cell(edits).items()):
            typed, python = notebook.inputs.cell(count)
            after = codeedit.rebase(typed, python, _edited(python, cell_edits))
            if after is not None and after != typed:
                diff = codeedit.unified_diff(typed, after, f"In[{count}]")
                changes.append(CellChange(count, typed, after, diff))
    optimized = codeedit.combine(workload.source, fixed_versions)
    if notebook is not None and optimized != workload.source:
        body = as_typed(workload, optimized)
        before = notebook.text
        after = f"{notebook.header}\n{body}" if notebook.header else body
        changes.append(CellChange(None, before, after, codeedit.unified_diff(before, after)))
    return changes


def as_typed(workload: Workload, text: str) -> str:
    """An edit of the checked cell's run text as the user would type it: the padding for
    the editor's lines dropped, IPython's transform undone where it changed lines."""
    body = workload.as_typed(text)
    notebook = workload.notebook
    if notebook is None:
        return body
    return codeedit.rebase(notebook.body, workload.cell, body) or body


@dataclass
class Rebuild:
    """Statements of an earlier cell, with the fixes' edits, that rebuild the objects they
    bind when run again (`%perfcheck insert` puts them before the optimized cell)."""

    execution_count: int
    names: list[str]  # the names the statements bind
    fixes: list[str]  # the fixes whose constructor changes they carry
    text: str


def rebuilds(
    notebook: Notebook | None, edits: Sequence[tuple[str, Edit]]
) -> tuple[list[Rebuild], list[tuple[str, Edit]]]:
    """For edits of a top-level `name = Constructor(...)` statement (a loader, an
    optimizer): that statement edited, plus the cell's later assignments that use the name
    (a scheduler over the optimizer), so the object is rebuilt as the fixes want. Returns
    them, and the (fix id, edit) pairs a statement cannot carry (a conv inside a model:
    rebuilding the model would reset its weights)."""
    carried = [
        (check, e) for check, e in edits if isinstance(e, CallEdit) and e.rebuilds and e.statement
    ]
    left = [(check, e) for check, e in edits if (check, e) not in carried]
    if notebook is None or notebook.inputs is None:
        return [], list(edits)
    found = []
    for count, cell_edits in sorted(_by_cell([e for _, e in carried]).items()):
        python = notebook.inputs.cell(count)[1]
        names = list(dict.fromkeys(e.rebuilds for e in cell_edits if e.rebuilds))
        spans = {e.statement for e in cell_edits if e.statement}
        first = min(start for start, _ in spans)
        for statement in ast.parse(python).body:
            uses = {n.id for n in ast.walk(statement) if isinstance(n, ast.Name)}
            if statement.lineno > first and isinstance(statement, ast.Assign) and uses & set(names):
                spans.add((statement.lineno, statement.end_lineno or statement.lineno))
                names += [n for n in _bound_names(statement) if n not in names]
        edited = _edited(python, cell_edits)
        lines = edited.splitlines()
        moved = _moved_spans(python, edited)
        text = "\n".join(
            "\n".join(lines[start - 1 : end])
            for start, end in sorted(moved.get(span, span) for span in spans)
        )
        fixes = list(dict.fromkeys(check for check, e in carried if e.execution_count == count))
        found.append(Rebuild(count, names, fixes, text))
    return found, left


def _moved_spans(python: str, edited: str) -> dict[tuple[int, int], tuple[int, int]]:
    """Each top-level statement's lines in `python` -> its lines in `edited` (an argument
    appended one per line adds lines to its statement and moves those after it)."""
    spans = [
        [(s.lineno, s.end_lineno or s.lineno) for s in ast.parse(text).body]
        for text in (python, edited)
    ]
    return dict(zip(*spans, strict=False))


def _by_cell(edits: Sequence[Edit]) -> dict[int, list[Edit]]:
    cells: dict[int, list[Edit]] = {}
    for edit in dict.fromkeys(edits):
        cells.setdefault(edit.execution_count, []).append(edit)
    return cells


def _edited(python: str, edits: list[Edit]) -> str:
    """The cell's run text with every edit, the last call first (so that adding keywords
    to one call never moves another call's position)."""
    for edit in sorted(edits, key=lambda e: (e.line, e.col), reverse=True):
        python = edit.applied_to(python)
    return python
