"""Autograd bookkeeping the work does not need: grad recording in inference, zeroed grads.

Guide sections: "Disable gradient calculation for validation or inference" and "Use
parameter.grad = None instead of model.zero_grad() or optimizer.zero_grad()".
"""

from __future__ import annotations

import ast
import contextlib
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..cell import codeedit
from ..kernel import discovery
from ..kernel.fixes import Fix, Patcher
from ..report import FORWARD, OTHER, CodeChange, count
from . import bounds
from .base import Check, Detection, size_text
from .userfuncs import function_locations

if TYPE_CHECKING:
    from ..probe.graphs import GraphSite
    from ..probe.observation import Observation


def _lines_text(lines: list[int]) -> str:
    return ("line " if len(lines) == 1 else "lines ") + ", ".join(map(str, lines))


# no_grad ------------------------------------------------------------------------------------


class NoGradFix(Fix):
    """Run the cell under torch.no_grad()."""

    check_id = "no-grad"
    context_in_cell = True  # the change wraps the cell in `with torch.no_grad():`
    cuts_memory_on = frozenset({"cpu", "cuda"})  # no graph, no saved activations

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        return torch.no_grad()


INFERENCE_CAVEAT = (
    "torch.inference_mode() is faster still, but tensors made under it can never enter "
    "autograd later (e.g. to train on them)"
)


class NoGradCheck(Check):
    id = "no-grad"
    title = "Inference runs with autograd recording"
    guide = "Disable gradient calculation for validation or inference"

    def detect(self, obs: Observation) -> list[Detection]:
        if obs.backward_calls:
            return _evaluation_in_training(self, obs)
        return self._inference_cell(obs)

    def _inference_cell(self, obs: Observation) -> list[Detection]:
        """No backward at all: the whole cell runs under no_grad. A run cut short by running
        out of memory is no evidence of that where the cell calls backward further on."""
        if obs.out_of_memory and _calls_backward(obs.workload.tree):
            return []
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
        fixed, notes = source, []
        if lines:
            first = codeedit.top_statement_at(obs.tree, lines[0])
            last = codeedit.top_statement_at(obs.tree, lines[-1])
            if first is not None and last is not None:
                span = (first.lineno, last.end_lineno or last.lineno)
                fixed, notes = codeedit.edited(
                    source, lambda s: codeedit.wrap_lines(s, *span, "with torch.no_grad()")
                )
        where = f"{names}, cell {_lines_text(lines)}" if lines else names
        return [
            Detection(
                self.finding(
                    evidence=(
                        f"{count(calls, 'module call')} of {names} recorded an autograd graph "
                        "that no backward pass used"
                    ),
                    details="no backward pass ran in the cell",
                    where=where,
                    segment=FORWARD,
                    fixable=True,
                    line=lines[0] if lines else None,
                    caveat=INFERENCE_CAVEAT,
                    code_change=CodeChange(
                        codeedit.unified_diff(source, fixed),
                        ["or decorate the evaluation function with @torch.no_grad()", *notes],
                    ),
                ),
                NoGradFix(),
                fixed,
            )
        ]


# no_grad for the evaluation inside a training cell ----------------------------------------

GRAD_NAMES = frozenset({"backward", "grad"})  # code calling these needs autograd: never wrap


@dataclass
class _EvalTarget:
    """One place where evaluation forwards are put under no_grad: a user function rebound
    where it lives, or an edit of the cell (a def decorated, a lambda or statements wrapped)."""

    label: str
    function: types.FunctionType | None = None
    locations: list[discovery.Location] = field(default_factory=list)
    node: ast.AST | None = None  # the def, lambda or statement edited in the cell
    sites: list[GraphSite] = field(default_factory=list)
    forwards: int = 0  # evaluation forwards it covers

    @property
    def span(self) -> tuple[int, int] | None:
        if self.node is None:
            return None
        first = min([self.node.lineno, *(d.lineno for d in _decorators(self.node))])
        return first, self.node.end_lineno or self.node.lineno


def _decorators(node: ast.AST) -> list[ast.expr]:
    return list(getattr(node, "decorator_list", []))


def _needs_grad(node: ast.AST) -> bool:
    """Whether cell code calls backward / autograd.grad itself."""
    return any(
        isinstance(n, ast.Call) and codeedit.dotted_name(n.func).rsplit(".", 1)[-1] in GRAD_NAMES
        for n in ast.walk(node)
    )


