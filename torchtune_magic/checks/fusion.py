"""Chains of elementwise ops that a compiler would fuse into one kernel.

Guide: "Fuse pointwise operations" — each eager elementwise op reads and writes the whole
tensor and pays a dispatch; `torch.compile` (the guide's older spelling: `torch.jit.script`)
fuses a chain of them into one kernel. Evidence is the profiler's op stream: runs of
consecutive pointwise ops, attributed to the module or user function that issued them by the
probe's scope spans, so the fix compiles exactly that object and rebinds it where it lives.
"""

from __future__ import annotations

import ast
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..cell import codeedit
from ..distributed import lockstep
from ..kernel import discovery
from ..kernel.fixes import Fix, Patcher
from ..probe import frameworks
from ..report import FORWARD, OTHER, CodeChange, count
from .base import Check, Detection
from .userfuncs import function_locations

if TYPE_CHECKING:
    from ..probe.memory import OpEvent
    from ..probe.observation import Observation, Scope

# Pointwise chains must take this share of the cell's time. Measured on a 2-core CPU: a
# GELU-style chain on a 64x16384 tensor next to a matmul sized to vary its share, compiling
# the chain's function gave 1.06x at a 20% share, 1.29x at 39%, 1.71x at 61%, 2.38x at 78%
# (the chain itself ~3.5x faster), so at 15% the cell cannot gain much more than 10%. Small
# tensors gain nothing even at a 34% share (0.89x: the compiled call's overhead), which the
# measured fix then shows.
MIN_SHARE = 0.15
MIN_RUN = 3  # ops in a row before a chain counts
TOLERANCE = 1e-4  # compiled float math may reassociate: "close" within this
MAX_TARGETS = 3

# fmt: off
POINTWISE = frozenset({
    "abs", "add", "addcdiv", "addcmul", "clamp", "clamp_min", "clamp_max", "cos", "cosh",
    "div", "erf", "erfc", "exp", "exp2", "expm1", "gelu", "hardsigmoid", "hardswish",
    "hardtanh", "leaky_relu", "lerp", "log", "log1p", "log2", "logical_and", "logical_not",
    "logical_or", "maximum", "minimum", "mish", "mul", "neg", "pow", "reciprocal", "relu",
    "rsqrt", "rsub", "sigmoid", "sign", "silu", "sin", "sinh", "softplus", "sqrt", "square",
    "sub", "tan", "tanh", "threshold", "where",
})
# Ops that neither break a chain nor count towards it: views and bookkeeping.
NEUTRAL = frozenset({
    "alias", "as_strided", "detach", "empty", "empty_like", "expand", "permute", "reshape",
    "squeeze", "t", "transpose", "unsqueeze", "view",
})
# fmt: on
_BACKWARD = re.compile(r"evaluate_function: (\w+?)Backward\d+$")


def _base_name(name: str) -> str:
    """`aten::mul_` → `mul`; `autograd::engine::evaluate_function: TanhBackward0` → `tanh`."""
    backward = _BACKWARD.search(name)
    if backward:
        return backward.group(1).lower()
    return name.rsplit("::", 1)[-1].rstrip("_")


@dataclass
class Chain:
    """Consecutive pointwise ops in the stream."""

    ops: list[OpEvent] = field(default_factory=list)

    @property
    def start_us(self) -> float:
        return self.ops[0].start_us

    @property
    def end_us(self) -> float:
        return self.ops[-1].end_us

    @property
    def busy_us(self) -> float:
        return sum(op.end_us - op.start_us for op in self.ops)


def chains(ops: list[OpEvent]) -> list[Chain]:
    """Runs of at least MIN_RUN pointwise ops; views in between do not break a run."""
    found: list[Chain] = []
    current = Chain()
    for op in ops:
        base = _base_name(op.name)
        if base in NEUTRAL:
            continue
        if base in POINTWISE:
            current.ops.append(op)
            continue
        if len(current.ops) >= MIN_RUN:
            found.append(current)
        current = Chain()
    if len(current.ops) >= MIN_RUN:
        found.append(current)
    return found


@dataclass
class Target:
    """What to compile: a user function (rebound where it lives) or a model (in place)."""

    label: str
    function: types.FunctionType | None = None
    locations: list[discovery.Location] = field(default_factory=list)
    module: torch.nn.Module | None = None
    cell_def: ast.FunctionDef | None = None  # a def in the cell itself: decorate it
    cell_assign: ast.stmt | None = None  # the cell (re)builds the model: compile after it
    busy_us: float = 0.0
    ops: int = 0


def _cell_assignment(tree: ast.Module, name: str) -> ast.stmt | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node
    return None


