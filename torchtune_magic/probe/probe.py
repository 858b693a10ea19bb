"""One instrumented run of the cell, recording what it really did.

Global module hooks, an optimizer step hook, wrappers around backward / zero_grad /
DataLoader iteration / gradcheck / profiler entry points, and (where it cannot clash with
the user's own profiler) the torch profiler for the op stream and CPU peak memory. Every
hook and patch is removed when the run ends, also on error and Ctrl-C.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..cell import loops
from ..cell.workload import CellError, Workload, synchronize
from ..kernel import allocator, discovery
from ..kernel.fixes import Patcher
from . import construction, load, memory
from .observation import CallSite, Observation
from .recorder import SPAN_MARK, Recorder
from .steps import StepLimitReached

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


def mentions_profiler(tree: ast.Module) -> bool:
    """Whether the cell names a profiler API itself (then the probe must not open its own)."""
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        if name in PROFILER_NAMES:
            return True
    return False


@contextlib.contextmanager
def _instrumented(recorder: Recorder, namespace: dict[str, Any]) -> Iterator[None]:
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
        with (
            _function_spans(recorder),
            loops.listening(recorder.loop_iteration),
            construction.recording(recorder.obs.workload) as built,
        ):
            recorder.obs.constructed = built.keys  # filled in as the cell builds
            yield
    finally:
        for handle in handles + recorder.grad_hooks:
            handle.remove()
        for synced in recorder.obs.ddp_forwards.values():
            synced.close_backward()
        recorder.roots.release()
        patcher.undo()


@contextlib.contextmanager
def _function_spans(recorder: Recorder) -> Iterator[None]:
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


def _patch_gradcheck(patcher: Patcher, recorder: Recorder, namespace: dict[str, Any]) -> None:
    import sys

    module = sys.modules["torch.autograd.gradcheck"]
    for name in ("gradcheck", "gradgradcheck"):
        original = getattr(module, name)
        wrapped = recorder.timed_call(name, recorder.obs.gradcheck_calls, original)
        patcher.setattr(module, name, wrapped)
        patcher.setattr(torch.autograd, name, wrapped)
        patcher.replace_everywhere(namespace, original, wrapped)


def _patch_profiler_entries(patcher: Patcher, recorder: Recorder) -> None:
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


def _run_until_stopped(workload: Workload, recorder: Recorder) -> float:
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
    recorder = Recorder(obs)
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
