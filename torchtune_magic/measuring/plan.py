"""The measuring plan: what one measurement runs, where every run stops and how its budget
is shared out, as one plain value made in one place (`make`).

Plain data only (no live objects, no callables), so it can be handed to another process as
it is. The step source a sampled run counts is the probe's own (each process has its own):
`Sampled.plan` joins the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..distributed import lockstep
from ..options import Options
from ..probe import steps
from ..report import NO_CHANGE_BAND
from . import timing

if TYPE_CHECKING:
    from ..checks import Detection
    from ..probe.observation import Observation, StepTrace

BASELINE = "baseline"  # the configuration with no fix: what every fix is measured against
# The instrumented probe runs about this much slower than the plain cell (2.16x measured by
# benchmarks/engine_overhead.py): used to guess a plain run's length before timing one.
PROBE_SLOWDOWN = 2.0
# The probe of a long cell stops at a step boundary once it has run this share of the
# budget (within these bounds): long enough for every check's evidence, short enough that
# findings are on screen within seconds. It comes before the budget (the promise: the wait
# is the probe, the budget and the cell's complete run), and a small share of it: for a
# long cell the probe's run is repeated whole at the end. Counting it in the budget left a
# small budget on a busy machine nothing to measure with (a 13.7x win read "no clear
# change" after three rounds of `--budget 2`).
PROBE_SHARE_OF_BUDGET = 0.15
PROBE_SECONDS = (2.0, 8.0)
TRIALS_SHARE = 0.25  # of the budget, for the checks' own trials together
# The budget as a promise (`timing.Deadline`): how a measurement shares out what is left
COMBINED_SHARE_OF_ROUNDS = 0.35  # kept for the recommended fixes together, once known
PROFILED_SHARE = 0.25  # profiled runs are reserved for only when they cost at most this
# ... and those of the baseline and the fixes meant to cut memory up to this: one run gives
# a peak for good, where one more timed round adds little
MEMORY_PROFILED_SHARE = 0.5
BASELINE_ONLY_ROUNDS = 3  # timed runs of a cell with no fix to measure


@dataclass(frozen=True)
class Sampled:
    """Every measuring run stops after step `stop`, steps 1 … `warmup` untimed (the
    numbers of a `steps.SamplePlan`, without its step source). `whole_epoch`: each run is
    the cell's first epoch, timed whole (`_epoch_sampled`), and its stop stays there."""

    warmup: int
    stop: int
    min_timed: int
    per_epoch: int | None
    settle: int
    whole_epoch: bool = False

    def plan(self, source: steps.StepSource) -> steps.SamplePlan:
        return steps.SamplePlan(
            source, self.warmup, self.stop, self.min_timed, self.per_epoch, self.settle
        )


@dataclass(frozen=True)
class MeasuringPlan:
    """One measurement: the configurations (fix ids, the baseline's none first), whether
    the recommended fixes are added together once each alone has a verdict, where sampled
    runs stop, and the deadline with its shares."""

    configurations: tuple[tuple[str, ...], ...]
    combine: bool
    sampled: Sampled | None
    calibrated: bool  # the stop step was set from the baseline's first uninstrumented run
    deadline_s: float
    deadline_start: float  # a perf_counter time
    profiled_most_s: float  # the most the profiled runs are reserved (PROFILED_SHARE)
    memory_profiled_most_s: float  # ... with fixes meant to cut memory (MEMORY_PROFILED_SHARE)
    combined_share: float = COMBINED_SHARE_OF_ROUNDS
    baseline_only_rounds: int = BASELINE_ONLY_ROUNDS
    # fixes left untimed because their evidence cannot pass the no-change band: (id, bound)
    too_small: tuple[tuple[str, float], ...] = ()

    @property
    def deadline(self) -> timing.Deadline:
        return timing.Deadline(self.deadline_s, self.deadline_start)

    @property
    def planned(self) -> int:
        """Configurations to measure, the recommended fixes together included."""
        return len(self.configurations) + (1 if self.combine else 0)

    @property
    def give_up_at(self) -> float:
        """The deadline as a perf_counter time: a run whose next step would end past it
        stops at the step boundary before (`steps.StepCounter`)."""
        return self.deadline_start + self.deadline_s


def make(
    obs: Observation,
    options: Options,
    trace: StepTrace | None,
    count: steps.StepCount | None,
    fixable: list[Detection],
    fix_sets: list[list[str]] | None,
    deadline: timing.Deadline,
    previous: MeasuringPlan | None,
) -> MeasuringPlan:
    """The plan of a measurement against `deadline`: the baseline and the fix sets (by
    default each fix alone, the recommended ones together added once those have a
    verdict; with `--quick`, all fixes together only). Whether to sample, and where to
    stop first, is decided once per session (`previous` carries it), so a later re-time
    compares like with like."""
    by_default = fix_sets is None
    too_small: tuple[tuple[str, float], ...] = ()
    if fix_sets is None and options.quick:  # all together: a small fix still counts there
        ids = [d.finding.id for d in fixable]
        fix_sets = [ids] if ids else []
    elif fix_sets is None:
        fixable, too_small = promising_first(fixable)
        fix_sets = [[d.finding.id] for d in fixable]
    configurations: list[tuple[str, ...]] = [()]
    for fix_set in fix_sets:
        if fix_set and label(fix_set) not in {label(c) for c in configurations}:
            configurations.append(tuple(fix_set))
    combine = by_default and not options.quick and len(configurations) > 2
    plan = MeasuringPlan(
        configurations=tuple(configurations),
        combine=combine,
        too_small=too_small,
        sampled=None,
        calibrated=False,
        deadline_s=deadline.seconds,
        deadline_start=deadline.start,
        profiled_most_s=PROFILED_SHARE * options.budget,
        memory_profiled_most_s=MEMORY_PROFILED_SHARE * options.budget,
    )
    if previous is not None:
        return replace(plan, sampled=previous.sampled, calibrated=previous.calibrated)
    depth = _prefetch_depth(trace, fixable)
    return replace(plan, sampled=_sampled(obs, trace, count, depth, plan.planned, deadline.left()))


