"""Where `amp` puts `torch.autocast` in a training cell: around the forward pass and the loss.

PyTorch's AMP recipe autocasts the forward pass and the loss computation only:
`loss.backward()` and `optimizer.step()` run outside it (backward ops run in the dtype
autocast chose for their forward ops anyway). With float16 a `GradScaler` scales the loss
before backward and steps the optimizer (`scaler.scale(loss).backward()`,
`scaler.step(opt)`, `scaler.update()`, and `scaler.unscale_(opt)` before gradients are
clipped); bfloat16 needs no scaler.

The statements to wrap come from the cell's AST and the probe's cell lines: for each
`.backward()` call, the statements of its block from the first one that ran a forward of the
model (directly, or through a function the cell defines) to the last one binding the tensor
backward is called on. A backward called on an expression (`loss_fn(model(x), y).backward()`)
is split: the expression is bound to a name inside the `with` block, backward called on that
name after it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from ..cell import codeedit

CLIP_CALLS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm"})
# statements a backward may sit in while its forward ran just before the statement itself
_CLIMBABLE = (ast.If, ast.With, ast.Try)


@dataclass(frozen=True)
class Region:
    """Statements of one block that run under autocast, and the backward that follows."""

    first: int  # line of the first statement under autocast
    last: int  # end line of the last one
    backward: ast.stmt  # the statement calling backward, right after the region
    call: ast.Call  # its `.backward(...)` call
    split: bool  # backward is called on an expression: bind it inside the region


@dataclass(frozen=True)
class Scaler:
    """The GradScaler calls a float16 training cell needs, in the cell's own names."""

    name: str  # the scaler's name, e.g. "scaler"
    device: str
    optimizer: str  # how the cell names the optimizer it steps, e.g. "opt"


def regions(tree: ast.Module, forward_lines: set[int]) -> list[Region]:
    """The forward-to-loss statements before each backward call of the cell, in cell order.

    `forward_lines` are the cell lines from which the probe saw the model's forwards run."""
    parents = _parents(tree)
    forwarding = _forwarding_functions(tree, forward_lines)
    found: dict[tuple[int, int], Region] = {}
    for call in _backward_calls(tree):
        statement = codeedit.statement_of(tree, call)
        if statement is None:
            continue
        region = _region(statement, call, parents, forward_lines, forwarding)
        if region is not None:  # backwards in both arms of an `if` share their region
            found.setdefault((region.first, region.last), region)
    return sorted(found.values(), key=lambda r: r.first)


def _region(
    statement: ast.stmt,
    call: ast.Call,
    parents: dict[ast.AST, tuple[ast.AST, list[ast.stmt]]],
    forward_lines: set[int],
    forwarding: set[str],
) -> Region | None:
    """The region before `statement`'s backward, climbing out of an `if`/`with`/`try`
    that holds the backward but not the forward."""
    receiver = call.func.value  # type: ignore[attr-defined]
    loss = receiver.id if isinstance(receiver, ast.Name) else None
    split = loss is None and _runs_forward(statement, forward_lines, forwarding)
    if split and not (isinstance(statement, ast.Expr) and statement.value is call):
        return None  # an expression backward inside a larger statement: left as it is
    anchor = statement
    while True:
        parent, block = parents.get(anchor, (None, []))
        before = block[: block.index(anchor)] if anchor in block else []
        # the statements since the previous backward in this block belong to this one
        start = max((i + 1 for i, s in enumerate(before) if _calls_backward(s)), default=0)
        candidates = before[start:]
        first = next(
            (i for i, s in enumerate(candidates) if _runs_forward(s, forward_lines, forwarding)),
            None,
        )
        if first is not None or split:
            break
        if not isinstance(parent, _CLIMBABLE):
            return None
        anchor = parent
    wrapped = candidates[first:] if first is not None else []
    if loss is not None:
        binding = [i for i, s in enumerate(wrapped) if loss in _bound_names(s)]
        if not binding:
            return None
        wrapped = wrapped[: binding[-1] + 1]
    if split:
        head = wrapped[0] if wrapped else statement
        return Region(head.lineno, _end(statement), statement, call, True)
    return Region(wrapped[0].lineno, _end(wrapped[-1]), statement, call, False)


def edit(
    source: str,
    tree: ast.Module,
    found: list[Region],
    header: str,
    loss_name: str,
    scaler: Scaler | None = None,
) -> str | None:
    """The cell with each region under `header:` (`with torch.autocast(...)`); with
    `scaler`, also the GradScaler's calls. None when a scaler call has no clear place
    (an optimizer stepped with a closure, or stepped outside the cell). The edits are made
    on the cell's libcst tree, so comments and layout stay; EditError where one cannot be."""
    if scaler is not None and (
        len(found) != len(_backward_calls(tree))
        or not all(isinstance(r.backward, ast.Expr) and r.backward.value is r.call for r in found)
    ):
        return None  # a backward without its own region, or inside a larger statement
    edits = codeedit.Tree(source)
    for region in found:
        _wrap(edits, region, header, loss_name, scaler)
    if scaler is not None:
        if not _scaler_edits(edits, tree, scaler):
            return None
        top = codeedit.top_statement_at(tree, found[0].first)
        creation = f'{scaler.name} = torch.amp.GradScaler("{scaler.device}")'
        _insert(edits, edits.member_of(edits.node_for(top)), creation)
    return edits.code()


