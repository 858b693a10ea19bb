"""One instrumented run of the cell, recording what it really did.

Global module hooks, an optimizer step hook, wrappers around backward / zero_grad /
DataLoader iteration / gradcheck / profiler entry points, and (where it cannot clash with
the user's own profiler) the torch profiler for the op stream and CPU peak memory. Every
hook and patch is removed when the run ends, also on error and Ctrl-C.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..cell import loops
from ..cell.workload import CellError, Workload, synchronize
from ..distributed import lockstep
from ..kernel import allocator, discovery
from ..kernel.fixes import Patcher
from . import graphs, load, memory
from .memory import OpEvent
from .steps import StepLimitReached

SPAN_MARK = "perfcheck::mark#"
MAX_SHAPES = 8  # distinct input shapes remembered per module
# Tensor methods that make the host wait for the tensor's value (a device sync on CUDA)
SYNC_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "__bool__",
    "__float__",
    "__int__",
    "__format__",
    "__repr__",
)
PROFILER_NAMES = frozenset({"profile", "profiler", "emit_nvtx", "emit_itt", "record_function"})
PROBE_MIN_STEPS = 3  # a probe stopped early has seen at least this many steps (zeroed grads
# show from the second backward on, a loader's wait needs a few batches)
# Our profiler stops once the cell's step has ended this many (or after `profile_for_s`):
# op shares need a few dozen steps, and every profiled op is paid for when the profiler
# stops and its events are read back (a raw-tensor loop of ~2 ms steps profiled for 1.5 s,
# ~330 steps: 8.4 s of the 9 s probe; 50 steps: about a sixth of that)
PROFILED_STEPS_MOST = 50
# in order of preference as the step; an "iteration" is one of the cell's own loops
# (`cell/loops`), for cells with no loader, optimizer or module to mark their steps
STEP_UNITS = ("batch", "optimizer step", "forward", "iteration")


@dataclass
class SyncedForwards:
    """A DistributedDataParallel model's forwards with autograd recording, by optimizer
    step: whether each would all-reduce its gradients in the backward that follows (DDP
    decides at forward time, from `require_backward_grad_sync`, which `no_sync()` clears)."""

    module: torch.nn.Module
    steps: list[list[bool]] = field(default_factory=list)  # closed by an optimizer step
    open: list[bool] = field(default_factory=list)  # since the last optimizer step
    lines: set[int] = field(default_factory=set)
    # For each synced backward seen to its end, the names of the trainable parameters that
    # got no gradient in it (what `find_unused_parameters=True` searches the graph for)
    unused: list[frozenset[str]] = field(default_factory=list)
    graded: set[str] = field(default_factory=set)  # given a gradient since the last forward
    awaiting: bool = False  # the last forward synced: its backward may be under way
    # Seconds the synced backward passes ran on after this rank's last gradient was ready:
    # the all-reduce not hidden behind the backward, and the wait for slower ranks in it
    tail_s: float = 0.0
    last_gradient_at: float | None = None

    def step_ended(self) -> None:
        if self.open:
            self.steps.append(self.open)
            self.open = []

    def forward(self, syncs: bool) -> None:
        """A forward with autograd recording: the previous one's backward has ended."""
        self.close_backward()
        self.open.append(syncs)
        self.awaiting = syncs

    def gradient_ready(self, name: str) -> None:
        self.graded.add(name)
        self.last_gradient_at = time.perf_counter()

    def backward_returned(self) -> None:
        """The cell's backward call returned: after a synced one, DDP's all-reduce is done."""
        if self.awaiting and self.last_gradient_at is not None:
            self.tail_s += time.perf_counter() - self.last_gradient_at
        self.last_gradient_at = None

    def close_backward(self) -> None:
        """Record which parameters the last synced forward's backward left without a
        gradient (none given at all: no backward ran, nothing to record)."""
        if self.awaiting and self.graded:
            trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
            self.unused.append(frozenset(trainable - self.graded))
        self.graded.clear()
        self.awaiting = False


@dataclass
class RankWork:
    """Where one rank's probe run went, gathered from every rank under torchrun: what a
    rank waiting for another looks like (a long tail after its own gradients) and where a
    slow rank's time went (its DataLoader)."""

    rank: int
    wall_s: float
    collective_s: float  # after its last gradient, in synced backward passes (all-reduce)
    loader_s: float  # waiting for the DataLoader's batches
    steps: int  # synced backward passes seen whole

    @property
    def working_s(self) -> float:
        """The run without the all-reduce tails: this rank's own work."""
        return self.wall_s - self.collective_s


