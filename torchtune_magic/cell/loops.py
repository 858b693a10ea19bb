"""The cell's own loops as steps: found in its syntax, counted by a call at each iteration.

A cell built from raw tensors (`parameters = [C, W1, b1]`), hand-written layer classes and
manual SGD (`p.data += -lr * p.grad`) has no DataLoader, optimizer or `nn.Module` whose
hooks could mark its steps; what repeats is an iteration of its `for i in range(steps):`
(or `while`) loop. So the runs that need steps execute the cell compiled with one call
added as the first statement of a loop's body: `__perfcheck_loop__("<loop key>")`. Each
call says "an iteration starts" — so the one before it has ended: a clean boundary, after
the previous iteration's update and bookkeeping, where a run can be stopped. An early
`break` simply ends the calls, so iterations that really run are what gets counted.

The call costs about a quarter of a microsecond per iteration (a name lookup, a call and a
check), nothing next to a step of tensor work; runs that need no steps run the cell as
written. The hook is bound in the cell's namespace only while such a run executes, under a
name no user code takes (it starts with an underscore, which the state guard and the
object discovery pass over).

A loop is known by a key that survives the fixes' edits of the cell's text (they insert
lines, so line numbers move): its kind, its header as text and which occurrence of that
header it is.
"""

from __future__ import annotations

import ast
import contextlib
import functools
from collections.abc import Callable, Iterator
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

HOOK = "__perfcheck_loop__"
EVERY = frozenset({"*"})  # instrument every loop of the cell (the probe's runs)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)

Listener = Callable[[str], None]
_listeners: list[Listener] = []


@dataclass(frozen=True)
class Loop:
    """One loop of the cell's own code (not of a function or class it defines)."""

    key: str  # stable across edits of the cell: "for i in range(max_steps)#0"
    line: int  # the header's line in the source it was found in
    end_line: int  # the last line of its body
    depth: int  # loops around it in the cell's code (0: outermost)
    header: str  # `for i in range(max_steps)` / `while True`

    def encloses(self, line: int) -> bool:
        return self.line <= line <= self.end_line

    def describe(self) -> str:
        return f"`{self.header}` (cell line {self.line})"


def header_of(node: ast.For | ast.AsyncFor | ast.While) -> str:
    if isinstance(node, ast.While):
        return f"while {ast.unparse(node.test)}"
    prefix = "async for" if isinstance(node, ast.AsyncFor) else "for"
    return f"{prefix} {ast.unparse(node.target)} in {ast.unparse(node.iter)}"


def _walk_loops(tree: ast.AST) -> Iterator[tuple[ast.For | ast.AsyncFor | ast.While, int]]:
    """The loops of the cell's own code in source order, with their nesting depth."""

    def visit(node: ast.AST, depth: int) -> Iterator[tuple[Any, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                continue
            if isinstance(child, _LOOPS):
                yield child, depth
                yield from visit(child, depth + 1)
            else:
                yield from visit(child, depth)

    yield from visit(tree, 0)


@functools.lru_cache(maxsize=8)
def backward_call_lines(tree: ast.Module) -> frozenset[int]:
    """The cell lines whose own code calls `.backward(...)` (`loss.backward()`,
    `torch.autograd.backward(...)`): where the training step is, before any has run.
    Cached per tree (the probe asks at every iteration boundary)."""
    return frozenset(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backward"
    )


def loops_of(tree: ast.Module) -> list[Loop]:
    """Every loop of the cell's own code, outermost first within each nest."""
    seen: dict[str, int] = {}
    found = []
    for node, depth in _walk_loops(tree):
        header = header_of(node)
        occurrence = seen.get(header, 0)
        seen[header] = occurrence + 1
        end = node.end_lineno or node.lineno
        found.append(Loop(f"{header}#{occurrence}", node.lineno, end, depth, header))
    return found


def instrumented(tree: ast.Module, keys: frozenset[str]) -> ast.Module:
    """A copy of `tree` whose loops with these keys (all, with EVERY) call the hook first
    thing in every iteration. Line numbers are kept, so tracebacks and the lines a probe
    records are the editor's."""
    copy = deepcopy(tree)
    by_node = dict(zip((node for node, _ in _walk_loops(copy)), loops_of(copy), strict=True))
    for node, loop in by_node.items():
        if keys != EVERY and loop.key not in keys:
            continue
        first = node.body[0]
        call = ast.Expr(
            ast.Call(ast.Name(HOOK, ast.Load()), [ast.Constant(loop.key)], []),
        )
        for part in ast.walk(call):
            ast.copy_location(part, first)
            part.end_lineno, part.end_col_offset = first.lineno, first.col_offset  # type: ignore[attr-defined]
        node.body.insert(0, call)
    return copy


def _dispatch(key: str) -> None:
    """The hook a loop calls at the start of each iteration: tells every listener."""
    for listener in _listeners:
        listener(key)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Have `listener(key)` called at the start of every iteration of an instrumented
    loop while the block runs."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


@contextlib.contextmanager
def hook_bound(namespace: dict[str, Any]) -> Iterator[None]:
    """Bind the hook in the namespace the instrumented cell runs in, for the run only."""
    before = namespace.get(HOOK, _ABSENT)
    namespace[HOOK] = _dispatch
    try:
        yield
    finally:
        if before is _ABSENT:
            namespace.pop(HOOK, None)
        else:
            namespace[HOOK] = before


_ABSENT = object()
