"""Steps: a cell's repeating unit, and measuring runs that stop after the same step.

A long training cell repeats one unit of work: a batch drawn from a DataLoader, an
optimizer step, or a top-level forward of the main model. The probe counts these units
(and, once a cell is long, stops itself at a step boundary); measuring runs of a long cell
then stop after the same step K for every configuration, the first W of them warm-up, so
every configuration is timed over the same work and compared per step.

How K, W and the threshold are chosen (from the measuring budget B and the number of
configurations C, i.e. the baseline plus the fix sets):
- A run is *sampled* when C configurations x (1 warm-up + a profiled checking run) and
  TARGET_ROUNDS rounds of C + 1 runs (each round closes with the baseline again) of the
  whole cell would not fit in B (`worth_sampling`); a cell the probe
  had to stop early is always sampled. A cell with fewer than W + MIN_TIMED_STEPS + 1 steps
  never is.
- W = 2 warm-up steps (1 where the cell has no room for two): the first step pays the
  iterator's and workers' start, compile and autotuning, the second catches a recompile;
  neither is timed (their cost is reported apart as one-time cost, from each configuration's
  first run). A DataLoader with workers hands out its prefetched batches in a burst when an
  epoch starts (measured here: batches 3-6 at 22-59 ms, batches 7-32 at 84-89 ms with 4
  workers), so where a loader with workers is in play (the user's, or one a fix builds), W
  and the timed steps are each at least its prefetch depth (workers x prefetch factor).
- K is the largest stop step for which TARGET_ROUNDS rounds of C + 1 runs of K steps fit in
  what B leaves after the baseline's first run (which sets K from its time to step W and
  its time per step: `choose_stop`) and the short profiled runs for memory and FLOPs. At
  least MIN_TIMED_STEPS (or the prefetch depth) are timed per run, even when that overruns
  the budget.

- Epoch restarts: a cell of several epochs pays at each epoch's start what steps inside an
  epoch do not (end-of-epoch code, a new iterator, workers starting or refilling). Where
  one epoch is longer than the timed steps, every run's first epoch ends after step
  W + max(MIN_TIMED_STEPS, timed - settle) (`SamplePlan.epoch_end`; settle = the prefetch
  depth, at least MIN_TIMED_STEPS, so the refill is seen whole) and the timed steps then
  count one restart per epoch's batches (`StepTimes.per_step`); such plans time at least
  MIN_TIMED_STEPS + settle steps.

The stop is a private BaseException raised from the counting hook at the step boundary, so
user code that catches `Exception` does not swallow it; the runner catches it.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..cell import loops
from ..cell.workload import synchronize
from ..distributed import lockstep
from ..kernel.fixes import Patcher
from . import frameworks
from .rebuilt import RebuiltSource

if TYPE_CHECKING:
    from .observation import Observation, StepTrace

WARMUP_STEPS = 2
MIN_TIMED_STEPS = 3
# paired rounds a sampled measurement plans for: a clear effect is called in 3 on a quiet
# machine, a 1.3x one within 6 (`verdict`); each round is every configuration and the
# baseline again
TARGET_ROUNDS = 6
PROFILED_RUN_COST = 2.0  # a run under the memory profiler costs about this many plain runs
PROFILED_STEPS = 2  # profiled runs (peak memory, FLOPs) stop after this many steps


class StepLimitReached(BaseException):
    """Ends a measuring run at its stop step. A BaseException, like KeyboardInterrupt, so a
    cell's own `except Exception:` lets it through; only the runner catches it."""


@dataclass
class StepSource:
    """What one step of the cell is, identified so that objects a fix rebuilds still count:
    a rebuilt loader shares the dataset, a rebuilt optimizer the parameters, a compiled
    model wraps the module."""

    unit: str  # "batch" | "optimizer step" | "forward" | "iteration"
    label: str  # as the user names it: `train_loader`, `opt`, `model`, `for i in range(n)`
    # dataset (batch), first parameter (optimizer step), module (forward), loop key (iteration)
    key: Any
    line: int | None = None  # the cell line the steps are issued from
    # Objects the checked code builds on every run (a script's `main()` makes its dataset,
    # model and optimizer anew): a new object of the probe's type whose step is issued from
    # one of the probe's `lines` in the code's own files is the same step source
    rebuilt: RebuiltSource | None = None

    def matches(self, obj: Any) -> bool:
        """Whether a loader iterator / optimizer / module / loop key belongs to this source."""
        if self.unit == "iteration":
            return obj == self.key
        if self.unit == "batch":
            found = getattr(obj, "_dataset", None)
        elif self.unit == "optimizer step":
            found = obj
            if first_parameter(obj) is self.key:
                return True
        else:
            found = obj
            if getattr(obj, "_orig_mod", None) is self.key:
                return True
        if found is self.key:
            return True
        return self.rebuilt is not None and self.rebuilt.matches(found)

    @property
    def loop_keys(self) -> frozenset[str]:
        """The loops a run must report iterations of for these steps to be counted (the
        cell compiled with `cell/loops`' hook in them); none for the other units."""
        return frozenset({self.key}) if self.unit == "iteration" else frozenset()