@dataclass
class ModuleUse:
    """How one module was called during the run."""

    module: torch.nn.Module
    calls: int = 0
    grad_calls: int = 0  # calls with autograd recording (grad enabled, not inference mode)
    outer_calls: int = 0  # calls not nested inside another module's forward
    lines: set[int] = field(default_factory=set)
    input_nchw_4d: int = 0  # outer calls given a 4-D contiguous (NCHW) tensor
    input_shape: tuple[int, ...] | None = None  # first tensor argument of the first call
    input_shapes: set[tuple[int, ...]] = field(default_factory=set)  # distinct, up to 8
    autocast_calls: int = 0  # calls made with autocast on for the module's device


@dataclass
class LoaderUse:
    """A DataLoader the cell iterated, and how long it waited for batches."""

    loader: DataLoader
    batches: int = 0
    wait_s: float = 0.0
    lines: set[int] = field(default_factory=set)
    built_in_cell: bool = False  # constructed during the run (so each run makes a new one)
    built_line: int | None = None  # the cell line that constructed it, if built in the cell
    device_copies: int = 0  # batch tensors copied host -> CUDA device
    non_blocking_copies: int = 0
    copy_lines: set[int] = field(default_factory=set)


@dataclass
class StepTrace:
    """How often one candidate for the cell's step (a loader, an optimizer, a top-level
    module) ended a step in the probe, and when (seconds from the start of the run)."""

    unit: str  # one of STEP_UNITS
    obj: Any  # the DataLoader, optimizer, module or loop (`loops.Loop`)
    count: int = 0
    first_s: float | None = None  # end of the first step
    last_s: float | None = None  # end of the latest step
    lines: set[int] = field(default_factory=set)  # cell lines the steps were issued from
    epoch_lengths: list[int] = field(default_factory=list)  # batch unit: completed epochs

    def mean_step_s(self) -> float | None:
        """Seconds per step after the first (instrumented, so an upper bound)."""
        if self.count < 2 or self.first_s is None or self.last_s is None:
            return None
        return (self.last_s - self.first_s) / (self.count - 1)


@dataclass
class CallSite:
    """A call of interest (zero_grad, gradcheck, a profiler) and where it came from."""

    kind: str
    line: int | None
    owner: Any = None
    seconds: float = 0.0
    detail: Any = None


@dataclass
class HostCopy:
    """A host-to-CUDA tensor copy (`.to(device)` / `.cuda()`) and where it came from."""

    line: int | None
    pinned: bool
    non_blocking: bool
    from_loader: bool
    nbytes: int


@dataclass
class Scope:
    """A span in which a module's forward or a user function ran, on the profiler's clock
    (µs), so a check can tell which code issued the ops inside it."""

    kind: str  # "module" | "function"
    obj: Any  # the module, or the function's code object
    start_us: float
    end_us: float