class _Planner:
    """Chooses, for each evaluation site, the outermost place that wraps only evaluation:
    a user function on its stack that never issued a trained forward (rebound in the
    namespace, or edited where the cell defines it), else the cell statement it ran at,
    grown to the largest enclosing statement free of training."""

    def __init__(self, obs: Observation, trained: list[GraphSite]):
        self.obs = obs
        self.trained_codes = {code for site in trained for code in site.functions}
        self.trained_lines = {s.line for s in trained if s.line is not None} | obs.backward_lines
        self.can_edit = obs.workload.namespace.get("torch") is torch  # edits say torch.no_grad
        self.parents = {
            child: parent for parent in ast.walk(obs.tree) for child in ast.iter_child_nodes(parent)
        }
        self.targets: dict[Any, _EvalTarget] = {}
        self.unplaced = 0  # evaluation forwards no target can cover

    def place(self, site: GraphSite, forwards: int) -> None:
        target = None
        for code in site.functions:
            if code not in self.trained_codes and not GRAD_NAMES & set(code.co_names):
                target = self._function(code)
                if target is not None:
                    break
        if target is None and site.line is not None:
            target = self._statement(site.line)
        if target is None:
            self.unplaced += forwards
        else:
            target.sites.append(site)
            target.forwards += forwards

    def _function(self, code: types.CodeType) -> _EvalTarget | None:
        if code in self.targets:
            return self.targets[code]
        workload = self.obs.workload
        target = None
        if code.co_filename == workload.filename:
            node = self._cell_function(code)
            if node is not None and self.can_edit:
                kind = "the lambda" if isinstance(node, ast.Lambda) else f"{code.co_name}()"
                target = _EvalTarget(f"{kind} at cell line {node.lineno}", node=node)
        else:
            function, locations, _ = function_locations(
                workload.namespace, code, module_methods=True
            )
            locations = [loc for loc in locations if loc.rebindable]
            if function is not None and locations:
                target = _EvalTarget(str(locations[0]), function, locations)
        if target is not None:
            self.targets[code] = target
        return target

    def _cell_function(self, code: types.CodeType) -> ast.AST | None:
        """The def or lambda of the cell that compiled to `code` (None if ambiguous)."""
        matches = []
        for node in ast.walk(self.obs.tree):
            if isinstance(node, ast.Lambda) and code.co_name == "<lambda>":
                if node.lineno == code.co_firstlineno:
                    matches.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.name == code.co_name and first == code.co_firstlineno:
                    matches.append(node)
        return matches[0] if len(matches) == 1 else None

    def _statement(self, line: int) -> _EvalTarget | None:
        if not self.can_edit or line in self.trained_lines:
            return None
        node = self._innermost_statement(line)
        if node is None or _needs_grad(node):
            return None
        while True:
            parent = self.parents.get(node)
            if not isinstance(parent, ast.stmt) or isinstance(
                parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            ):
                break
            first, last = parent.lineno, parent.end_lineno or parent.lineno
            if any(first <= t <= last for t in self.trained_lines) or _needs_grad(parent):
                break
            node = parent
        key = ("statement", node.lineno)
        if key not in self.targets:
            last = node.end_lineno or node.lineno
            where = f"line {node.lineno}" if last == node.lineno else f"lines {node.lineno}-{last}"
            self.targets[key] = _EvalTarget(f"cell {where}", node=node)
        return self.targets[key]

    def _innermost_statement(self, line: int) -> ast.stmt | None:
        around = [
            node
            for node in ast.walk(self.obs.tree)
            if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or 0)
        ]
        return max(reversed(around), key=lambda node: node.lineno, default=None)  # deepest

    def chosen(self) -> list[_EvalTarget]:
        """Targets in cell order; an edit inside another edit merges into the outer one."""
        targets = [t for t in self.targets.values() if t.sites]
        kept: list[_EvalTarget] = []
        for target in sorted(targets, key=_widest_first):
            outer = next((k for k in kept if _contains(k.span, target.span)), None)
            if outer is None:
                kept.append(target)
            else:
                outer.sites.extend(target.sites)
                outer.forwards += target.forwards
        return sorted(kept, key=lambda t: t.span[0] if t.span else 0)


def _widest_first(target: _EvalTarget) -> tuple[int, int]:
    span = target.span
    return (0, 0) if span is None else (span[0], -span[1])


def _contains(outer: tuple[int, int] | None, inner: tuple[int, int] | None) -> bool:
    return outer is not None and inner is not None and outer[0] <= inner[0] <= inner[1] <= outer[1]


