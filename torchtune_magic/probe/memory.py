"""Peak memory of one run, with a label saying what the number means on this device.

CUDA: the caching allocator's `max_memory_allocated` above the start. CPU: the most bytes
held at once by tensor blocks allocated during the run, from torch's allocation events as
the profiler records them (`profile_memory=True`) — not RSS, which glibc's caching blurs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

CUDA_LABEL = "peak CUDA tensor memory allocated during the run (torch.cuda.max_memory_allocated)"
CPU_LABEL = "peak CPU tensor memory allocated during the run (torch allocator, via the profiler)"


@dataclass
class OpEvent:
    """A top-level operator from the profiler stream (times in microseconds): read here
    from the profiled run's tree, with its memory events."""

    name: str
    start_us: float
    end_us: float
    self_us: float


@dataclass
class Peak:
    bytes: int | None
    label: str


@dataclass
class Profile:
    """What a profiled run yields: peak memory and the operator stream."""

    peak: Peak | None = None
    peak_cpu: int = 0
    ops: list[OpEvent] = field(default_factory=list)
    op_totals: dict[str, tuple[int, float]] = field(default_factory=dict)
    # stops the profiler before the block ends (what follows runs unprofiled); set while
    # the block runs
    stop_early: Callable[[], None] | None = field(default=None, repr=False)


@dataclass
class Tracker:
    peak: Peak | None = None


@contextlib.contextmanager
def tracked(device: str) -> Iterator[Tracker]:
    """Peak memory without the profiler (CUDA only; CPU reports None, labelled)."""
    tracker = Tracker()
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield tracker
        torch.cuda.synchronize()
        tracker.peak = Peak(max(0, torch.cuda.max_memory_allocated() - start), CUDA_LABEL)
    else:
        yield tracker
        tracker.peak = Peak(None, "not measured: a profiler of the cell's own was running")


@contextlib.contextmanager
def profiled(device: str) -> Iterator[Profile]:
    """Profile the block: operator stream, op totals and peak memory; `stop_early()` on the
    result stops the profiler sooner (the rest of the block runs unprofiled).

    Reads the profiler's raw event tree rather than `prof.events()`, which costs more than
    the run itself on short cells.

    The recorded events are dropped as soon as they are read: `torch.profiler.profile`
    refers to itself (its action map holds its bound methods), so it lives until Python's
    cyclic collector runs, and with it every event of the run in C++ memory. Left to the
    collector, a kernel checking a small MLP training cell grew by 8 MiB per %%perfcheck
    (20 profiled runs: 324 to 480 MiB resident; dropped here: flat at 340 MiB).
    """
    from torch.profiler import ProfilerActivity, profile

    result = Profile()
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    _warm_up_profiler_once()
    prof = profile(activities=activities, profile_memory=True)
    running = [False]

    def stop() -> None:
        if running[0]:
            running[0] = False
            with _native_stderr_silenced():
                prof.stop()

    try:
        with tracked(device) as cuda_tracker:
            with _native_stderr_silenced():
                prof.start()
            running[0] = True
            result.stop_early = stop
            try:
                yield result
            finally:
                stop()
                result.stop_early = None
        _read_tree(prof.profiler.kineto_results.experimental_event_tree(), result)
    finally:
        prof.profiler = None  # the events (see above), whether the block raised or not
    result.peak = cuda_tracker.peak if device == "cuda" else Peak(result.peak_cpu, CPU_LABEL)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Hide what the profiler's C++ side prints on start/stop (ipykernel would forward those
    lines into the user's notebook)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@functools.cache
def _warm_up_profiler_once() -> None:
    """Start the profiler once, silently, on a throwaway run.

    The first profiler start in a process pays the Kineto set-up, and freeing a block that
    was allocated before profiling prints a one-time C++ warning into the cell's output.
    Both happen here instead of inside the user's measured run.
    """
    from torch.profiler import ProfilerActivity, profile

    block = torch.empty(1024)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_stderr_silenced():
        prof.start()
        del block
        prof.stop()


def _read_tree(roots: list, result: Profile) -> None:
    """Top-level ops, self time per op name, and the CPU allocator's peak above its start."""
    from torch._C._profiler import _ExtraFields_Allocation, _ExtraFields_TorchOp

    allocations: list[tuple[int, int, int]] = []  # (time, pointer, bytes: < 0 for a free)

    def op_children(node) -> list:
        return [c for c in node.children if isinstance(c.extra_fields, _ExtraFields_TorchOp)]

    stack = [(node, True) for node in roots]
    while stack:
        node, top = stack.pop()
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            if fields.device.type == "cpu":
                allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size))
            continue
        if not isinstance(fields, _ExtraFields_TorchOp):
            continue
        children = op_children(node)
        self_us = (node.duration_time_ns - sum(c.duration_time_ns for c in children)) / 1e3
        if top:
            result.ops.append(
                OpEvent(node.name, node.start_time_ns / 1e3, node.end_time_ns / 1e3, self_us)
            )
        count, total = result.op_totals.get(node.name, (0, 0.0))
        result.op_totals[node.name] = (count + 1, total + self_us)
        stack.extend((child, False) for child in node.children)
    result.ops.sort(key=lambda op: op.start_us)
    result.peak_cpu = _peak_of_own_blocks(sorted(allocations))


def _peak_of_own_blocks(events: list[tuple[int, int, int]]) -> int:
    """The most bytes held at once by blocks allocated in the window. Frees of blocks from
    before it (an earlier cell's garbage collected meanwhile) do not count: measured against
    the allocator's running total, they had made a run that freed 16 MiB of someone else's
    memory read as a peak of 0."""
    live: dict[int, int] = {}
    held = peak = 0
    for _, ptr, size in events:
        if size > 0:
            live[ptr] = size
            held += size
            peak = max(peak, held)
        elif ptr in live:
            held -= live.pop(ptr)
    return peak
