"""Page faults from the C allocator: freed tensor memory handed back to the OS every step.

Guide, CPU part: "Switch Memory allocator" (jemalloc or tcmalloc through LD_PRELOAD). Under
glibc's malloc a loop that frees and re-allocates large tensors (activations, gradients set
to None) can unmap or trim that memory and fault it in again, zero-filled, on the next
step: 1.7x on an MLP training cell here (`engine/allocator.py`). glibc's thresholds can be
raised at run time (`mallopt`): that is the live fix; jemalloc/tcmalloc is the advice.

Evidence, and why it is re-measured. The probe counts the process's minor page faults over
its run (getrusage). The profiler it runs under adds few faults of its own (5 over 200 steps
of a small model here) but doubles the run's time, and a fault may be a one-off first touch
of memory the cell keeps rather than churn. So a cell whose probe faults could cost a real
share of its time is re-measured without instrumentation: steady-state steps of the main
model (forward + backward for a training cell, `proxy.py`), counting the faults each step
takes after warm-up. Their cost is that count times the per-fault cost measured on this
machine. A cell without a model call keeps the probe's figures, said so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine import allocator
from ..engine.fixes import Fix, Patcher
from ..report import CodeChange
from . import proxy
from .base import Check, Detection

if TYPE_CHECKING:
    from ..engine.probe import Observation

# Faults costing this share of a step are worth a fix: the MLP above spent ~45% of its step
# on them; a few % is within a shared machine's noise.
FAULT_SHARE = 0.10
# The probe runs about twice as long as a plain run, so its share is halved before the
# re-measurement decides.
PROBE_SHARE = FAULT_SHARE / 2
STEADY_BUDGET_S = 1.0
STEADY_STEPS = 5
WARMUP_STEPS = 2


@dataclass
class Steady:
    """Faults per step of the proxy after warm-up, and its fastest step, uninstrumented."""

    faults: float
    seconds: float


def steady_faults(step_proxy: proxy.Proxy) -> Steady:
    """Faults are counted over every step (they recur or they do not); the time is the
    fastest step's, so another busy process on the machine does not shrink their share."""
    with step_proxy.ready() as step:
        for _ in range(WARMUP_STEPS):  # the first steps grow the heap: one-off faults
            step()
        times: list[float] = []
        before = allocator.minor_faults()
        deadline = time.perf_counter() + STEADY_BUDGET_S
        while len(times) < STEADY_STEPS and (not times or time.perf_counter() < deadline):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return Steady((allocator.minor_faults() - before) / len(times), min(times))


class AllocatorFix(Fix):
    """glibc's mmap and trim thresholds raised with `mallopt`, for the process. glibc cannot
    report the values it had: undo sets what the process started with (the environment's
    `MALLOC_*_`, else glibc's documented defaults)."""

    check_id = "cpu-allocator"
    sets_allocator = True

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        # the restore is registered first, so a threshold glibc refuses half-way is put back
        patcher.call(lambda: None, allocator.restore_thresholds)
        allocator.set_thresholds(allocator.FIX_THRESHOLDS)


def _size(value: int) -> str:
    return f"{value >> 20} MiB" if value >= allocator.MIB else f"{value >> 10} KiB"


def _undo_caveat() -> str:
    start = allocator.starting_thresholds()
    values = ", ".join(f"{allocator.NAMES[k]} {_size(v)}" for k, v in start.items())
    if start != allocator.DEFAULTS:
        return f"undo sets the thresholds the kernel started with ({values}), as before"
    return (
        "glibc cannot report its current thresholds and, once they are set, stops adjusting "
        f"them itself: undo sets its documented defaults ({values}), fixed until the kernel "
        "restarts, so a kernel whose glibc had raised them on its own may fault more after "
        "undo than before"
    )


class AllocatorCheck(Check):
    id = "cpu-allocator"
    title = "Freed tensor memory goes back to the OS and is faulted in again every step"
    guide = "Switch Memory allocator"
    devices = ("cpu",)
    threshold = (
        f"minor page faults costing ≥ {FAULT_SHARE:.0%} of a step, re-measured without "
        "instrumentation (an MLP freeing 4 MiB gradients: ~45%, 1.7x with the fix)"
    )

    def not_applicable(self, obs: Observation) -> str | None:
        reason = super().not_applicable(obs)
        if reason is None and obs.minor_faults is None:
            return "not applicable here: the OS does not report page faults (getrusage)"
        return reason

    def detect(self, obs: Observation) -> list[Detection]:
        faults = obs.minor_faults or 0
        if not faults or not obs.wall_s:
            return []
        cost = allocator.fault_cost_s()
        probe_share = min(1.0, faults * cost / obs.wall_s)
        if probe_share < PROBE_SHARE:
            return []
        evidence = (
            f"the probe saw {faults:,} minor page faults in {obs.wall_s:.2f} s, ≈ "
            f"{faults * cost:.2f} s at {cost * 1e6:.1f} µs per fault measured here "
            f"({probe_share:.0%} of the instrumented run)"
        )
        step_proxy = proxy.main_model(obs)
        if step_proxy is None:
            evidence += "; no model call to re-measure without instrumentation"
        else:
            steady = steady_faults(step_proxy)
            # an estimate (the per-fault cost is measured apart): never more than the step
            spent = min(steady.faults * cost, steady.seconds)
            share = spent / steady.seconds
            if share < FAULT_SHARE:
                return []
            evidence += (
                f"; re-measured without instrumentation on {step_proxy.describe()}: "
                f"{steady.faults:,.0f} faults per step, ≈ {spent * 1e3:.1f} ms of its "
                f"{steady.seconds * 1e3:.1f} ms ({share:.0%})"
            )
        return [self._detection(evidence)]

    def _detection(self, evidence: str) -> Detection:
        blocked = None
        other = allocator.preloaded()
        if other is not None:
            blocked = f"{other} replaces glibc's malloc here, and mallopt does not reach it"
        elif allocator.glibc_version() is None:
            blocked = "this process does not run on glibc, whose mallopt is the live fix"
        fix = None if blocked else AllocatorFix()
        values = allocator.FIX_THRESHOLDS
        if fix is not None:
            evidence += (
                f"; glibc {allocator.glibc_version()}: the fix raises M_MMAP_THRESHOLD to "
                f"{_size(values[allocator.M_MMAP_THRESHOLD])} and M_TRIM_THRESHOLD to "
                f"{_size(values[allocator.M_TRIM_THRESHOLD])} (mallopt)"
            )
        else:
            evidence += f"; not applied live: {blocked}"
        calls = "; ".join(f"libc.mallopt({option}, {value})" for option, value in values.items())
        names = ", ".join(allocator.NAMES[option] for option in values)
        elsewhere = [
            "for every run, start the kernel with jemalloc or tcmalloc, as the guide says: "
            f"{allocator.preload_command('jemalloc')} or {allocator.preload_command('tcmalloc')}",
            f"or keep glibc with its thresholds raised: {allocator.environment_command(values)}",
            "or in the notebook's first cell: import ctypes; libc = ctypes.CDLL(None); "
            f"{calls}  # {names}",
        ]
        return Detection(
            self.finding(
                evidence=evidence,
                where="the C allocator (glibc malloc, process-wide)",
                fixable=fix is not None,
                caveat=(
                    f"freed memory up to {_size(values[allocator.M_TRIM_THRESHOLD])} stays with "
                    "the kernel instead of going back to the OS (its resident memory grows by "
                    f"up to that much); {_undo_caveat()}"
                ),
                code_change=CodeChange("", elsewhere),
            ),
            fix,
        )