@dataclass
class Observation:
    """Everything the probe saw; checks read this and the cell AST, nothing else."""

    workload: Workload
    wall_s: float = 0.0
    modules: dict[int, ModuleUse] = field(default_factory=dict)
    edges: dict[tuple[int, int], int] = field(default_factory=dict)  # producer -> consumer
    backward_calls: int = 0
    backward_with_anomaly: int = 0
    forward_with_anomaly: int = 0
    anomaly_at_start: bool = False
    anomaly_at_end: bool = False
    profiler_at_start: bool = False
    forward_under_profiler: int = 0
    profiler_entries: list[CallSite] = field(default_factory=list)
    gradcheck_calls: list[CallSite] = field(default_factory=list)
    zero_grad_calls: list[CallSite] = field(default_factory=list)
    backward_lines: set[int] = field(default_factory=set)
    zeroed_grad_backwards: int = 0  # backward passes preceded by all-zero tensor grads
    zeroed_grad_params: int = 0
    optimizer_steps: dict[int, tuple[torch.optim.Optimizer, int]] = field(default_factory=dict)
    loaders: dict[int, LoaderUse] = field(default_factory=dict)
    ddp_forwards: dict[int, SyncedForwards] = field(default_factory=dict)  # by module id
    rank_work: list[RankWork] | None = None  # every rank's, by rank (under torchrun)
    host_copies: list[HostCopy] = field(default_factory=list)
    # reads of tensor values by the host from the cell's own code (.item(), print(t), …);
    # kind = the call, detail = the tensor's device type
    host_syncs: list[CallSite] = field(default_factory=list)
    ops: list[OpEvent] | None = None
    op_totals: dict[str, tuple[int, float]] = field(default_factory=dict)  # name: (count, µs)
    scopes: list[Scope] = field(default_factory=list)  # recorded only when ops are
    memory_asked: bool = False  # the user asked about memory (--memory)
    out_of_memory: bool = False  # the cell ran out of memory in this run
    peak_memory: memory.Peak | None = None
    found: dict[int, discovery.Found] = field(default_factory=dict)
    preexisting: set[int] = field(default_factory=set)  # ids in `found` before the cell ran
    names_before: frozenset[str] = frozenset()  # namespace names bound before the cell ran
    device: str = "cpu"
    # minor page faults of this process during the probe run (None where the OS does not
    # report them): the allocator handing memory back to the OS and faulting it in again
    minor_faults: int | None = None
    # CPU time other processes took on this process's CPUs during the run (None off Linux)
    load: load.Load | None = None
    # candidates for the cell's step, by (unit, id of the object)
    step_traces: dict[tuple[str, int], StepTrace] = field(default_factory=dict)
    stopped_early: bool = False  # the probe stopped itself at a step boundary (a long cell)
    # top-level forwards that built a graph, by (module, cell line, user functions issuing them)
    graph_sites: dict[tuple[Any, ...], graphs.GraphSite] = field(default_factory=dict)
    # the seconds the checks' own trials (worker counts, thread counts, plain runs) may take
    # in all, counted from when the first one starts: they come out of the measuring budget
    trials_s: float | None = None
    _trials_started: float | None = None

    # seconds of the run the op stream covers (our profiler stops after a few seconds of a
    # long cell's steps): op shares are shares of this, not of wall_s
    profiled_s: float = 0.0
    # what profiling cost: the steps it covered, and the seconds they took with stopping
    # the profiler and reading its events back (what a profiled measuring run will cost)
    profiled_steps: int = 0
    profiling_cost_s: float = 0.0

    def profiled_step_s(self) -> float | None:
        """Seconds a step of the cell costs under our profiler, events read back included."""
        if not self.profiled_steps or not self.profiling_cost_s:
            return None
        return self.profiling_cost_s / self.profiled_steps

    def profiled_text(self, seconds: Callable[[float], str]) -> str:
        """`the cell's 412.0 ms`, or `the run's first 1500.0 ms (profiled)` where our
        profiler stopped before the probe did."""
        if self.profiled_s and self.profiled_s < self.wall_s:
            return f"the run's first {seconds(self.profiled_s)} (profiled)"
        return f"the cell's {seconds(self.wall_s)}"

    def trial_time(self, wanted_s: float) -> float:
        """The seconds a check's trial may take: what it wants, or what is left of the
        checks' share of the budget when that is less."""
        if self.trials_s is None:
            return wanted_s
        now = time.perf_counter()
        if self._trials_started is None:
            self._trials_started = now
        return max(0.0, min(wanted_s, self.trials_s - (now - self._trials_started)))

    def leading_step(self) -> StepTrace | None:
        """The cell's step: batches of the loader that gave the most, else the optimizer
        that stepped most, else the module with the most top-level forwards, else an
        iteration of the cell's own loop (`_leading_loop`); at least two of them, the
        first seen wins a tie."""
        for unit in STEP_UNITS:
            if unit == "iteration":
                loop = self._leading_loop()
                return loop if loop is not None and loop.count >= 2 else None
            traces = [t for t in self.step_traces.values() if t.unit == unit and t.count >= 2]
            if traces:
                return max(traces, key=lambda t: t.count)
        return None

    def _leading_loop(self) -> StepTrace | None:
        """Of the cell's loops, the one whose iterations are its steps: the innermost loop
        around the lines that called backward (one training step an iteration), however few
        iterations it has ended yet (a loop inside it, over the parameters, has ended more
        by then), else the loop that iterated most (in a nest, the inner one). The lines
        where the cell's own code calls `.backward()` count before any backward has run:
        a probe stopped early in the first iteration, in the loop over the parameters that
        comes before the backward, must not take that loop for the step."""
        traces = [t for t in self.step_traces.values() if t.unit == "iteration"]
        backward = self.backward_lines | loops.backward_call_lines(self.workload.tree)
        training = [t for t in traces if any(t.obj.encloses(line) for line in backward)]
        if training:
            return max(training, key=lambda t: t.obj.depth)
        return max(traces, key=lambda t: t.count, default=None)

    @property
    def tree(self) -> ast.Module:
        return self.workload.tree

    def lasting_locations(self, obj: Any) -> list[discovery.Location]:
        """Where `obj` is reachable from names bound before the cell ran: the places a fix
        can rebind it. (Paths through objects the cell builds, such as a Trainer holding
        the loader, are rebuilt by every run and gone when the start state is restored.)"""
        entry = self.found.get(id(obj))
        if entry is None:
            return []
        return [loc for loc in entry.locations if loc.steps[0].key in self.names_before]

    def places_of(self, *objs: Any) -> list[tuple[discovery.Location, Any]]:
        """Where the probe saw these objects, or the models holding them when they are
        submodules, from names bound before the cell: a fix that changes them checks, when
        applied, that each place still holds what it held (`Fix.seen`), so it never
        changes an object the user has replaced since."""
        wanted = {id(obj) for obj in objs}
        places = []
        for entry in self.found.values():
            held = id(entry.obj) in wanted or (
                isinstance(entry.obj, torch.nn.Module)
                and any(id(sub) in wanted for sub in entry.obj.modules())
            )
            if held:
                places.extend((loc, entry.obj) for loc in self.lasting_locations(entry.obj))
        return places

    def module_path(self, module: torch.nn.Module) -> str:
        """`model.layer1.0.conv1` for a submodule, the namespace path for a top-level one."""
        for entry in discovery.top_level_modules(self.found):
            for name, sub in entry.obj.named_modules():
                if sub is module:
                    return f"{entry.name}.{name}" if name else entry.name
        return type(module).__name__

    def own_work(self, rank: int) -> RankWork:
        """This rank's part of `rank_work`, from its own probe run."""
        return RankWork(
            rank,
            self.wall_s,
            sum(synced.tail_s for synced in self.ddp_forwards.values()),
            sum(use.wait_s for use in self.loaders.values()),
            sum(len(synced.unused) for synced in self.ddp_forwards.values()),
        )

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for opt, _ in self.optimizer_steps.values()]


