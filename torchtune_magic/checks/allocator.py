"""Page faults from the C allocator: freed tensor memory handed back to the OS every step.

Guide, CPU part: "Switch Memory allocator" (jemalloc or tcmalloc through LD_PRELOAD). Under
glibc's malloc a loop that frees and re-allocates large tensors (activations, gradients set
to None) can unmap or trim that memory and fault it in again, zero-filled, on the next
step: 1.7x on an MLP training cell here (`kernel/allocator.py`). glibc's thresholds can be
raised at run time (`mallopt`): that is the live fix; jemalloc/tcmalloc is the advice.

Evidence, and why it is re-measured. The probe counts the process's minor page faults over
its run (getrusage), but much of that count is the instrumentation's own: over a 3000-step
raw-tensor training loop (a makemore-style MLP on 32-row batches) the probe saw 440k
faults, on a quiet machine 73% of its 2.4 s run at the per-fault cost measured here, where
a plain run of the cell takes a few dozen and the fix measured 0.96-0.98x (fresh
processes, A/B). So a cell whose probe faults could matter is run again without
instrumentation (`plain_sample`): two plain runs from the state it is in, each stopped
after PLAIN_RUN_S (its first steps, for a longer cell), the state put back after each. The
check fires when the faults of the run that took fewer of them per second cost
FAULT_SHARE of its time at the per-fault cost measured on this machine. Where the cell
cannot be run that way (not in the main thread, no memory for a snapshot, the plain run
raised) it stays silent: the probe's count alone does not show what the cell pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..kernel import allocator
from ..kernel.fixes import Fix, Patcher
from ..probe import plain_sample
from ..report import CodeChange
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import Observation

# Faults costing this share of a plain run are worth a fix. Measured on a 2-core VM (other
# processes keeping ~1.3 CPUs busy; fresh processes, the fix against none, three pairs):
# an MLP training cell freeing 4 MiB gradients each step, its compute varied by the batch,
# gained 1.04x at a 6-20% share, 1.15x at 15-21%, 1.23x at 27-39%, 1.33x at 32-36% and
# 1.68x at 38-64%; the makemore-style loop (0%) 0.98x.
FAULT_SHARE = 0.15
# The probe runs about twice as long as a plain run and counts its instrumentation's faults
# too: below half the share it cannot hide a plain run's share, and no plain run is made.
PROBE_SHARE = FAULT_SHARE / 2
PLAIN_RUNS = 2
PLAIN_RUN_S = 1.0


def _steadiest(samples: list[plain_sample.Sample]) -> plain_sample.Sample:
    """The run that took the fewest faults per second: a first run may pay one-off faults
    (a heap growing back), so a fault counts only when every run pays it."""
    return min(samples, key=lambda sample: sample.faults_per_s)


def _plain_text(sample: plain_sample.Sample, samples: list[plain_sample.Sample]) -> str:
    what = "a plain run of the cell"
    if not sample.whole:
        what = f"the first {sample.seconds:.2f} s of {what}"
    low, high = min(s.faults for s in samples), max(s.faults for s in samples)
    spread = f" ({len(samples)} runs: {low:,}-{high:,})" if len(samples) > 1 else ""
    return f"{what} took {sample.faults:,} faults{spread}"


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
    trial_runs_cell_on_own_clock = True  # the two plain runs (`plain_sample`)
    # the faults' cost is an estimate (count x a per-fault cost measured apart), and how
    # glibc's heap falls changes from one kernel's history to the next: the fix decides
    needs_measured_win = True
    threshold = (
        f"minor page faults costing ≥ {FAULT_SHARE:.0%} of a plain run of the cell (re-run "
        "without instrumentation, its first second at most); 2-core CPU, an MLP freeing 4 MiB "
        "gradients per step: 1.04x with the fix at a 6-20% share, 1.15x at 15-21%, 1.68x at "
        "38-64%"
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
        limit = obs.trial_time(PLAIN_RUNS * PLAIN_RUN_S) / PLAIN_RUNS
        samples = plain_sample.runs(obs.workload, PLAIN_RUNS, limit) if limit > 0 else None
        if not samples:
            return []
        plain = _steadiest(samples)
        # an estimate (the per-fault cost is measured apart): never more than the run
        spent = min(plain.faults * cost, plain.seconds)
        share = spent / plain.seconds if plain.seconds else 0.0
        if share < FAULT_SHARE:
            return []
        evidence = (
            f"minor page faults cost ≈ {share:.0%} of a plain run of the cell "
            f"({spent * 1e3:.0f} ms of {plain.seconds * 1e3:.0f} ms)"
        )
        details = (
            f"{_plain_text(plain, samples)}, at {cost * 1e6:.1f} µs per fault measured here; "
            f"the instrumented probe saw {faults:,} in {obs.wall_s:.2f} s "
            f"({probe_share:.0%}), some of them its own"
        )
        return [self._detection(evidence, details)]

    def _detection(self, evidence: str, details: str) -> Detection:
        blocked = None
        other = allocator.preloaded()
        if other is not None:
            blocked = f"{other} replaces glibc's malloc here, and mallopt does not reach it"
        elif allocator.glibc_version() is None:
            blocked = "this process does not run on glibc, whose mallopt is the live fix"
        fix = None if blocked else AllocatorFix()
        values = allocator.FIX_THRESHOLDS
        if fix is not None:
            details += (
                f"; glibc {allocator.glibc_version()}: the fix raises M_MMAP_THRESHOLD to "
                f"{_size(values[allocator.M_MMAP_THRESHOLD])} and M_TRIM_THRESHOLD to "
                f"{_size(values[allocator.M_TRIM_THRESHOLD])} (mallopt)"
            )
        else:
            details += f"; not applied live: {blocked}"
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
                details=details,  # no segment: memory is taken and freed in every part
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
