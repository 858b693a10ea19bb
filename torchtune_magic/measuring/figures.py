"""Figures derived from measuring runs: statistics, speedups, one-time costs, projections,
throughput, the allocator's drift, and the machine they were taken on. Functions over run
results that set a variant's fields or return what to say; none runs the cell."""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import sys
from typing import TYPE_CHECKING, Any

import torch

from ..kernel import allocator, fixes
from ..probe import memory, steps
from ..probe.observation import Observation, StepTrace
from ..report import Sampling, Stats, Variant
from . import timing, utilisation
from .plan import BASELINE, Sampled
from .verdict import Speedup

if TYPE_CHECKING:
    from .run import Config, RunTime

# page faults the baseline's runs did not all pay, worth more than this share of a run:
# the allocator's state changed under the measurement (said in the report) — and worth at
# least ALLOCATOR_DRIFT_FLOOR_S: on a run of a few ms, 5 % is a few dozen faults, which a
# busy machine's scheduling moves as much as the allocator does
ALLOCATOR_DRIFT_SHARE = 0.05
ALLOCATOR_DRIFT_FLOOR_S = 1e-3


def fill(variant: Variant, measurement: timing.Measurement) -> None:
    """A variant's timing statistics from its measurement so far."""
    variant.median_s, variant.iqr_s = measurement.median, measurement.iqr
    variant.runs, variant.noisy = measurement.runs, measurement.noisy


def set_speedup(variant: Variant, base: Variant, speedup: Speedup | None) -> None:
    """The speedup over paired rounds with its interval and verdict, the baseline median it
    stands against, and the runs its one-time cost takes to pay back."""
    if variant.error or speedup is None or not variant.median_s or not base.median_s:
        return
    variant.speedup = speedup.median
    variant.speedup_low, variant.speedup_high = speedup.low, speedup.high
    variant.verdict, variant.rounds = speedup.verdict, speedup.rounds
    variant.baseline_median_s = base.median_s
    saved = base.median_s - variant.median_s
    if variant.one_time_s and saved > 0:
        variant.break_even_runs = math.ceil(variant.one_time_s / saved)


def stats(
    baseline: Variant, flops: utilisation.FlopCount | None, flops_detail: str | None
) -> Stats:
    return Stats(
        baseline.median_s,
        baseline.iqr_s,
        baseline.runs,
        baseline.peak_memory_bytes,
        baseline.noisy,
        flops=baseline.flops,
        flops_breakdown=dict(flops.buckets) if flops else None,
        flops_detail=flops_detail,
        achieved_tflops=baseline.achieved_tflops,
        utilisation=baseline.utilisation,
        peak_tflops=baseline.peak_tflops,
        projected_cell_s=baseline.projected_cell_s,
        measured_at=baseline.measured_at,
    )


def set_one_time_costs(
    configs: list[Config],
    results: dict[str, Variant],
    firsts: dict[str, RunTime],
    timed: dict[str, timing.Measurement],
    later: dict[str, list[RunTime]],
    sampled: bool,
    first_costs: dict[str, float],
) -> None:
    """First-run cost of fixes that can have one, beyond the baseline's own first run
    (sampled: the first run's time to the end of its warm-up steps against the steady
    runs' time to that point), with its cause. A set of fixes costs at least what its
    fixes cost when each first ran alone (`first_costs`, kept for the session): applied
    fresh, a user pays those again, even though this measurement reused their cached
    artifacts."""

    def extra(label: str) -> float | None:
        first = firsts.get(label)
        if first is None or label not in timed:
            return None
        leads = [run.lead_s for run in later.get(label, []) if run.lead_s is not None]
        if sampled and first.lead_s is not None and leads:
            return timing.one_time_cost(first.lead_s, statistics.median(leads))
        return timing.one_time_cost(first.total_s, timed[label].median)

    base_extra = extra(BASELINE) or 0.0
    for config in configs[1:]:
        causes = sorted({f.one_time_cause for f in config.fixes if f.one_time_cause})
        if not causes:
            continue
        measured = extra(config.label)
        net = measured - base_extra if measured is not None else 0.0
        if len(config.fixes) == 1 and net > 0:
            first_costs.setdefault(config.fixes[0].check_id, net)
        known = sum(first_costs.get(f.check_id, 0.0) for f in config.fixes)
        cost = max(net, known)
        if cost > 0:
            variant = results[config.label]
            variant.one_time_s, variant.one_time_cause = cost, ", ".join(causes)


def set_projections(
    results: dict[str, Variant],
    firsts: dict[str, RunTime],
    later: dict[str, list[RunTime]],
    sampled: Sampled | None,
    total: int | None,
    shares: dict[str, float] | None = None,
) -> None:
    """Sampled: the whole cell as one run of it would take (the first run's time to the
    end of its warm-up steps, one-time costs included, then every later step; `shares`:
    the share of the cell's steps a configuration's fixes leave, a DistributedSampler's
    1/N of each epoch). Where
    the per-step times count epoch restarts (one per epoch's batches), a restart's
    median over the runs sets the count right: the steps after W hold every epoch's
    start but the first, which is in the time to W. (Each run times one restart, a
    single event: on a busy machine one worker start can take twice another.)"""
    if sampled is None or total is None:
        return
    remaining = max(0, total - sampled.warmup)
    for label, variant in results.items():
        first = firsts.get(label)
        if first is None or first.lead_s is None or variant.median_s is None:
            continue
        share = (shares or {}).get(label, 1.0)
        projected = first.lead_s + remaining * share * variant.median_s
        runs = [first, *later.get(label, [])]
        restarts = [r.restart_s for r in runs if r.restart_s is not None]
        if sampled.per_epoch and restarts:
            due = max(0, math.ceil(total / sampled.per_epoch) - 1)
            projected += (due - remaining / sampled.per_epoch) * statistics.median(restarts)
        variant.projected_cell_s = projected