class _Recorder:
    """The hooks. Kept apart from Observation so no hook state leaks into the result."""

    def __init__(self, obs: Observation):
        self.obs = obs
        self.depth = 0
        self.producers: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.iterators: dict[int, DataLoader] = {}
        self.built_loaders: dict[int, int | None] = {}  # id -> cell line, built during the run
        self.batch_tensors: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.watched_params: dict[int, torch.Tensor] = {}
        self.grad_hooks: list[Any] = []  # on DDP models' parameters (`watch_gradients`)
        self.sync_depth = 0  # inside a recorded host sync (print(t) calls t.item() …)
        self.own_profiler = False  # our profiler is on: `_profiler_enabled()` is no evidence
        # spans as pairs of marker numbers; the markers' profiler times become Scope times
        self.marks = 0
        self.module_starts: dict[int, list[int]] = {}
        self.function_starts: dict[Any, int] = {}
        self.spans: list[tuple[str, Any, int, int]] = []
        self.started = time.perf_counter()
        self.stop_after_s: float | None = None  # stop at a step boundary after this long
        # our profiler stops at a step boundary after this long (its events cost seconds to
        # read back after a long probe; a few seconds of steps tell the op shares): set with
        # the call that stops it
        self.profile_for_s: float | None = None
        self.stop_profiler: Callable[[], None] | None = None
        self.roots = graphs.RootWatcher(obs.workload, obs.graph_sites)
        self.loops = {loop.key: loop for loop in loops.loops_of(obs.workload.tree)}
        self.iterations: dict[str, int] = {}  # iterations begun, by loop key

    # steps --------------------------------------------------------------------------------
    def step_boundary(self, unit: str, obj: Any, ended: int) -> None:
        """`obj` has ended `ended` steps of this unit. Stop the run here if it has gone on
        long enough and this is the cell's step (at a boundary, so the cut is clean)."""
        trace = self.trace(unit, obj)
        elapsed = time.perf_counter() - self.started
        if ended > trace.count:
            trace.count = ended
            trace.first_s = elapsed if trace.first_s is None else trace.first_s
            trace.last_s = elapsed
        if ended < PROBE_MIN_STEPS:
            return
        profile_for_s = self.profile_for_s if self.stop_profiler is not None else None
        if profile_for_s is None and self.stop_after_s is None:
            return
        if self.obs.leading_step() is not trace:
            return
        # under torchrun, the slowest rank's time: every rank stops at the same step
        elapsed = lockstep.slowest(elapsed)
        if profile_for_s is not None and (elapsed >= profile_for_s or ended >= PROFILED_STEPS_MOST):
            self.profiling_done(elapsed, ended)
        if self.stop_after_s is not None and elapsed >= self.stop_after_s:
            self.obs.stopped_early = True
            raise StepLimitReached

    def profiling_done(self, elapsed: float, ended: int) -> None:
        """Stop our profiler (and the function spans it needed): the op stream covers the
        run's first `elapsed` seconds, its first `ended` steps, from here on unprofiled."""
        assert self.stop_profiler is not None
        stopping = time.perf_counter()
        self.stop_profiler()
        self.stop_profiler = None
        self.own_profiler = False
        self.obs.profiled_s = elapsed
        self.obs.profiled_steps = ended
        self.obs.profiling_cost_s = elapsed + time.perf_counter() - stopping
        if sys.getprofile() == self.function_event:
            sys.setprofile(None)

    def trace(self, unit: str, obj: Any) -> StepTrace:
        trace = self.obs.step_traces.get((unit, id(obj)))
        if trace is None:
            trace = self.obs.step_traces[(unit, id(obj))] = StepTrace(unit, obj)
        return trace

    def step_line(self, unit: str, obj: Any) -> None:
        """Note the cell line that issued a step of `obj` (directly or through a call)."""
        line = self.line()
        if line is not None:
            self.trace(unit, obj).lines.add(line)

    def line(self) -> int | None:
        return self.obs.workload.cell_line()

    def loop_iteration(self, key: str) -> None:
        """An iteration of one of the cell's loops begins: the one before it has ended."""
        loop = self.loops.get(key)
        if loop is None:
            return
        begun = self.iterations.get(key, 0)
        self.trace("iteration", loop).lines.add(loop.line)
        self.step_boundary("iteration", loop, begun)
        self.iterations[key] = begun + 1

    # module hooks -------------------------------------------------------------------------
    def ddp_forward(self, module: DistributedDataParallel) -> None:
        synced = self.obs.ddp_forwards.get(id(module))
        if synced is None:
            synced = self.obs.ddp_forwards[id(module)] = SyncedForwards(module)
            self.watch_gradients(synced)
        synced.forward(bool(module.require_backward_grad_sync))
        line = self.line()
        if line is not None:
            synced.lines.add(line)

    def watch_gradients(self, synced: SyncedForwards) -> None:
        """Note each of the DDP model's trainable parameters as its gradient accumulates
        (the hooks go with the probe's others)."""
        for name, param in synced.module.named_parameters():
            if param.requires_grad:
                self.grad_hooks.append(
                    param.register_post_accumulate_grad_hook(
                        lambda _, _name=name: synced.gradient_ready(_name)
                    )
                )

    def forward_pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        use = self.obs.modules.get(id(module))
        if use is None:
            use = self.obs.modules[id(module)] = ModuleUse(module)
        use.calls += 1
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            use.grad_calls += 1
            if isinstance(module, DistributedDataParallel):
                self.ddp_forward(module)
        if self.depth == 0:
            self.step_boundary("forward", module, use.outer_calls)
            use.outer_calls += 1
            line = self.line()
            if line is not None:
                use.lines.add(line)
            self.step_line("forward", module)
            if any(_is_nchw_4d(a) for a in args):
                use.input_nchw_4d += 1
            for param in module.parameters():
                self.watched_params.setdefault(id(param), param)
        shape = next((tuple(a.shape) for a in args if isinstance(a, torch.Tensor)), None)
        if use.input_shape is None:
            use.input_shape = shape
        if shape is not None and len(use.input_shapes) < MAX_SHAPES:
            use.input_shapes.add(shape)
        if _autocast_on(module):
            use.autocast_calls += 1
        if self.own_profiler:
            self.module_starts.setdefault(id(module), []).append(self.mark())
        if torch.is_anomaly_enabled():
            self.obs.forward_with_anomaly += 1
        if torch.autograd._profiler_enabled() and not self.own_profiler:
            self.obs.forward_under_profiler += 1
        for arg in args:
            if isinstance(arg, torch.Tensor):
                known = self.producers.get(id(arg))
                if known is not None and known[0]() is arg:
                    edge = (known[1], id(module))
                    self.obs.edges[edge] = self.obs.edges.get(edge, 0) + 1
        self.depth += 1

    def forward_post(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        starts = self.module_starts.get(id(module))
        if starts:
            self.spans.append(("module", module, starts.pop(), self.mark()))
        if isinstance(output, torch.Tensor):
            self.producers[id(output)] = (weakref.ref(output), id(module))
        self.roots.forward_done(module, args, output, self.depth)

    def function_event(self, frame: Any, event: str, arg: Any) -> None:
        """sys.setprofile callback: spans of Python functions defined in the user's namespace
        (earlier cells, their classes and closures), not the cell's own top-level code."""
        if frame.f_globals is not self.obs.workload.namespace:
            return
        if frame.f_code.co_name.startswith("<"):
            return
        if event == "call":
            self.function_starts[frame] = self.mark()
        elif event == "return":
            start = self.function_starts.pop(frame, None)
            if start is not None:
                self.spans.append(("function", frame.f_code, start, self.mark()))

    def mark(self) -> int:
        """An empty profiler event in the op stream: spans bounded by these line up with
        the ops exactly (Python's clock and the profiler's drift apart by 100 µs or so)."""
        number = self.marks
        self.marks += 1
        with torch.profiler.record_function(f"{SPAN_MARK}{number}"):
            pass
        return number

    def scopes(self, marks: dict[int, float]) -> list[Scope]:
        return [
            Scope(kind, obj, marks[start], marks[end])
            for kind, obj, start, end in self.spans
            if start in marks and end in marks
        ]

    # wrappers -----------------------------------------------------------------------------
    def backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded_backward(*args: Any, **kwargs: Any) -> Any:
            obs = self.obs
            obs.backward_calls += 1
            if torch.is_anomaly_enabled():
                obs.backward_with_anomaly += 1
            line = self.line()
            if line is not None:
                obs.backward_lines.add(line)
            zeroed = sum(
                1
                for p in self.watched_params.values()
                if p.grad is not None and not p.grad.is_sparse and not bool(p.grad.any())
            )
            if zeroed:
                obs.zeroed_grad_backwards += 1
                obs.zeroed_grad_params = max(obs.zeroed_grad_params, zeroed)
            try:
                return original(*args, **kwargs)
            finally:
                for synced in obs.ddp_forwards.values():
                    synced.backward_returned()

        return recorded_backward

    def zero_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded_zero_grad(owner: Any, set_to_none: bool = True) -> Any:
            self.obs.zero_grad_calls.append(
                CallSite("zero_grad", self.line(), owner, detail=set_to_none)
            )
            return original(owner, set_to_none)

        return recorded_zero_grad

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        _, count = self.obs.optimizer_steps.get(id(optimizer), (optimizer, 0))
        self.obs.optimizer_steps[id(optimizer)] = (optimizer, count + 1)
        for group in optimizer.param_groups:
            for param in group["params"]:
                self.watched_params.setdefault(id(param), param)

    def optimizer_stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Post-step hook: an optimizer step ends a step of that unit."""
        for synced in self.obs.ddp_forwards.values():
            synced.step_ended()
        _, count = self.obs.optimizer_steps[id(optimizer)]
        self.step_line("optimizer step", optimizer)
        self.step_boundary("optimizer step", optimizer, count)

    def loader_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        # wraps: Lightning reads DataLoader.__init__'s signature to rebuild a loader with a
        # DistributedSampler, and must see the original's parameters, not this wrapper's
        @functools.wraps(original)
        def recorded_init(loader: DataLoader, *args: Any, **kwargs: Any) -> None:
            self.built_loaders[id(loader)] = self.line()
            original(loader, *args, **kwargs)

        return recorded_init

    def loader_iter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded_iter(loader: DataLoader) -> Any:
            iterator = original(loader)
            self.iterators[id(iterator)] = loader
            use = self.obs.loaders.get(id(loader))
            if use is None:
                use = self.obs.loaders[id(loader)] = LoaderUse(loader)
                use.built_in_cell = id(loader) in self.built_loaders
                use.built_line = self.built_loaders.get(id(loader))
            line = self.line()
            if line is not None:
                use.lines.add(line)
            self.step_line("batch", loader)
            return iterator

        return recorded_iter

    def loader_next(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded_next(iterator: Any) -> Any:
            loader = self.iterators.get(id(iterator))
            if loader is not None:
                use = self.obs.loaders[id(loader)]
                self.step_boundary("batch", loader, use.batches)
            start = time.perf_counter()
            batch: Any = _NO_BATCH
            try:
                batch = original(iterator)
                return batch
            except StopIteration:
                if loader is not None:
                    self.epoch_ended(loader, use.batches)
                raise
            finally:
                if loader is not None:
                    use.wait_s += time.perf_counter() - start
                    if batch is not _NO_BATCH:  # not the StopIteration that ends an epoch
                        use.batches += 1
                        for tensor in _batch_tensors(batch):
                            self.batch_tensors[id(tensor)] = (weakref.ref(tensor), id(loader))

        return recorded_next

    def epoch_ended(self, loader: DataLoader, batches: int) -> None:
        """An iterator of `loader` ran out: note how many batches that epoch had."""
        trace = self.obs.step_traces.get(("batch", id(loader)))
        if trace is not None:
            trace.epoch_lengths.append(batches - sum(trace.epoch_lengths))

    def tensor_copy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Tensor.to / Tensor.cuda: every host-to-CUDA copy (loader batches counted on their
        loader too), and CUDA-to-host copies from the cell's code as host syncs."""

        def recorded_copy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = original(tensor, *args, **kwargs)
            if not isinstance(result, torch.Tensor) or result is tensor:
                return result
            if tensor.is_cuda and not result.is_cuda and self.from_user_code():
                self.obs.host_syncs.append(CallSite("to(cpu)", self.line(), detail="cuda"))
            if not result.is_cuda or tensor.is_cuda:
                return result
            non_blocking = bool(kwargs.get("non_blocking", False))
            line = self.line()
            known = self.batch_tensors.get(id(tensor))
            from_loader = known is not None and known[0]() is tensor
            self.obs.host_copies.append(
                HostCopy(line, tensor.is_pinned(), non_blocking, from_loader, tensor.nbytes)
            )
            if known is not None and from_loader:
                use = self.obs.loaders[known[1]]
                use.device_copies += 1
                use.non_blocking_copies += non_blocking
                if line is not None:
                    use.copy_lines.add(line)
            return result

        return recorded_copy

    def from_user_code(self) -> bool:
        """Whether the caller of our wrapper is the cell or a function defined next to it."""
        frame = sys._getframe(2)
        return frame.f_globals is self.obs.workload.namespace

    def host_sync(self, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """A Tensor method that reads values on the host, counted when the cell's own code
        calls it (not torch internals, not nested inside another such call)."""

        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.sync_depth or not self.from_user_code():
                return original(tensor, *args, **kwargs)
            self.obs.host_syncs.append(CallSite(kind, self.line(), detail=tensor.device.type))
            self.sync_depth += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self.sync_depth -= 1

        return recorded

    def timed_call(self, kind: str, sink: list[CallSite], original: Callable[..., Any]):
        def recorded(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sink.append(CallSite(kind, self.line(), seconds=time.perf_counter() - start))

        return recorded


_NO_BATCH = object()


def _batch_tensors(batch: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """The tensors in a collated batch (tensor, or tuple/list/dict of them, a few deep)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif depth and isinstance(batch, (tuple, list)):
        for item in batch[:64]:
            yield from _batch_tensors(item, depth - 1)
    elif depth and isinstance(batch, dict):
        for item in list(batch.values())[:64]:
            yield from _batch_tensors(item, depth - 1)


def _autocast_on(module: torch.nn.Module) -> bool:
    """Whether autocast is on for the device of the module's parameters."""
    param = next(module.parameters(recurse=False), None)
    device = param.device.type if param is not None else "cuda"
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:  # torch < 2.4 takes no device argument (and means CUDA)
        return device == "cuda" and torch.is_autocast_enabled()


def _is_nchw_4d(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 4
        and value.is_contiguous()
        and not value.is_contiguous(memory_format=torch.channels_last)
    )


def mentions_profiler(tree: ast.Module) -> bool:
    """Whether the cell names a profiler API itself (then the probe must not open its own)."""
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name in PROFILER_NAMES:
            return True
    return False


@contextlib.contextmanager
def _instrumented(recorder: _Recorder, namespace: dict[str, Any]) -> Iterator[None]:
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    patcher = Patcher()
    handles = []
    try:
        handles.append(register_module_forward_pre_hook(recorder.forward_pre))
        # always_call: the depth count comes back down when a forward raises (a checkpoint
        # stopping its recomputation early, a cell caught mid-forward)
        handles.append(register_module_forward_hook(recorder.forward_post, always_call=True))
        handles.append(register_optimizer_step_pre_hook(recorder.optimizer_step))
        handles.append(register_optimizer_step_post_hook(recorder.optimizer_stepped))
        patcher.setattr(torch.autograd, "backward", recorder.backward(torch.autograd.backward))
        for owner in (torch.optim.Optimizer, torch.nn.Module):
            patcher.setattr(owner, "zero_grad", recorder.zero_grad(owner.zero_grad))
        patcher.setattr(DataLoader, "__init__", recorder.loader_init(DataLoader.__init__))
        patcher.setattr(DataLoader, "__iter__", recorder.loader_iter(DataLoader.__iter__))
        for name in ("to", "cuda"):
            patcher.setattr(torch.Tensor, name, recorder.tensor_copy(getattr(torch.Tensor, name)))
        for name in SYNC_METHODS:
            patcher.setattr(
                torch.Tensor, name, recorder.host_sync(name, getattr(torch.Tensor, name))
            )
        patcher.setattr(
            _BaseDataLoaderIter, "__next__", recorder.loader_next(_BaseDataLoaderIter.__next__)
        )
        _patch_gradcheck(patcher, recorder, namespace)
        _patch_profiler_entries(patcher, recorder)
        with _function_spans(recorder), loops.listening(recorder.loop_iteration):
            yield
    finally:
        for handle in handles + recorder.grad_hooks:
            handle.remove()
        for synced in recorder.obs.ddp_forwards.values():
            synced.close_backward()
        recorder.roots.release()
        patcher.undo()


@contextlib.contextmanager
def _function_spans(recorder: _Recorder) -> Iterator[None]:
    """Record user-function spans while our profiler runs, unless a profile function of
    someone else's (cProfile, a debugger) is installed: that one is left alone."""
    if not recorder.own_profiler or sys.getprofile() is not None:
        yield
        return
    sys.setprofile(recorder.function_event)
    try:
        yield
    finally:
        sys.setprofile(None)


def _patch_gradcheck(patcher: Patcher, recorder: _Recorder, namespace: dict[str, Any]) -> None:
    import sys

    module = sys.modules["torch.autograd.gradcheck"]
    for name in ("gradcheck", "gradgradcheck"):
        original = getattr(module, name)
        wrapped = recorder.timed_call(name, recorder.obs.gradcheck_calls, original)
        patcher.setattr(module, name, wrapped)
        patcher.setattr(torch.autograd, name, wrapped)
        patcher.replace_everywhere(namespace, original, wrapped)


def _patch_profiler_entries(patcher: Patcher, recorder: _Recorder) -> None:
    entries = recorder.obs.profiler_entries
    targets = [
        (torch.profiler.profile, "start", "torch.profiler.profile"),
        (torch.autograd.profiler.profile, "__enter__", "torch.autograd.profiler.profile"),
        (torch.autograd.profiler.emit_nvtx, "__enter__", "torch.autograd.profiler.emit_nvtx"),
        (torch.autograd.profiler.emit_itt, "__enter__", "torch.autograd.profiler.emit_itt"),
    ]
    for owner, method, label in targets:
        original = getattr(owner, method)

        def recorded(self: Any, *args: Any, _original=original, _label=label, **kwargs: Any):
            if getattr(self, "enabled", True):
                entries.append(CallSite(_label, recorder.line()))
            return _original(self, *args, **kwargs)

        patcher.setattr(owner, method, recorded)


def _run_until_stopped(workload: Workload, recorder: _Recorder) -> float:
    """Seconds the run took, to its end or to the step boundary where it was stopped."""
    __tracebackhide__ = True
    load_before = load.reading()
    recorder.started = time.perf_counter()
    try:
        return workload.run(loop_keys=loops.EVERY)
    except StepLimitReached:
        synchronize()
        return time.perf_counter() - recorder.started
    except CellError as error:  # what was seen up to the error (say, running out of memory)
        error.observation = recorder.obs
        raise
    finally:
        recorder.obs.load = load.since(load_before)


def run(
    workload: Workload,
    device: str,
    *,
    use_profiler: bool | None = None,
    stop_after_s: float | None = None,
    profile_for_s: float | None = None,
) -> Observation:
    """Run the cell once under instrumentation; with `stop_after_s`, a cell still running
    then stops at its next step boundary (once it has taken PROBE_MIN_STEPS steps) and
    `stopped_early` says so; with `profile_for_s`, our profiler stops likewise after that
    long or PROFILED_STEPS_MOST steps and the hooks go on (`profiled_s`). The user's
    exception propagates as CellError."""
    __tracebackhide__ = True
    obs = Observation(workload, device=device)
    obs.found = discovery.walk(workload.namespace)
    obs.preexisting = set(obs.found)
    obs.names_before = frozenset(workload.namespace)
    obs.anomaly_at_start = torch.is_anomaly_enabled()
    obs.profiler_at_start = bool(torch.autograd._profiler_enabled())
    if use_profiler is None:
        use_profiler = not obs.profiler_at_start and not mentions_profiler(workload.tree)
    recorder = _Recorder(obs)
    recorder.own_profiler = use_profiler
    recorder.stop_after_s = stop_after_s
    recorder.profile_for_s = profile_for_s
    faults_before = allocator.minor_faults()
    # Our profiler starts before the entry points are patched, so it is never mistaken for
    # one of the user's.
    if use_profiler:
        with memory.profiled(device) as profile, _instrumented(recorder, workload.namespace):
            recorder.stop_profiler = profile.stop_early
            obs.wall_s = _run_until_stopped(workload, recorder)
            ran_until = time.perf_counter()
        # stopping the profiler (when it ran to the end) and reading its events back
        obs.profiling_cost_s = (obs.profiling_cost_s or obs.wall_s) + (
            time.perf_counter() - ran_until
        )
        obs.profiled_s = obs.profiled_s or obs.wall_s
        marks = {
            int(op.name[len(SPAN_MARK) :]): op.start_us
            for op in profile.ops
            if op.name.startswith(SPAN_MARK)
        }
        obs.ops = [op for op in profile.ops if not op.name.startswith(SPAN_MARK)]
        obs.op_totals = {
            name: total
            for name, total in profile.op_totals.items()
            if not name.startswith(SPAN_MARK)
        }
        obs.scopes = recorder.scopes(marks)
        obs.peak_memory = profile.peak
    else:
        with memory.tracked(device) as tracker, _instrumented(recorder, workload.namespace):
            obs.wall_s = _run_until_stopped(workload, recorder)
        obs.peak_memory = tracker.peak
    obs.anomaly_at_end = torch.is_anomaly_enabled()
    if not obs.stopped_early:  # a forward's (an iteration's) step ends when the next one
        for trace in obs.step_traces.values():  # starts: the last ended with the run
            if trace.unit == "forward":
                trace.count = obs.modules[id(trace.obj)].outer_calls
            elif trace.unit == "iteration":
                trace.count = recorder.iterations.get(trace.obj.key, 0)
    leading = obs.leading_step()
    if use_profiler and not obs.profiled_steps and leading is not None:
        obs.profiled_steps = leading.count  # the profiler ran to the end of the run
    if allocator.reports_faults():
        obs.minor_faults = allocator.minor_faults() - faults_before
    for key, entry in discovery.walk(workload.namespace).items():
        known = obs.found.get(key)
        if known is None:
            obs.found[key] = entry
        else:
            known.locations.extend(loc for loc in entry.locations if loc not in known.locations)
    return obs