def first_parameter(optimizer: Any) -> torch.Tensor | None:
    groups = getattr(optimizer, "param_groups", None) or []
    params = groups[0].get("params", []) if groups else []
    return params[0] if params else None


@dataclass
class StepTimes:
    """What one counted run saw: steps done, and seconds from the run's start to the
    boundary after step W (`lead_s`) and after step K (`stop_s`)."""

    started: float = field(default_factory=time.perf_counter)
    count: int = 0
    lead_s: float | None = None
    stop_s: float | None = None
    # the first epoch end after step W: steps done then, and seconds from the run's start;
    # `turns`: the epoch ends between step W and the stop
    turn_count: int | None = None
    turn_s: float | None = None
    turns: int = 0
    gave_up: bool = False  # stopped at a step boundary before `give_up_at`, short of the stop
    # perf_counter time of the last step boundary (the run's start before the first): the
    # step just done foretells whether the next one ends before the deadline
    boundary_at: float | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_s is not None

    def per_step(self, warmup: int, per_epoch: int | None = None) -> float | None:
        """Mean seconds per timed step (steps W+1 … K). With `per_epoch` (batches in one of
        the complete run's epochs) and an epoch end inside the timed steps, the cell's mean
        per step with each epoch's restart counted once per epoch (`restart`)."""
        if self.lead_s is None or self.stop_s is None or self.count <= warmup:
            return None
        split = self._split(warmup) if per_epoch else None
        if split is not None:
            steady, restart = split
            return steady + restart / per_epoch  # type: ignore[operator]
        return (self.stop_s - self.lead_s) / (self.count - warmup)

    def restart(self, warmup: int) -> float | None:
        """Seconds an epoch restart cost beyond a steady step, where the timed steps held
        one or more: the steps before the first epoch end give the steady time per step;
        what the steps after it took beyond that is the restarts' (the loop's end-of-epoch
        code, a new iterator, workers refilling)."""
        split = self._split(warmup)
        return split[1] if split is not None else None

    def _split(self, warmup: int) -> tuple[float, float] | None:
        """(steady seconds per step, restart seconds), or None without an epoch end
        between the warm-up and the stop."""
        turn, turn_s, lead_s, stop_s = self.turn_count, self.turn_s, self.lead_s, self.stop_s
        if turn is None or turn_s is None or lead_s is None or stop_s is None:
            return None
        if not warmup < turn < self.count:
            return None
        steady = (turn_s - lead_s) / (turn - warmup)
        return steady, ((stop_s - turn_s) - (self.count - turn) * steady) / self.turns


