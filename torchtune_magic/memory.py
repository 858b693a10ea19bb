"""Peak memory of one run, with a label saying what the number means on this device.

CUDA: the caching allocator's `max_memory_allocated` above the start. CPU: torch's CPU
allocator totals as the profiler sees them (`profile_memory=True`), i.e. peak tensor memory
allocated during the run above the start — not RSS, which glibc's caching blurs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .probe import OpEvent

CUDA_LABEL = "peak CUDA tensor memory allocated during the run (torch.cuda.max_memory_allocated)"
CPU_LABEL = "peak CPU tensor memory allocated during the run (torch allocator, via the profiler)"


@dataclass
class Peak:
    bytes: int | None
    label: str


@dataclass
class Profile:
    """What a profiled run yields: peak memory and the operator stream."""

    peak: Peak | None = None
    ops: list[OpEvent] = field(default_factory=list)
    op_totals: dict[str, tuple[int, float]] = field(default_factory=dict)


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
    """Profile the block: operator stream, op totals and peak memory."""
    from torch.profiler import ProfilerActivity, profile

    from .probe import OpEvent

    result = Profile()
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities, profile_memory=True)
    with tracked(device) as cuda_tracker, profiler as prof:
        yield result
    events = prof.events()
    result.ops = [
        OpEvent(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total)
        for e in events
        if e.cpu_parent is None and e.name != "[memory]"
    ]
    for e in events:
        if e.name == "[memory]":
            continue
        count, total = result.op_totals.get(e.name, (0, 0.0))
        result.op_totals[e.name] = (count + 1, total + e.self_cpu_time_total)
    if device == "cuda":
        result.peak = cuda_tracker.peak
    else:
        result.peak = Peak(_cpu_peak_bytes(prof), CPU_LABEL)


def _cpu_peak_bytes(prof: torch.profiler.profile) -> int:
    """Highest CPU allocator total seen during the profile, above the total at its start."""
    from torch._C._profiler import _ExtraFields_Allocation

    points: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
            points.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
        stack.extend(node.children)
    if not points:
        return 0
    points.sort()
    start_total = points[0][1] - points[0][2]
    return max(0, max(total for _, total, _ in points) - start_total)