class _Resolver:
    """Turns scopes into targets, once per scope object."""

    def __init__(self, obs: Observation):
        self.obs = obs
        self.targets: dict[int, Target] = {}
        self.failed: set[int] = set()

    def target(self, scope: Scope) -> Target | None:
        key = id(scope.obj)
        if key in self.failed:
            return None
        if key not in self.targets:
            made = self._function(scope.obj) if scope.kind == "function" else self._model(scope)
            if made is None:
                self.failed.add(key)
                return None
            existing = next((t for t in self.targets.values() if t.label == made.label), None)
            self.targets[key] = existing or made
        return self.targets[key]

    def _function(self, code: types.CodeType) -> Target | None:
        workload = self.obs.workload
        if code.co_filename == workload.filename:
            for node in ast.walk(workload.tree):
                if isinstance(node, ast.FunctionDef) and node.lineno == code.co_firstlineno:
                    return Target(node.name, cell_def=node)
            return None
        function, locations, on_module = function_locations(workload.namespace, code)
        if function is None or on_module:
            return None
        locations = [loc for loc in locations if loc.rebindable]
        return Target(str(locations[0]), function, locations) if locations else None

    def _model(self, scope: Scope) -> Target | None:
        for entry in discovery.top_level_modules(self.obs.found):
            if not any(sub is scope.obj for sub in entry.obj.modules()):
                continue
            if not entry.locations:
                return None
            name = str(entry.locations[0])
            assign = _cell_assignment(self.obs.tree, name) if "." not in name else None
            return Target(name, module=entry.obj, cell_assign=assign)
        return None


def _enclosing(scopes: list[Scope], ops: list[OpEvent]) -> Iterator[tuple[OpEvent, list[Scope]]]:
    """Each op (in start order) with the scopes around it, innermost first (a sweep)."""
    pending = sorted(scopes, key=lambda s: s.start_us)
    active: list[Scope] = []
    index = 0
    for op in sorted(ops, key=lambda o: o.start_us):
        while index < len(pending) and pending[index].start_us <= op.start_us:
            active.append(pending[index])
            index += 1
        active = [s for s in active if s.end_us >= op.end_us or s.end_us > op.start_us]
        around = [s for s in active if s.end_us >= op.end_us]
        yield op, sorted(around, key=lambda s: s.end_us - s.start_us)


class CompileFix(Fix):
    """torch.compile the functions/models that issue the chains.

    Functions are rebound at every place they live (undo puts the original object back);
    models are compiled in place as `nn.Module.compile()` does, so the name, the optimizer's
    parameters and state_dict keys are untouched. The compiled objects are cached here, so
    compiling happens once, in the session's warm-up run, and is reported as one-time cost.
    """

    check_id = "fuse-pointwise"
    tolerance = TOLERANCE
    one_time_cause = "compile"
    one_time_guess_s = 10.0  # inductor on a CPU: 4-20 s for a small function here

    def __init__(self, targets: list[Target]):
        super().__init__()
        self.targets = targets
        self._compiled: dict[int, Any] = {}

    def _compile(self, key: int, build: Any) -> Any:
        if key not in self._compiled:
            self._compiled[key] = build()
        return self._compiled[key]

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for target in self.targets:
            if target.module is not None and target.cell_assign is None:
                module = target.module
                compiled = self._compile(id(module), lambda m=module: torch.compile(m._call_impl))
                label = f"{target.label}._compiled_call_impl"
                patcher.assign(module, "_compiled_call_impl", compiled, label)
            elif target.function is not None:
                original = target.function
                compiled = self._compile(id(original), lambda f=original: torch.compile(f))
                for location in target.locations:
                    patcher.rebind(namespace, location, original, compiled)

    def edit_source(self, source: str) -> str:
        return _edited_source(source, self.targets)


def _compile_fix(obs: Observation, targets: list[Target], share: float) -> CompileFix | None:
    """The fix, refusing later if a model it compiles in place was replaced since the probe
    (functions are checked where they are rebound); its gain bounded by the chains' share."""
    if not targets:
        return None
    fix = CompileFix(targets)
    fix.seen = obs.places_of(*(t.module for t in targets if t.module is not None))
    fix.bounded_by(share)
    return fix


