"""What the probe saw: the `Observation` of one instrumented run, every check's input.

Kept apart from the run that fills it (`probe`, `recorder`) so the step maths (`steps`),
the checks and measuring read it without importing the instrumentation.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..cell import loops
from ..cell.workload import Workload
from ..distributed import lockstep
from ..kernel import discovery
from . import construction, graphs, memory
from .memory import OpEvent

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

    def step_ended(self, ended: int, elapsed: float) -> None:
        """`ended` steps have ended, `elapsed` seconds into the run."""
        if ended <= self.count:
            return
        self.count = ended
        self.first_s = elapsed if self.first_s is None else self.first_s
        self.last_s = elapsed


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
    # modules the checked code built in the run, by id: where and in which order
    # (`probe/construction`), so a fix can reach the same ones in every measuring run
    constructed: dict[int, construction.Key] = field(default_factory=dict)
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

    def built_by_cell(self, module: torch.nn.Module) -> bool:
        """True when no model that existed before the cell contains `module`: the checked
        code made it, so every run makes a new one, which only a fix at construction
        reaches (`construction.AtConstruction`)."""
        return not any(
            key in self.preexisting
            and isinstance(entry.obj, torch.nn.Module)
            and any(sub is module for sub in entry.obj.modules())
            for key, entry in self.found.items()
        )

    def first_called(self, objects: list[Any]) -> Any:
        """Of the modules the cell called from outside any other module, the outermost one
        it built that holds all `objects` (its first call comes before any of theirs: a fix
        at construction applies there); else the first object itself."""
        holders = [
            use.module
            for use in self.modules.values()
            if use.outer_calls
            and id(use.module) in self.constructed
            and all(any(sub is obj for sub in use.module.modules()) for obj in objects)
        ]
        if holders:
            return max(holders, key=lambda module: sum(1 for _ in module.modules()))
        return objects[0]

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

    def uses_cuda(self) -> bool:
        """The cell's models live on a CUDA device (the first parameter found says)."""
        for use in self.modules.values():
            for tensor in use.module.parameters():
                return tensor.is_cuda
        return False

    def agreed_across_ranks(self, rank: int, trace: StepTrace | None) -> None:
        """Under torchrun: every rank's work in the probe (for rank-imbalance and the rank
        table), and the probe's times as its slowest rank took them (the figures the
        measuring plan and the first runs' guesses are made from)."""
        self.rank_work = lockstep.gathered(self.own_work(rank))
        first_s, last_s = (trace.first_s, trace.last_s) if trace is not None else (None, None)
        wall_s, first_s, last_s = lockstep.slowest_of([self.wall_s, first_s, last_s])
        self.wall_s = wall_s if wall_s is not None else self.wall_s
        if trace is not None:
            trace.first_s, trace.last_s = first_s, last_s
