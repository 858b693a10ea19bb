"""Autograd bookkeeping the work does not need: grad recording in inference, zeroed grads.

Guide sections: "Disable gradient calculation for validation or inference" and "Use
parameter.grad = None instead of model.zero_grad() or optimizer.zero_grad()".
"""

from __future__ import annotations

import ast
import contextlib
from typing import TYPE_CHECKING, Any

import torch

from ..engine import codeedit
from ..engine.fixes import Fix, Patcher
from ..report import CodeChange
from .base import Check, Detection

if TYPE_CHECKING:
    from ..engine.probe import Observation


def _lines_text(lines: list[int]) -> str:
    return ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines))


# no_grad ------------------------------------------------------------------------------------


class NoGradFix(Fix):
    """Run the cell under torch.no_grad()."""

    check_id = "no-grad"

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        return torch.no_grad()


class NoGradCheck(Check):
    id = "no-grad"
    title = "Inference runs with autograd recording"
    guide = "Disable gradient calculation for validation or inference"

    def detect(self, obs: Observation) -> list[Detection]:
        if obs.backward_calls:
            return []  # a training cell: autograd is needed
        recording = [
            use
            for use in obs.modules.values()
            if use.outer_calls
            and use.grad_calls
            and any(p.requires_grad for p in use.module.parameters())
        ]
        if not recording:
            return []
        calls = sum(use.grad_calls for use in recording)
        names = ", ".join(sorted({obs.module_path(use.module) for use in recording}))
        lines = sorted({line for use in recording for line in use.lines})
        source = obs.workload.source
        fixed = source
        if lines:
            first = codeedit.top_statement_at(obs.tree, lines[0])
            last = codeedit.top_statement_at(obs.tree, lines[-1])
            if first is not None and last is not None:
                fixed = codeedit.wrap_lines(
                    source, first.lineno, last.end_lineno or last.lineno, "with torch.no_grad()"
                )
        where = f"{names}, cell {_lines_text(lines)}" if lines else names
        return [
            Detection(
                self.finding(
                    evidence=(
                        f"{names} ran with grad recording ({calls} module calls) "
                        "and no backward pass ran in the cell"
                    ),
                    where=where,
                    fixable=True,
                    line=lines[0] if lines else None,
                    caveat=(
                        "torch.inference_mode() is faster still, but tensors made under it can "
                        "never enter autograd later (e.g. to train on them)"
                    ),
                    code_change=CodeChange(
                        codeedit.unified_diff(source, fixed),
                        ["or decorate the evaluation function with @torch.no_grad()"],
                    ),
                ),
                NoGradFix(),
                fixed,
            )
        ]


# grads set to None --------------------------------------------------------------------------

NONE_CAVEAT = (
    "None gradients behave a little differently from zero tensors: optimizers skip parameters "
    "whose .grad is None for that step, and code reading p.grad must handle None"
)


def _set_to_none_false(call: ast.Call) -> ast.expr | None:
    """The `False` node passed as set_to_none in a zero_grad call, if any."""
    for keyword in call.keywords:
        if keyword.arg == "set_to_none":
            value = keyword.value
            return value if isinstance(value, ast.Constant) and value.value is False else None
    if call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value is False:
        return call.args[0]
    return None


def _manual_zeroing(tree: ast.Module) -> list[tuple[ast.stmt, str]]:
    """Statements zeroing a grad in place, with the `X.grad = None` that replaces them."""
    found = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr in ("zero_", "fill_"):
                owner = func.value
                if isinstance(owner, ast.Attribute) and owner.attr == "data":
                    owner = owner.value
                if isinstance(owner, ast.Attribute) and owner.attr == "grad":
                    target = owner
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            lhs, rhs = node.targets[0], node.value
            callee = codeedit.dotted_name(rhs.func) if isinstance(rhs, ast.Call) else ""
            if (
                isinstance(lhs, ast.Attribute)
                and lhs.attr == "grad"
                and callee.rsplit(".", 1)[-1] in ("zeros_like", "zeros")
            ):
                target = lhs
        if target is not None:
            found.append((node, f"{ast.unparse(target)} = None"))
    return found


class _ZeroGradNone(Fix):
    """zero_grad on the given optimizers/modules always sets grads to None; the cell's
    in-place zeroing statements become `p.grad = None`."""

    check_id = "zero-grad-none"

    def __init__(self, owners: list[Any], source_edits: list[tuple[ast.stmt, str]]):
        super().__init__()
        self.owners = owners
        self.source_edits = source_edits

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for owner in self.owners:
            class_zero_grad = type(owner).zero_grad

            def zero_grad(set_to_none: bool = True, _owner: Any = owner, _f=class_zero_grad):
                return _f(_owner, set_to_none=True)

            patcher.setattr(owner, "zero_grad", zero_grad)

    def edit_source(self, source: str) -> str:
        return codeedit.replace_nodes(source, list(self.source_edits))


class ZeroGradNoneCheck(Check):
    id = "zero-grad-none"
    title = "Gradients are zeroed in place instead of set to None"
    guide = "Use parameter.grad = None instead of model.zero_grad() or optimizer.zero_grad()"

    def detect(self, obs: Observation) -> list[Detection]:
        if not obs.zeroed_grad_backwards:
            return []
        in_place_calls = [c for c in obs.zero_grad_calls if c.detail is False]
        owners = list({id(c.owner): c.owner for c in in_place_calls}.values())
        manual = _manual_zeroing(obs.tree)
        source = obs.workload.source
        call_edits = [
            (false_node, "True")
            for call in codeedit.calls_named(obs.tree, {"zero_grad"})
            if (false_node := _set_to_none_false(call)) is not None
        ]
        fixed = codeedit.replace_nodes(source, [*call_edits, *manual])
        fix = _ZeroGradNone(owners, manual) if owners or manual else None
        lines = sorted(
            {c.line for c in in_place_calls if c.line is not None}
            | {stmt.lineno for stmt, _ in manual}
        )
        how = []
        if in_place_calls:
            names = ", ".join(sorted({self._owner_name(obs, o) for o in owners}))
            how.append(f"{names}.zero_grad(set_to_none=False) called {len(in_place_calls)} times")
        if manual:
            manual_lines = sorted(stmt.lineno for stmt, _ in manual)
            how.append(f"in-place zeroing of .grad at cell {_lines_text(manual_lines)}")
        evidence = (
            f"before {obs.zeroed_grad_backwards} of {obs.backward_calls} backward passes, up to "
            f"{obs.zeroed_grad_params} parameter grads were all-zero tensors rather than None"
        )
        if how:
            evidence += f" ({'; '.join(how)})"
        elsewhere = []
        if fix is None:
            elsewhere.append(
                "the grads are zeroed in code outside this cell: set them to None there "
                "(optimizer.zero_grad() does so by default since torch 2.0)"
            )
        where_parts = [self._owner_name(obs, o) for o in owners]
        if lines:
            where_parts.append(f"cell {_lines_text(lines)}")
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    where=", ".join(where_parts) or "code called from this cell",
                    fixable=fix is not None,
                    line=lines[0] if lines else None,
                    caveat=NONE_CAVEAT,
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
                ),
                fix,
                fixed,
            )
        ]

    @staticmethod
    def _owner_name(obs: Observation, owner: Any) -> str:
        entry = obs.found.get(id(owner))
        if entry is not None and entry.locations:
            return entry.name
        if isinstance(owner, torch.nn.Module):
            return obs.module_path(owner)
        return type(owner).__name__