def _wrap(
    edits: codeedit.Tree, region: Region, header: str, loss_name: str, scaler: Scaler | None
) -> None:
    """The region's statements under `header:`; a backward called on an expression is
    split (the expression bound to `loss_name` inside the block, backward called on that
    name after it); with `scaler`, backward is called on `scaler.scale(loss)`."""
    import libcst as cst

    first, last = edits.run(region.first, region.last)
    call = edits.node_for(region.call)
    receiver = call.func.value
    if not region.split:
        edits.wraps[first] = codeedit.Wrap(last, header)
        if scaler is not None:
            edits.nodes[call] = lambda c: c.with_changes(
                func=c.func.with_changes(value=_scaled(c.func.value, scaler))
            )
        return
    line = edits.member_of(call)
    if "\n" not in cst.Module([]).code_for_node(receiver):  # parentheses carry line breaks
        receiver = receiver.with_changes(lpar=[], rpar=[])
    bound = cst.Assign([cst.AssignTarget(cst.Name(loss_name))], receiver)
    called_on: Any = cst.Name(loss_name)
    if scaler is not None:
        called_on = _scaled(called_on, scaler)
    backward = call.with_changes(func=call.func.with_changes(value=called_on))
    after = line.deep_replace(call, backward).with_changes(leading_lines=[])
    edits.members[line] = lambda old: [cst.SimpleStatementLine([bound], old.leading_lines)]
    edits.wraps[first] = codeedit.Wrap(line, header, (after,))


def _scaled(receiver: Any, scaler: Scaler) -> Any:
    """`scaler.scale(receiver)` as a libcst expression."""
    import libcst as cst

    return cst.Call(codeedit.expression(f"{scaler.name}.scale"), [cst.Arg(receiver)])


def _insert(edits: codeedit.Tree, member: Any, text: str) -> None:
    """`text` as statements right before the block statement `member`."""
    edits.inserts.setdefault(member, []).extend(codeedit.statements(text))


def _scaler_edits(edits: codeedit.Tree, tree: ast.Module, scaler: Scaler) -> bool:
    """`opt.step()` becomes `scaler.step(opt)` and `scaler.update()`; clipping gradients
    is preceded by `scaler.unscale_(opt)`. False where a step has no clear place (a closure,
    a step inside an expression or sharing its line, no step in the cell)."""
    import libcst as cst

    steps = 0
    for call in codeedit.calls_named(tree, {"step"}):
        if codeedit.dotted_name(call.func) != f"{scaler.optimizer}.step":
            continue
        statement = codeedit.statement_of(tree, call)
        if call.args or call.keywords or not isinstance(statement, ast.Expr):
            return False  # a closure, or a step inside an expression
        if statement.value is not call:
            return False
        line = edits.member_of(edits.node_for(statement))
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
            return False
        step, update = codeedit.statements(
            f"{scaler.name}.step({scaler.optimizer})\n{scaler.name}.update()"
        )
        edits.members[line] = lambda old, step=step, update=update: [
            old.with_changes(body=step.body),
            update,
        ]
        steps += 1
    for call in codeedit.calls_named(tree, set(CLIP_CALLS)):
        statement = codeedit.statement_of(tree, call)
        if statement is not None:
            member = edits.member_of(edits.node_for(statement))
            _insert(edits, member, f"{scaler.name}.unscale_({scaler.optimizer})")
    return steps > 0


def free_name(tree: ast.Module, namespace: dict[str, Any], *choices: str) -> str:
    """The first of `choices` that neither the cell nor the namespace uses (else the last)."""
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return next((c for c in choices if c not in used and c not in namespace), choices[-1])


def _parents(tree: ast.Module) -> dict[ast.AST, tuple[ast.AST, list[ast.stmt]]]:
    """Each statement's parent node and the statement list holding it."""
    found: dict[ast.AST, tuple[ast.AST, list[ast.stmt]]] = {}
    for parent in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list):
                for child in block:
                    found[child] = (parent, block)
        for handler in getattr(parent, "handlers", []):
            for child in handler.body:
                found[child] = (handler, handler.body)
    return found


def _forwarding_functions(tree: ast.Module, forward_lines: set[int]) -> set[str]:
    """Names of the cell's own functions through which the model's forwards ran (a forward
    line in their body, or a call of another such function), for statements calling them."""
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    names: set[str] = set()
    while True:
        more = {
            d.name
            for d in defs
            if d.name not in names and _runs_forward(d, forward_lines, names, body_only=True)
        }
        if not more:
            return names
        names |= more


def _runs_forward(
    node: ast.stmt, forward_lines: set[int], forwarding: set[str], body_only: bool = False
) -> bool:
    """Whether the statement ran a forward of the model: one of its lines issued one, or it
    calls a cell function that did. A def only counts for what its body does when called
    (`body_only`): defining it runs nothing."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not body_only:
        return False
    if any(node.lineno <= line <= _end(node) for line in forward_lines):
        return True
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in forwarding
        for n in ast.walk(node)
    )


def _backward_calls(node: ast.AST) -> list[ast.Call]:
    """`x.backward(...)` calls, whatever `x` is (a name, `loss_fn(out, y)`, `out.sum()`)."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "backward"
    ]


def _calls_backward(node: ast.stmt) -> bool:
    return bool(_backward_calls(node))


def _bound_names(node: ast.stmt) -> set[str]:
    """Names a statement binds at its own level (assignments, `for` targets, `with ... as`)."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
    names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.If, ast.With, ast.AsyncWith, ast.Try)):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                names |= _bound_names(child)
    return names


def _end(node: ast.AST) -> int:
    return getattr(node, "end_lineno", None) or node.lineno  # type: ignore[attr-defined]