def _edited_source(source: str, targets: list[Target]) -> str:
    """Decorate defs made in the cell; compile models right after the cell builds them."""
    lines = source.splitlines(keepends=True)
    inserts: list[tuple[int, str]] = []  # (0-based line to insert before, text)
    for target in targets:
        if target.cell_def is not None:
            node = target.cell_def
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
            inserts.append((first, f"{indent}@torch.compile\n"))
        elif target.cell_assign is not None:
            end = target.cell_assign.end_lineno or target.cell_assign.lineno
            inserts.append((end, f"{target.label}.compile()\n"))
    if inserts and lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    for index, text in sorted(inserts, reverse=True):
        lines.insert(index, text)
    return "".join(lines)


def _elsewhere(target: Target) -> str | None:
    if target.cell_def is not None or target.cell_assign is not None:
        return None
    if target.module is not None:
        return (
            f"where `{target.label}` is built: {target.label}.compile()  "
            f"(or {target.label} = torch.compile({target.label}))"
        )
    assert target.function is not None
    name = target.function.__qualname__
    if "<locals>" in name:
        return (
            f"wrap the function the factory returns: {target.label} = "
            f"torch.compile({name.split('.<locals>')[0]}(...)), or decorate the inner def"
        )
    return f"decorate `def {name}` (defined in an earlier cell) with @torch.compile"


class FusePointwiseCheck(Check):
    id = "fuse-pointwise"
    title = "Chains of elementwise ops run one kernel each"
    guide = "Fuse pointwise operations"
    threshold = (
        f"chains of ≥{MIN_RUN} elementwise ops ≥ {MIN_SHARE:.0%} of the cell's time (2-core "
        "CPU, compiled: 1.06x at a 20% share, 1.29x at 39%, 1.71x at 61%, 2.38x at 78%)"
    )

    def detect(self, obs: Observation) -> list[Detection]:
        if not obs.ops or obs.profiled_s <= 0:
            return []
        found = chains(obs.ops)
        busy = sum(c.busy_us for c in found)
        share = lockstep.mean(busy / (obs.profiled_s * 1e6))
        if share < MIN_SHARE:
            return []
        resolver = _Resolver(obs)
        unattributed = 0.0
        chained = [op for chain in found for op in chain.ops]
        for op, around in _enclosing(obs.scopes, chained):
            target = next((t for s in around if (t := resolver.target(s))), None)
            if target is None:
                unattributed += op.end_us - op.start_us
                continue
            target.busy_us += op.end_us - op.start_us
            target.ops += 1
        unique = {id(t): t for t in resolver.targets.values() if t.ops}
        targets = sorted(unique.values(), key=lambda t: -t.busy_us)[:MAX_TARGETS]
        longest = max(found, key=lambda c: len(c.ops))
        names = ", ".join(_base_name(op.name) for op in longest.ops[:8])
        evidence = (
            f"chains of elementwise ops took {share:.0%} of the cell's time ({busy / 1e3:.1f} ms "
            f"of {obs.profiled_text(lambda s: f'{s * 1e3:.1f} ms')})"
        )
        details = (
            f"{count(len(found), 'chain')} of ≥{MIN_RUN} consecutive elementwise ops; "
            f"longest: {len(longest.ops)} ops ({names}{', …' if len(longest.ops) > 8 else ''})"
        )
        if targets:
            details += "; issued by " + ", ".join(
                f"{t.label} ({t.busy_us / 1e3:.1f} ms)" for t in targets
            )
        if unattributed:
            details += f"; {unattributed / 1e3:.1f} ms from the cell's own top-level code"
        source = obs.workload.source
        fixed = _edited_source(source, targets)
        # a Hugging Face Trainer's model: compiled by the Trainer itself, from its arguments
        change = frameworks.args_change(
            obs.workload, obs.names_before, {"torch_compile": "True"}, "when the Trainer is built"
        )
        model = change.owner.trainer.model if change is not None else None
        if not any(t.module is model for t in targets if t.module is not None):
            change, model = None, None
        elsewhere = [
            text
            for t in targets
            if (model is None or t.module is not model) and (text := _elsewhere(t))
        ]
        if unattributed:
            elsewhere.append("move the cell's elementwise math into a function and compile it")
        if change is not None:
            elsewhere += change.elsewhere
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,
                    # a model's chains run in its forward; a function's, in the cell's code
                    segment=FORWARD if any(t.module is not None for t in targets) else OTHER,
                    where=", ".join(t.label for t in targets) or "the cell's top-level code",
                    fixable=bool(targets),
                    caveat=(
                        "compiling costs seconds once (reported as one-time cost, with the "
                        "runs needed to pay it back); compiled float math may differ in the "
                        f"last bits, so numerics are 'close' within {TOLERANCE:g}, not identical"
                    ),
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
                ),
                _compile_fix(obs, targets, share),
                fixed if fixed != source else None,
                change.earlier if change is not None else [],
            )
        ]