def add_throughput(
    configs: list[Config],
    results: dict[str, Variant],
    flops: utilisation.FlopCount | None,
    device: str,
) -> None:
    """Achieved TFLOP/s and share of peak for every measured configuration."""
    if flops is None:
        return
    peaks, _ = utilisation.peaks_for(device, device_name(device))
    for config in configs:
        variant = results[config.label]
        if variant.error:
            continue
        got = utilisation.throughput(
            flops, variant.median_s, peaks, config.ids, _amp_dtype(config.fixes)
        )
        variant.flops = flops.total
        variant.achieved_tflops = got.achieved_tflops
        variant.utilisation = got.utilisation
        variant.peak_tflops = got.peak_tflops


def own_time(baseline_runs: list[RunTime]) -> float | None:
    """This rank's median baseline time (per step when sampled) over the runs after the
    first, which pays one-time costs (all of them when there is one)."""
    own = [run.own_s for run in baseline_runs[1:] or baseline_runs if run.own_s is not None]
    return statistics.median(own) if own else None


def allocator_drift(configs: list[Config], runs: list[RunTime]) -> str | None:
    """What to say when page faults moved the baseline's times by more than
    ALLOCATOR_DRIFT_SHARE of a run (and more than ALLOCATOR_DRIFT_FLOOR_S). Either its
    first timed run paid for faults the later ones did not — glibc raises its mmap
    threshold when a mapped block is freed, so a kernel's first runs of the cell are
    slower than the runs measured here — or its runs faulted unevenly: where a cell's
    large tensors fall on glibc's heap decides whether their memory goes back to the OS
    and is faulted in again, and a cell freeing 16 MiB activations was seen to take
    4k-90k faults a run (113-217 ms) in a plain Python loop, with nothing else running.
    Then its time, and any speedup, moves that much from run to run in a kernel too. Not
    said when a measured fix set the thresholds itself (cpu-allocator): the change would
    be ours, and that finding's caveat says what its undo leaves."""
    if len(runs) < 3 or any(fix.sets_allocator for c in configs for fix in c.fixes):
        return None
    first, later = runs[0], runs[1:]
    run_s = statistics.median(run.total_s for run in later)
    fault_s = allocator.fault_cost_s()
    if run_s <= 0:
        return None
    least_s = max(ALLOCATOR_DRIFT_SHARE * run_s, ALLOCATOR_DRIFT_FLOOR_S)
    most = max(run.faults for run in later)
    if (first.faults - most) * fault_s >= least_s:
        steady = statistics.median(run.faults for run in later)
        return (
            f"glibc's allocator changed state while measuring: the baseline's first timed "
            f"run took {first.faults:,} page faults, the later ones {steady:,.0f} "
            f"(≈{(first.faults - steady) * fault_s * 1e3:.1f} ms on top of a "
            f"{run_s * 1e3:.0f} ms run); glibc raises its mmap threshold as large blocks "
            "are freed, so this cell's first runs in a kernel can be slower than this "
            "baseline (cpu-allocator measures fixing that)"
        )
    low, high = min(run.faults for run in runs), max(run.faults for run in runs)
    if (high - low) * fault_s >= least_s:
        return (
            f"glibc's allocator served this cell unevenly: its runs took {low:,} to "
            f"{high:,} page faults (≈{(high - low) * fault_s * 1e3:.1f} ms apart, of a "
            f"{run_s * 1e3:.0f} ms run); where its large tensors fall on glibc's heap "
            "decides whether their memory goes back to the OS and is faulted in again, so "
            "its time varies that much from run to run in a kernel too, with a fix or "
            f"without, and the speedups are medians over {len(runs)} runs of the baseline "
            "(cpu-allocator measures fixing that)"
        )
    return None


def sampling(
    sample: steps.SamplePlan | None,
    trace: StepTrace | None,
    count: steps.StepCount | None,
    obs: Observation,
) -> Sampling | None:
    """How the runs were sampled, for the report (None when whole runs were timed)."""
    if sample is None or trace is None:
        return None
    return Sampling(
        unit=sample.source.unit,
        steps_per_run=count.total if count else None,
        steps_detail=count.detail if count else "",
        warmup_steps=sample.warmup,
        steps_timed=sample.timed,
        probe_steps=trace.count,
        probe_complete=not obs.stopped_early,
        epoch_end_step=sample.epoch_end,
        steps_per_epoch=sample.per_epoch,
    )


def seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.1f} s"


def error_text(error: BaseException) -> str:
    original = getattr(error, "original", error)
    return f"{type(original).__name__}: {original}"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def environment(device: str, memory_label: str | None) -> dict[str, Any]:
    """Facts a reader needs to judge the numbers."""
    name = device_name(device)
    peaks, source = utilisation.peaks_for(device, name)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "device_name": name,
        "cpu_count": os.cpu_count() or 1,
        "torch_threads": torch.get_num_threads(),
        "memory_measure": memory_label
        or (memory.CUDA_LABEL if device == "cuda" else memory.CPU_LABEL),
        "peak_tflops": peaks,
        "peak_tflops_source": source,
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else _cpu_name()


def _amp_dtype(applied: list[fixes.Fix]) -> str | None:
    """The lower precision an autocast fix in `applied` runs matmuls in, if any."""
    for fix in applied:
        dtype = getattr(fix, "compute_dtype", None)
        if dtype is not None:
            return str(dtype).removeprefix("torch.")
    return None


def _cpu_name() -> str:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                for line in cpuinfo:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return platform.processor() or platform.machine() or "CPU"