class StepCounter:
    """Counts one source's steps during a run: notes the time at the boundary after step
    `warmup`, raises StepLimitReached at the boundary after step `stop` (None: never), or
    at the first boundary where another step as long as the one just done would end past
    `give_up_at` (the budget's deadline: `gave_up`; the wait promised is kept, not overrun
    by a step), and calls `on_step(count)` after each step (progress of the cell's complete
    run).

    With `epoch_end` (batch unit), the loader's epoch running at that step ends after it:
    the iterator's sampler is cut there, so the loader ends the epoch as it ends any epoch
    (prefetched batches handed out, workers idle), and the cell's own loop goes on to its
    next epoch within the timed steps. Only the first such epoch of a run is cut.

    Boundaries: a batch's step ends when the next batch is asked for; an optimizer step's
    when `step()` returns; a forward's when the next top-level forward starts; a loop
    iteration's when the next one begins (the run must execute the cell with that loop
    instrumented: `StepSource.loop_keys`). The hooks run outside compiled code (a
    DataLoader iterator, Optimizer.step, the outer module call, the cell's own loop), so a
    compiled model or function still counts."""

    def __init__(
        self,
        source: StepSource,
        *,
        warmup: int | None = None,
        stop: int | None = None,
        epoch_end: int | None = None,
        on_step: Callable[[int], None] | None = None,
        give_up_at: float | None = None,
    ):
        self.source = source
        self.warmup = warmup
        self.stop = stop
        self.epoch_end = epoch_end
        self.on_step = on_step
        self.give_up_at = give_up_at  # a perf_counter time: a run still going then stops
        self.times = StepTimes()

    @contextlib.contextmanager
    def counting(self) -> Iterator[StepTimes]:
        self.times = StepTimes()
        patcher = Patcher()
        handles: list[Any] = []
        stack = contextlib.ExitStack()
        try:
            if self.source.unit == "batch":
                original = _BaseDataLoaderIter.__next__
                patcher.setattr(_BaseDataLoaderIter, "__next__", self._counted_next(original))
            elif self.source.unit == "optimizer step":
                from torch.optim.optimizer import register_optimizer_step_post_hook

                handles.append(register_optimizer_step_post_hook(self._after_optimizer_step))
            elif self.source.unit == "iteration":
                stack.enter_context(loops.listening(self._before_iteration))
            else:
                from torch.nn.modules.module import register_module_forward_pre_hook

                handles.append(register_module_forward_pre_hook(self._before_forward))
            yield self.times
        finally:
            stack.close()
            for handle in handles:
                handle.remove()
            patcher.undo()

    def _boundary(self) -> None:
        """The boundary after step `times.count`: mark, stop, or go on."""
        times = self.times
        if times.stopped:  # the cell caught our stop and went on: stop it again
            raise StepLimitReached
        if self.warmup is not None and times.count == self.warmup and times.lead_s is None:
            synchronize()
            times.lead_s = time.perf_counter() - times.started
        if self.stop is not None and times.count >= self.stop:
            synchronize()
            times.stop_s = time.perf_counter() - times.started
            raise StepLimitReached
        now = time.perf_counter()
        last, times.boundary_at = times.boundary_at or times.started, now
        if self.give_up_at is not None and lockstep.any_rank(now + (now - last) > self.give_up_at):
            times.gave_up = True  # the next step would end past the deadline: not finished
            raise StepLimitReached

    def _stepped(self) -> None:
        self.times.count += 1
        if self.on_step is not None:
            self.on_step(self.times.count)

    def _counted_next(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def counted_next(iterator: Any) -> Any:
            if not self.source.matches(iterator):
                return original(iterator)
            self._boundary()
            self._cut_epoch(iterator)
            try:
                batch = original(iterator)
            except StopIteration:  # ends an epoch: not a step
                self._epoch_ended()
                raise
            self._stepped()
            return batch

        return counted_next

    def _cut_epoch(self, iterator: Any) -> None:
        """At an epoch's first batch, before `epoch_end`: let the epoch yield no batch past
        step `epoch_end` (indices a worker loader already sent ahead still arrive)."""
        times, end = self.times, self.epoch_end
        if end is None or times.turn_s is not None or times.count >= end:
            return
        sampler_iter = getattr(iterator, "_sampler_iter", None)
        if getattr(iterator, "_num_yielded", None) != 0 or sampler_iter is None:
            return
        if isinstance(sampler_iter, itertools.islice):  # cut already (an epoch's retry)
            return
        sent = getattr(iterator, "_send_idx", 0)  # a worker loader's prefetched indices
        iterator._sampler_iter = itertools.islice(sampler_iter, max(0, end - times.count - sent))

    def _epoch_ended(self) -> None:
        """Note the first epoch end after the warm-up steps (see `StepTimes.per_step`)."""
        times = self.times
        if self.warmup is None or times.count <= self.warmup or times.stopped:
            return
        times.turns += 1
        if times.turn_s is None:
            synchronize()
            times.turn_s = time.perf_counter() - times.started
            times.turn_count = times.count

    def _after_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        if self.source.matches(optimizer):
            self._stepped()
            self._boundary()

    def _before_forward(self, module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling() or not self.source.matches(module):
            return
        self._boundary()
        self._stepped()

    def _before_iteration(self, key: str) -> None:
        if self.source.matches(key):
            self._boundary()
            self._stepped()


# how many steps one complete run has ------------------------------------------------------


@dataclass
class StepCount:
    """Steps in one complete run of the cell, or None with the reason it is not known."""

    total: int | None
    detail: str


def _int_value(node: ast.expr, namespace: dict[str, Any]) -> int | None:
    """The value of a small integer expression in the cell: literals, names, attributes and
    + - * // of them, `len(x)` (never calls anything else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        value = _object_value(node, namespace)
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_value(node.operand, namespace)
        return -inner if inner is not None else None
    if isinstance(node, ast.BinOp) and isinstance(
        node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)
    ):
        left, right = _int_value(node.left, namespace), _int_value(node.right, namespace)
        if left is None or right is None or (isinstance(node.op, ast.FloorDiv) and not right):
            return None
        ops: dict[type, Callable[[int, int], int]] = {
            ast.Add: lambda a, b: a + b,
            ast.Sub: lambda a, b: a - b,
            ast.Mult: lambda a, b: a * b,
            ast.FloorDiv: lambda a, b: a // b,
        }
        return ops[type(node.op)](left, right)
    if _is_call_of(node, "len") and len(node.args) == 1:
        return _sized_length(_object_value(node.args[0], namespace))
    return None


def _object_value(node: ast.expr, namespace: dict[str, Any]) -> Any:
    """A name or attribute chain looked up in the namespace (no calls), else None."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _object_value(node.value, namespace)
        try:
            return getattr(owner, node.attr, None) if owner is not None else None
        except Exception:  # a property that raises
            return None
    return None


def _is_call_of(node: ast.expr, name: str) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute) and func.attr == name
    )