def _edit_cell(source: str, targets: list[_EvalTarget]) -> str:
    """Decorate defs, wrap lambdas, wrap statements: bottom-up, so positions stay valid."""
    for target in sorted(
        (t for t in targets if t.node is not None), key=lambda t: t.span, reverse=True
    ):
        node = target.node
        if isinstance(node, ast.Lambda):
            text = ast.get_source_segment(source, node) or ast.unparse(node)
            source = codeedit.replace_node(source, node, f"torch.no_grad()({text})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            source = codeedit.add_decorator(source, node, "torch.no_grad()")
        else:
            first, last = target.span
            source = codeedit.wrap_lines(source, first, last, "with torch.no_grad()")
    return source


class EvaluationNoGradFix(Fix):
    """The evaluation runs under no_grad, the training as before: evaluation functions are
    rebound where they live to `torch.no_grad()(function)` (after checking each place still
    holds the function the probe saw; undo puts the very same object back, unless the user
    has rebound the name since), and the cell's own evaluation code is edited."""

    check_id = "no-grad"
    cuts_memory_on = frozenset({"cpu", "cuda"})  # the evaluation saves no activations

    def __init__(self, functions: list[_EvalTarget], source: str, fixed: str):
        super().__init__()
        self.functions = functions
        self.source = source
        self.fixed = fixed
        self._wrapped: dict[int, Any] = {}

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for target in self.functions:
            original = target.function
            wrapped = self._wrapped.get(id(original))
            if wrapped is None:
                wrapped = self._wrapped[id(original)] = torch.no_grad()(original)
            for location in target.locations:
                patcher.rebind(namespace, location, original, wrapped)

    def edit_source(self, source: str) -> str:
        if source == self.source:
            return self.fixed
        return codeedit.combine(self.source, [source, self.fixed])  # after others' edits


def _evaluation_in_training(check: NoGradCheck, obs: Observation) -> list[Detection]:
    """Forwards whose graph no backward reached, in a cell that also trains."""

    def unused(site: GraphSite) -> int:
        # a probe stopped early may have cut a step between its forward and its backward
        return site.unused - (site.left_alive if obs.stopped_early else 0)

    sites = list(obs.graph_sites.values())
    evaluation = [s for s in sites if not s.backpropagated and unused(s) > 0]
    if not evaluation:
        return []
    trained = [s for s in sites if s.backpropagated]
    planner = _Planner(obs, trained)
    for site in evaluation:
        planner.place(site, unused(site))
    targets = planner.chosen()
    forwards = sum(unused(s) for s in evaluation)
    names = ", ".join(sorted({obs.module_path(s.module) for s in evaluation}))
    held = max(s.saved_bytes or 0 for s in evaluation)
    evidence = (
        f"{count(forwards, 'forward pass', 'forward passes')} of {names} built an autograd "
        "graph that no backward pass reached"
    )
    trained_through = sum(s.backpropagated for s in trained)
    details = [
        f"while {count(trained_through, 'other forward')} in the cell "
        f"{'was' if trained_through == 1 else 'were'} trained through"
    ]
    if held:
        details.append(f"the largest held {size_text(held)} of saved activations")
    places = [_where(t) for t in targets]
    if planner.unplaced:
        places.append(f"{planner.unplaced} in code that also trains, left as it is")
    details.append("they ran in " + "; ".join(places))
    source = obs.workload.source
    fixed, notes = codeedit.edited(source, lambda s: _edit_cell(s, targets))
    functions = [t for t in targets if t.function is not None]
    lines = sorted({s.line for s in evaluation if s.line is not None})
    where = "; ".join(_where(t) for t in targets) or f"{names}, cell {_lines_text(lines)}"
    return [
        Detection(
            check.finding(
                evidence=evidence,
                details="; ".join(details),
                where=where,
                segment=FORWARD,
                fixable=bool(targets),
                line=lines[0] if lines else None,
                caveat=(
                    "only the evaluation is wrapped: forwards a backward reached run as "
                    "before; " + INFERENCE_CAVEAT
                ),
                code_change=CodeChange(
                    codeedit.unified_diff(source, fixed),
                    [*(_decorate_advice(t) for t in functions), *notes],
                ),
            ),
            EvaluationNoGradFix(functions, source, fixed) if targets else None,
            fixed if fixed != source else None,
        )
    ]


def _where(target: _EvalTarget) -> str:
    lines = sorted({s.line for s in target.sites if s.line is not None})
    text = target.label
    if isinstance(target.node, ast.stmt) and not isinstance(target.node, ast.FunctionDef):
        lines = []  # the label already is the cell lines
    if lines:
        text += f", called at cell {_lines_text(lines)}"
    return f"{text} ({target.forwards} forward{'s' if target.forwards > 1 else ''})"


def _decorate_advice(target: _EvalTarget) -> str:
    function = target.function
    assert function is not None
    if function.__name__ == "<lambda>":
        return f"where `{target.label}` is defined: {target.label} = torch.no_grad()(lambda ...)"
    return (
        f"decorate `def {function.__qualname__}` (defined in an earlier cell) with @torch.no_grad()"
    )


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


def _name(obs: Observation, obj: Any) -> str:
    """How the user names an object (`opt`, `trainer.opt`), else its class."""
    entry = obs.found.get(id(obj))
    return entry.name if entry is not None else type(obj).__name__


class _ZeroGradNone(Fix):
    """zero_grad on the given optimizers/modules always sets grads to None; the cell's
    in-place zeroing statements become `p.grad = None`."""

    check_id = "zero-grad-none"

    def __init__(self, owners: dict[str, Any], source_edits: list[tuple[ast.stmt, str]]):
        super().__init__()
        self.owners = owners  # by name: `opt`, `model`
        self.source_edits = source_edits

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for name, owner in self.owners.items():
            class_zero_grad = type(owner).zero_grad

            def zero_grad(set_to_none: bool = True, _owner: Any = owner, _f=class_zero_grad):
                return _f(_owner, set_to_none=True)

            patcher.assign(owner, "zero_grad", zero_grad, f"{name}.zero_grad")

    def edit_source(self, source: str) -> str:
        edits = list(self.source_edits)
        return codeedit.edited(source, lambda s: codeedit.replace_nodes(s, edits))[0]


def _zeroing_share(obs: Observation, owners: list[Any], calls: int) -> float | None:
    """The largest share of a plain run setting grads to None can save: per in-place
    zero_grad call, the fill of every grad and the first accumulation's read of it
    (`bounds`)."""
    params: dict[int, torch.Tensor] = {}
    for owner in owners:
        if isinstance(owner, torch.optim.Optimizer):
            found = [p for group in owner.param_groups for p in group["params"]]
        elif isinstance(owner, torch.nn.Module):
            found = list(owner.parameters())
        else:
            return None
        params.update((id(p), p) for p in found)
    if not params:
        return None
    by_dtype: dict[torch.dtype, int] = {}
    for p in params.values():
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    saved_s = sum(bounds.passes_s(n, 2 * calls, dtype) for dtype, n in by_dtype.items())
    return bounds.share_of_run(saved_s, obs.wall_s)


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
        fixed, notes = codeedit.edited(
            source, lambda s: codeedit.replace_nodes(s, [*call_edits, *manual])
        )
        fix = None
        if owners or manual:
            fix = _ZeroGradNone({_name(obs, owner): owner for owner in owners}, manual)
            if not manual:  # in-place zeroing through zero_grad only: its grads are known
                fix.bounded_by(_zeroing_share(obs, owners, len(in_place_calls)))
            fix.seen = obs.places_of(*owners)
        lines = sorted(
            {c.line for c in in_place_calls if c.line is not None}
            | {stmt.lineno for stmt, _ in manual}
        )
        how = []
        if in_place_calls:
            names = ", ".join(sorted({self._owner_name(obs, o) for o in owners}))
            calls = count(len(in_place_calls), "time")
            how.append(f"{names}.zero_grad(set_to_none=False) called {calls}")
        if manual:
            manual_lines = sorted(stmt.lineno for stmt, _ in manual)
            how.append(f"in-place zeroing of .grad at cell {_lines_text(manual_lines)}")
        zeroed = obs.zeroed_grad_params
        evidence = (
            f"before {obs.zeroed_grad_backwards} of "
            f"{count(obs.backward_calls, 'backward pass', 'backward passes')}, up to "
            f"{count(zeroed, 'parameter grad')} "
            f"{'was an all-zero tensor' if zeroed == 1 else 'were all-zero tensors'} rather "
            "than None"
        )
        elsewhere = list(notes)
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
                    details="; ".join(how) or None,
                    # zeroing in place is a fill in zero_grad (the split's "other") and
                    # an add, not a copy, at the backward's first accumulation: the fill
                    # is the part a run's split shows apart
                    segment=OTHER,
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


def _calls_backward(tree: ast.AST) -> bool:
    """Whether the cell's own code calls `.backward(...)` or `torch.autograd.backward(...)`."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backward"
        for node in ast.walk(tree)
    )