def promising_first(
    fixable: list[Detection],
) -> tuple[list[Detection], tuple[tuple[str, float], ...]]:
    """The fixes to time, the most promising first (no bound known counts as most
    promising: anomaly mode's cost has none), and those whose evidence allows no gain past
    the no-change band, with that bound."""
    band = 1.0 + NO_CHANGE_BAND
    small = tuple(
        (d.finding.id, gain)
        for d in fixable
        if d.fix is not None and (gain := d.fix.most_gain) is not None and gain < band
    )
    skipped = {check_id for check_id, _ in small}
    timed = [d for d in fixable if d.finding.id not in skipped]
    timed.sort(key=lambda d: -(d.fix.most_gain or math.inf) if d.fix is not None else 0.0)
    return timed, small


def agreed(plan: MeasuringPlan) -> MeasuringPlan:
    """Under torchrun, rank 0's plan, which every rank then carries out (the deadline
    counted on each rank's own clock, from when its measurement started): the plan is
    made from the probe's figures, which are each rank's own."""
    return replace(lockstep.from_first(plan), deadline_start=plan.deadline_start)


def label(fix_ids: tuple[str, ...] | list[str]) -> str:
    """A configuration's label: its fix ids, sorted, joined by '+' (no fix: BASELINE)."""
    return "+".join(sorted(fix_ids)) or BASELINE


def calibrated(
    plan: MeasuringPlan,
    total: int | None,
    lead_s: float | None,
    step_s: float | None,
    budget_s: float,
) -> MeasuringPlan:
    """The plan with its stop step set from the baseline's first uninstrumented run (time
    to the end of the warm-up `lead_s`, then `step_s` a step), so that the timed rounds fit
    in `budget_s` (the profiled runs already paid for)."""
    sampled = plan.sampled
    if sampled is None or sampled.whole_epoch or lead_s is None or step_s is None:
        return replace(plan, calibrated=True)
    configurations = plan.planned
    stop = steps.choose_stop(
        budget_s, configurations, lead_s, step_s, sampled.warmup, total, sampled.min_timed
    )
    return replace(plan, calibrated=True, sampled=replace(sampled, stop=stop))


def _sampled(
    obs: Observation,
    trace: StepTrace | None,
    count: steps.StepCount | None,
    depth: int,
    configurations: int,
    budget_s: float,
) -> Sampled | None:
    """Whether to stop every run at a step, and where first (the baseline's first run
    then calibrates the stop: `calibrated`)."""
    if trace is None:
        return None
    total = count.total if count else None
    warmup = steps.warmup_for(total if total is not None else trace.count, depth)
    min_timed = max(steps.MIN_TIMED_STEPS, depth)
    if not obs.stopped_early:
        plain = obs.wall_s / PROBE_SLOWDOWN
        if not steps.worth_sampling(plain, configurations, budget_s):
            return None
    per_epoch = steps.batches_per_epoch(trace)
    if total is not None and total < warmup + min_timed + 1:
        return _epoch_sampled(per_epoch, total)
    step_s = trace.mean_step_s() or obs.wall_s
    lead_s = (trace.first_s or step_s) + (warmup - 1) * step_s
    settle = max(steps.MIN_TIMED_STEPS, depth)
    if steps.has_epochs(per_epoch, total):  # room for an epoch restart in the timed steps
        min_timed = steps.MIN_TIMED_STEPS + settle
    else:
        per_epoch = None
    stop = steps.choose_stop(budget_s, configurations, lead_s, step_s, warmup, total, min_timed)
    return Sampled(warmup, stop, min_timed, per_epoch, settle)


def _epoch_sampled(per_epoch: int | None, total: int | None) -> Sampled | None:
    """A cell of several short epochs whose steps leave no room for a warm-up and timed
    steps after it (a worker loader's prefetch depth can be an epoch's length: its burst
    at an epoch's start would be all the timed steps see): each run is the first epoch,
    timed whole from its first batch, so the iterator's start, workers starting and the
    burst are in every configuration's time as they are in each epoch of the cell. A
    worker loader kept across epochs (`persistent_workers`) starts once a cell, so this
    counts its start against the fix once per epoch: a bias against the fix, never for
    it. None where the cell is one epoch (nothing to cut)."""
    if per_epoch is None or total is None or not steps.has_epochs(per_epoch, total):
        return None
    return Sampled(0, per_epoch, per_epoch, None, per_epoch, whole_epoch=True)


def _prefetch_depth(trace: StepTrace | None, fixable: list[Detection]) -> int:
    """The deepest prefetch of a DataLoader with workers in play: the user's own (the
    cell's step source) or one a fix builds."""
    own = 0
    if trace is not None and trace.unit == "batch":
        own = steps.prefetch_depth(trace.obj.num_workers, trace.obj.prefetch_factor)
    return max([own, *(d.fix.warmup_steps for d in fixable if d.fix is not None)])