def _sized_length(value: Any) -> int | None:
    try:
        length = len(value)
    except Exception:  # unsized, or an IterableDataset's loader
        return None
    return length if isinstance(length, int) else None


# wrappers that iterate their first argument as many times as it has items
_PASS_THROUGH = ("enumerate", "tqdm", "iter", "list", "tuple")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _trips(node: ast.expr, namespace: dict[str, Any]) -> tuple[int | None, Any]:
    """How many times a `for` over `node` runs, and the object it iterates (if a name)."""
    if _is_call_of(node, "range") and 1 <= len(node.args) <= 3:  # type: ignore[attr-defined]
        values = [_int_value(arg, namespace) for arg in node.args]  # type: ignore[attr-defined]
        if any(v is None for v in values) or (len(values) == 3 and values[2] == 0):
            return None, None
        return len(range(*values)), None  # type: ignore[arg-type]
    if isinstance(node, ast.Call) and node.args and _is_call_of(node, "zip"):
        lengths = [_trips(arg, namespace)[0] for arg in node.args]
        known = [n for n in lengths if n is not None]
        return (min(known) if known and len(known) == len(lengths) else None), None
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name in _PASS_THROUGH:
            return _trips(node.args[0], namespace)
        return None, None
    value = _object_value(node, namespace)
    return _sized_length(value), value


def _enclosing_loops(tree: ast.Module, line: int) -> list[ast.For | ast.While]:
    """The loops of the cell's own code (not of functions it defines) whose span holds
    `line`, outermost first."""
    loops: list[ast.For | ast.While] = []
    node: ast.AST = tree
    while True:
        inner = next(
            (
                child
                for child in ast.iter_child_nodes(node)
                if isinstance(child, ast.stmt)
                and not isinstance(child, _SCOPES)
                and child.lineno <= line <= (child.end_lineno or child.lineno)
            ),
            None,
        )
        if inner is None:
            return loops
        if isinstance(inner, (ast.For, ast.While)):
            loops.append(inner)
        node = inner


