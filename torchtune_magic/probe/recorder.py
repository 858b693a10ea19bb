"""The probe's hooks: what each module forward, optimizer step, backward, loader batch and
host sync does to the `Observation` while the cell runs.

Kept apart from the Observation so no hook state leaks into the result, and from the run
(`probe`) that installs them and takes them out again.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ..cell import loops
from ..distributed import lockstep
from . import graphs
from .observation import (
    CallSite,
    HostCopy,
    LoaderUse,
    ModuleUse,
    Observation,
    Scope,
    StepTrace,
    SyncedForwards,
)
from .steps import StepLimitReached

SPAN_MARK = "perfcheck::mark#"
MAX_SHAPES = 8  # distinct input shapes remembered per module
PROBE_MIN_STEPS = 3  # a probe stopped early has seen at least this many steps (zeroed grads
# show from the second backward on, a loader's wait needs a few batches)
# Our profiler stops once the cell's step has ended this many (or after `profile_for_s`):
# op shares need a few dozen steps, and every profiled op is paid for when the profiler
# stops and its events are read back (a raw-tensor loop of ~2 ms steps profiled for 1.5 s,
# ~330 steps: 8.4 s of the 9 s probe; 50 steps: about a sixth of that)
PROFILED_STEPS_MOST = 50


class Recorder:
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
        trace.step_ended(ended, elapsed)
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