def loop_total(
    tree: ast.Module,
    line: int | None,
    namespace: dict[str, Any],
    *,
    per_pass: int | None = None,
    iterated: Any = None,
) -> tuple[int | None, list[str]]:
    """Times the cell's loops around `line` run it, times `per_pass` (steps each time the
    line runs, e.g. batches per epoch when the line iterates a loader), and the parts of
    that product as text. A loop over `iterated` itself counts as `per_pass`, not again.
    A loop that can `break` counts the iterations that run before it does (`_broken_at`)."""
    if line is None:
        return None, ["the line that issues the steps is not in the cell"]
    total = 1
    parts: list[str] = []
    for loop in _enclosing_loops(tree, line):
        if isinstance(loop, ast.While):
            return None, [f"a while loop at cell line {loop.lineno} (its trip count is unknown)"]
        trips, value = _trips(loop.iter, namespace)
        own = iterated is not None and value is iterated  # the loop over the loader itself
        if own:
            trips = per_pass
        if trips is None:
            text = ast.unparse(loop.iter)
            return None, [f"`for … in {text}` at cell line {loop.lineno} has no known length"]
        broken, why = _broken_at(loop, trips, namespace)
        if why is not None:
            return None, [why]
        if own:
            per_pass = broken
            continue
        total *= broken
        ended = f", ended by the break at cell line {_break_line(loop)}" if broken < trips else ""
        parts.append(f"{broken} x `{ast.unparse(loop.iter)}` (cell line {loop.lineno}{ended})")
    if per_pass is not None:
        total *= per_pass
    return total, parts


def _own_breaks(loop: ast.For | ast.While) -> list[ast.Break]:
    """The `break` statements that end this loop (not a nested loop, not a function)."""
    found: list[ast.Break] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Break):
                found.append(child)
            elif not isinstance(child, (*_SCOPES, ast.For, ast.AsyncFor, ast.While)):
                visit(child)

    for statement in loop.body:
        visit(statement) if not isinstance(statement, ast.Break) else found.append(statement)
    return found


def _break_line(loop: ast.For | ast.While) -> int | None:
    breaks = _own_breaks(loop)
    return breaks[0].lineno if breaks else None


def _broken_at(loop: ast.For, trips: int, namespace: dict[str, Any]) -> tuple[int, str | None]:
    """The iterations of a `for` loop of `trips` that run, its `break`s counted: each
    `if <index> <op> <int>: break` in its body (`for i in range(...)`, or the index of
    `for i, x in enumerate(...)`) ends it at the first index that meets the condition, and
    that iteration runs (the step counted at its start). A `break` on anything else makes
    the count unknown: (trips, why)."""
    breaks = _own_breaks(loop)
    if not breaks:
        return trips, None
    values = _index_values(loop, trips, namespace)
    ended = trips
    for statement in _break_ifs(loop.body):
        first = None if values is None else _first_meeting(statement.test, values, loop, namespace)
        if first is None:
            return trips, (
                f"the `break` at cell line {statement.body[0].lineno} can end "
                f"`{loops.header_of(loop)}` (cell line {loop.lineno}) early"
            )
        ended = min(ended, first + 1)
    if len(breaks) > len(list(_break_ifs(loop.body))):
        line = next(b.lineno for b in breaks)
        return trips, (
            f"the `break` at cell line {line} can end `{loops.header_of(loop)}` "
            f"(cell line {loop.lineno}) early"
        )
    return ended, None


def _break_ifs(body: list[ast.stmt]) -> list[ast.If]:
    """`if <test>: break` statements directly in a loop's body."""
    return [
        statement
        for statement in body
        if isinstance(statement, ast.If)
        and not statement.orelse
        and len(statement.body) == 1
        and isinstance(statement.body[0], ast.Break)
    ]


def _index_values(loop: ast.For, trips: int, namespace: dict[str, Any]) -> range | None:
    """The values the loop's index takes: `range(...)` itself, or `enumerate`'s count."""
    if isinstance(loop.target, ast.Name) and _is_call_of(loop.iter, "range"):
        values = [_int_value(arg, namespace) for arg in loop.iter.args]  # type: ignore[attr-defined]
        if all(v is not None for v in values) and values:
            return range(*values)  # type: ignore[arg-type]
    if (
        isinstance(loop.target, ast.Tuple)
        and loop.target.elts
        and isinstance(loop.target.elts[0], ast.Name)
        and _is_call_of(loop.iter, "enumerate")
    ):
        call: ast.Call = loop.iter  # type: ignore[assignment]
        start_node = (
            call.args[1]
            if len(call.args) > 1
            else next((k.value for k in call.keywords if k.arg == "start"), None)
        )
        start = 0 if start_node is None else _int_value(start_node, namespace)
        return range(start, start + trips) if start is not None else None
    return None


def _index_name(loop: ast.For) -> str | None:
    target = loop.target
    if isinstance(target, ast.Tuple) and target.elts:
        target = target.elts[0]
    return target.id if isinstance(target, ast.Name) else None


_COMPARE: dict[type, Callable[[int, int], bool]] = {
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Eq: lambda a, b: a == b,
}


def _first_meeting(
    test: ast.expr, values: range, loop: ast.For, namespace: dict[str, Any]
) -> int | None:
    """The first position in `values` where `index <op> bound` holds (either side), or
    `len(values)` when it never does; None for any other condition."""
    name = _index_name(loop)
    if (
        name is None
        or not isinstance(test, ast.Compare)
        or len(test.ops) != 1
        or type(test.ops[0]) not in _COMPARE
    ):
        return None
    left, right = test.left, test.comparators[0]
    compare = _COMPARE[type(test.ops[0])]
    if isinstance(left, ast.Name) and left.id == name:
        bound = _int_value(right, namespace)
        holds = None if bound is None else (lambda v: compare(v, bound))
    elif isinstance(right, ast.Name) and right.id == name:
        bound = _int_value(left, namespace)
        holds = None if bound is None else (lambda v: compare(bound, v))
    else:
        return None
    if holds is None:
        return None
    if isinstance(test.ops[0], ast.Eq):
        return values.index(bound) if bound in values else len(values)
    # a comparison with a bound is monotonic along a range: find where it starts to hold
    if not values or holds(values[0]):
        return 0
    if not holds(values[-1]):
        return len(values)
    return bisect.bisect_left(range(len(values)), True, key=lambda k: holds(values[k]))


# how long to sample ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplePlan:
    """Every measuring run stops after step `stop`, steps 1 … `warmup` untimed, at least
    `min_timed` steps timed."""

    source: StepSource
    warmup: int
    stop: int
    min_timed: int = MIN_TIMED_STEPS
    # a cell of several epochs, each longer than the timed steps (`restarts_epochs`): the
    # batches in one of the complete run's epochs, and the timed steps to leave after the
    # epoch end for a restart to be seen whole (a worker loader's prefetch depth, >= 3)
    per_epoch: int | None = None
    settle: int = MIN_TIMED_STEPS

    @property
    def timed(self) -> int:
        return self.stop - self.warmup

    @property
    def epoch_end(self) -> int | None:
        """The step after which every run's epoch ends, so that timed steps fewer than an
        epoch's still hold one epoch restart: MIN_TIMED_STEPS timed steps before it,
        `settle` after it. None where no epochs restart, or the timed steps span an epoch
        (they hold its natural end)."""
        if self.per_epoch is None or self.timed > self.per_epoch:
            return None
        end = self.warmup + max(MIN_TIMED_STEPS, self.timed - self.settle)
        return end if self.warmup < end < self.stop else None


def batches_per_epoch(trace: StepTrace) -> int | None:
    """Batches in one epoch of a batch-unit step source: as the probe saw an epoch end,
    else the loader's length (None for other units, or an unsized loader)."""
    if trace.unit != "batch":
        return None
    return trace.epoch_lengths[0] if trace.epoch_lengths else _sized_length(trace.obj)


def has_epochs(per_epoch: int | None, total: int | None) -> bool:
    """Whether a complete run restarts its loader: more batches than one epoch holds."""
    return per_epoch is not None and total is not None and total > per_epoch


def prefetch_depth(workers: int, prefetch_factor: int | None) -> int:
    """Batches a loader with `workers` has in flight when an epoch starts, and hands out in
    a burst: workers x prefetch factor (torch's default factor is 2)."""
    return workers * (prefetch_factor or 2) if workers else 0


def warmup_for(total: int | None, prefetch_depth: int = 0) -> int:
    """W: WARMUP_STEPS, or the prefetch depth of a loader with workers when deeper (1 where
    the run has no room for two warm-up steps and MIN_TIMED_STEPS after them)."""
    if total is not None and total < WARMUP_STEPS + MIN_TIMED_STEPS + 1:
        return 1
    return max(WARMUP_STEPS, prefetch_depth)


def worth_sampling(run_s: float, configurations: int, budget_s: float) -> bool:
    """Whether whole-cell runs (a warm-up, TARGET_ROUNDS timed and a profiled checking run
    per configuration) would overrun the budget."""
    runs = configurations * (1 + PROFILED_RUN_COST) + (configurations + 1) * TARGET_ROUNDS
    return runs * run_s > budget_s


def profiled_runs_s(configurations: int, lead_s: float, step_s: float, warmup: int) -> float:
    """What the profiled runs (memory for each configuration, FLOPs once) will take: each
    stops after PROFILED_STEPS steps and runs PROFILED_RUN_COST times slower."""
    setup_s = max(0.0, lead_s - warmup * step_s)
    return (configurations + 1) * PROFILED_RUN_COST * (setup_s + PROFILED_STEPS * step_s)


def choose_stop(
    budget_s: float,
    configurations: int,
    lead_s: float,
    step_s: float,
    warmup: int,
    total: int | None,
    min_timed: int = MIN_TIMED_STEPS,
) -> int:
    """K: the most steps per run for which TARGET_ROUNDS rounds of every configuration fit
    `budget_s` (what is left for timed runs), between W + `min_timed` and the last step."""
    per_run = budget_s / ((configurations + 1) * TARGET_ROUNDS)
    timed = math.floor((per_run - lead_s) / step_s) if step_s > 0 else min_timed
    stop = warmup + max(min_timed, timed)
    if total is not None:
        stop = min(stop, total - 1)
    return max(stop, warmup + 1)


# from the probe's observation -------------------------------------------------------------


def source_of(obs: Observation, trace: StepTrace) -> StepSource:
    """The step source for the probe's leading trace, keyed to survive rebuilt objects and
    named as the user names the object."""
    obj = trace.obj
    line = min(trace.lines) if trace.lines else None
    entry = obs.found.get(id(obj))
    label = entry.name if entry is not None else type(obj).__name__
    if trace.unit == "iteration":
        return StepSource("iteration", obj.describe(), obj.key, obj.line)
    stepped = obj.dataset if trace.unit == "batch" else obj
    workload = obs.workload
    # only for objects the code built itself: one bound before it is the same every run
    built_here = not obs.lasting_locations(trace.obj) and not obs.lasting_locations(stepped)
    rebuilt = None
    if trace.lines and built_here:
        rebuilt = RebuiltSource.of(stepped, workload, trace.lines)
    if trace.unit == "batch":
        return StepSource("batch", label, obj.dataset, line, rebuilt)
    if trace.unit == "optimizer step":
        return StepSource("optimizer step", label, first_parameter(obj), line, rebuilt)
    return StepSource("forward", label, obj, line, rebuilt)


def count_steps(obs: Observation, trace: StepTrace) -> StepCount:
    """Steps in one complete run: counted when the probe ran the whole cell, else worked
    out from the framework's settings or the cell's loops (None when neither tells)."""
    namespace = obs.workload.namespace
    if not obs.stopped_early:
        return StepCount(trace.count, f"{_epochs_text(trace)}counted in the probe's complete run")
    line = min(trace.lines) if trace.lines else None
    if trace.unit == "batch":
        known = frameworks.total_batches(namespace, trace.obj)
        if known is not None:
            return StepCount(known[0], f"{known[1]} = {known[0]} steps")
        per_epoch = trace.epoch_lengths[0] if trace.epoch_lengths else _sized_length(trace.obj)
        if per_epoch is None:
            return StepCount(None, "the loader has no length and no epoch ended in the probe")
        how = "seen in the probe" if trace.epoch_lengths else "len of the loader"
        total, parts = loop_total(obs.tree, line, namespace, per_pass=per_epoch, iterated=trace.obj)
        if total is None:
            return StepCount(None, f"not known before the complete run: {parts[0]}")
        epochs = total // per_epoch
        loops = f" ({'; '.join(parts)})" if parts else ""
        return StepCount(
            total,
            f"{epochs} epoch{'s' if epochs != 1 else ''} x {per_epoch} batches ({how}) = "
            f"{total} steps{loops}",
        )
    total, parts = loop_total(obs.tree, line, namespace)
    if total is None:
        return StepCount(None, f"not known before the complete run: {parts[0]}")
    return StepCount(total, f"{total} steps ({'; '.join(parts) or 'no loop in the cell'})")


def _epochs_text(trace: StepTrace) -> str:
    lengths = trace.epoch_lengths
    if trace.unit != "batch" or len(lengths) < 2:
        return ""
    if len(set(lengths)) == 1:
        return f"{len(lengths)} epochs x {lengths[0]} batches = {trace.count} steps, "
    return f"{len(lengths)} epochs, {trace.count} batches, "
