"""The runs that carry out a measuring plan: first runs, paired rounds, the recommended
fixes together, profiled runs (peak memory, FLOPs), and the conclusions drawn from them.

Every run starts from the state the cell started from (snapshot S0), applies its
configuration's fixes, and stops after the plan's step K when sampled (`run.Runner`). What
the runs measure becomes a variant through `figures`; what they find worth saying goes to
the session through its `Hooks`.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cell.workload import Workload
from ..distributed import lockstep
from ..kernel import discovery, fixes, plain_stack, state
from ..options import Options
from ..probe import load, memory, steps
from ..probe.observation import Observation, StepTrace
from ..report import MachineLoad, Numerics, RankTime, Variant
from . import figures, losses, numerics, timing, utilisation, verdict
from . import plan as plans
from .plan import BASELINE, PROBE_SLOWDOWN, MeasuringPlan
from .run import Config, Runner, RunTime


@dataclass
class Measuring:
    """Everything one measurement gathers: each configuration's variant, its first run and
    later runs, what the cell produced (numerics) and the paired rounds (with each run's
    wall time, to foresee whether the next one fits the deadline)."""

    configs: list[Config]
    watched: tuple[set[str], dict[str, torch.nn.Module]]
    results: dict[str, Variant] = field(default_factory=dict)
    outputs: dict[str, numerics.Produced] = field(default_factory=dict)
    firsts: dict[str, RunTime] = field(default_factory=dict)
    later: dict[str, list[RunTime]] = field(default_factory=dict)
    runnable: list[Config] = field(default_factory=list)
    baseline_runs: list[RunTime] = field(default_factory=list)
    rounds: timing.Rounds = field(default_factory=lambda: timing.Rounds(BASELINE))

    def __post_init__(self) -> None:
        for config in self.configs:
            self.results.setdefault(config.label, Variant(fixes=config.ids))
            self.later.setdefault(config.label, [])

    def add(self, config: Config) -> None:
        self.configs.append(config)
        self.__post_init__()


@dataclass(frozen=True)
class Hooks:
    """What the runs tell the session as they go."""

    warn: Callable[[str], None]  # said once in the report's warnings
    note: Callable[[str], None]  # added to the report's warnings
    progress: Callable[[float, str], None]
    # numbers so far: whether a partial report is due, and publishing one (baseline,
    # the measurement's variants, its deadline)
    partial_due: Callable[[], bool]
    partial: Callable[[Variant, list[Variant], timing.Deadline], None]
    measured: Callable[[Variant], None]  # a variant measured outside a plan (a fit)
    publish: Callable[[], None]  # the report as it stands, while measuring
    # a part of perfcheck's own whose failure is kept and passed over (`own_failures`)
    contained: Callable[[str], AbstractContextManager[None]]


class Runs:
    """The measuring runs of one session, after its probe. What holds for the session (the
    plan's sampling, FLOPs, each fix's first one-time cost) is kept here between
    measurements, so a re-time compares like with like."""

    def __init__(
        self,
        workload: Workload,
        obs: Observation,
        trace: StepTrace | None,
        count: steps.StepCount | None,
        options: Options,
        start_state: state.Snapshot | None,
        start_switches: state.TorchSwitches,
        stack: plain_stack.PlainStack,
        cell_names: set[str],
        fix_for: Callable[[str], fixes.Fix],
        hooks: Hooks,
    ):
        self.workload, self.obs, self.trace, self.count = workload, obs, trace, count
        self.options = options
        self.start_state = start_state
        self.runner = Runner(workload, obs, trace, start_state, start_switches, stack, hooks.warn)
        self.cell_names = cell_names
        self.fix_for = fix_for
        self.hooks = hooks
        self.plan: MeasuringPlan | None = None  # the newest measurement's
        self.flops: utilisation.FlopCount | None = None  # counted once: fixes keep the math
        self.flops_detail: str | None = None
        self.memory_label: str | None = None
        # each fix's one-time cost the first time it ran alone (its artifacts, such as a
        # compiled module, are cached on the fix, so a later set with it pays nothing again)
        self.first_costs: dict[str, float] = {}
        self.profiled_steps: int | None = None  # where the profiled runs stop (sampled)
        # a fix meant to cut memory is measured: profiled runs cover all the timed steps
        self.profiled_whole_sample = False
        self.load: MachineLoad | None = None  # other processes' CPU time, last measurement
        # under torchrun, each rank's own baseline time in the last measurement
        self.rank_times: list[RankTime] | None = None
        # where the baseline's first run of the last measurement spent its time, by part
        self.time_split: dict[str, float] | None = None

    @functools.cached_property
    def source(self) -> steps.StepSource | None:
        """What one step of the cell is (the probe's leading step source)."""
        return steps.source_of(self.obs, self.trace) if self.trace is not None else None

    @property
    def sample(self) -> steps.SamplePlan | None:
        """Where every run stops, when the plan samples."""
        if self.plan is None or self.plan.sampled is None or self.source is None:
            return None
        return self.plan.sampled.plan(self.source)

    @contextmanager
    def load_watched(self) -> Iterator[None]:
        """What other processes ran on this kernel's CPUs while measuring (`load`): the
        rounds pair each fix with a baseline run taken back to back, so speedups hold on a
        busy machine, but their intervals widen and the times per run grow."""
        start = load.reading()
        try:
            yield
        finally:
            end = load.reading()
            seen = load.between(start, end) if start and end else None
            self.load = None
            if seen is not None:  # the report says it when it is more than a trace
                self.load = MachineLoad(seen.window_s, seen.other_cpu_s, seen.cpus)

    # a measurement ----------------------------------------------------------------------
    def measure(self, plan: MeasuringPlan) -> tuple[list[Variant], Variant]:
        """First runs, paired rounds, then the recommended fixes together (with `combine`),
        then the profiled runs (peak memory, FLOPs) — each only where the deadline leaves
        room for it; what did not fit says what `--budget` would have measured it."""
        self.plan = plan
        configs = [
            Config(plans.label(ids), [self.fix_for(i) for i in ids]) for ids in plan.configurations
        ]
        self.runner.give_up_at = plan.give_up_at
        untimed = [
            Variant(fixes=[check_id], verdict=verdict.NO_CLEAR_CHANGE, at_most=bound)
            for check_id, bound in plan.too_small
        ]
        try:
            variants, baseline = self._measured(configs, plan.deadline, plan.combine)
            return [*variants, *untimed], baseline
        finally:
            self.runner.give_up_at = None

    def _measured(
        self, configs: list[Config], deadline: timing.Deadline, combine: bool
    ) -> tuple[list[Variant], Variant]:
        measuring = Measuring(configs, self._watched_outputs())
        self.profiled_steps, self.profiled_whole_sample = None, self._cutting(configs) > 0
        self.time_split = None
        self._first_runs(measuring, deadline)
        runnable = measuring.runnable
        reserve = self._profiled_reserve(
            len(runnable), self._cutting(runnable), measuring.firsts.get(BASELINE)
        )
        rounds_deadline = timing.Deadline(max(0.0, deadline.seconds - reserve), deadline.start)
        if combine:  # the fixes alone first, leaving room for the recommended ones together
            left = rounds_deadline.left()
            alone = rounds_deadline.spent + (1 - self._plan.combined_share) * left
            self._rounds(measuring, timing.Deadline(alone, rounds_deadline.start))
            together = self._combined_config(measuring)
            if together is not None:
                measuring.add(together)
                self._first_runs(measuring, rounds_deadline, only=[together])
        self._rounds(measuring, rounds_deadline)
        self._profiled_runs(measuring, deadline)
        drift = figures.allocator_drift(measuring.configs, measuring.baseline_runs)
        if drift is not None:
            self.hooks.warn(drift)
        ranks = lockstep.current()
        if ranks is not None:
            own = figures.own_time(measuring.baseline_runs)
            hosts_and_times = lockstep.gathered((ranks.host, own))
            self.rank_times = [RankTime(r, h, s) for r, (h, s) in enumerate(hosts_and_times)]
        return self._conclude(measuring, deadline)

    @property
    def _plan(self) -> MeasuringPlan:
        if self.plan is None:
            raise RuntimeError("no measuring plan yet")
        return self.plan

    def _first_runs(
        self,
        measuring: Measuring,
        deadline: timing.Deadline,
        only: list[Config] | None = None,
    ) -> None:
        """Each configuration's first run: it pays the one-time costs (compile, worker
        start), and what the cell produced is kept for numerics (sampled: at the stop
        step). A sampled measurement's first runs make its first round, and the baseline's
        very first one sets the stop step. A configuration whose first run would end past
        the deadline is left out, and says so."""
        results = measuring.results
        first_round: dict[str, float] = {}
        for config in only or measuring.configs:
            label = config.label
            guess = self._run_guess(measuring, config)
            if not deadline.allows(guess):
                results[label].budget_to_tell_s = _budget_for(deadline, guess)
                if label == BASELINE:  # nothing to stand a fix against: none runs
                    for other in measuring.configs[1:]:
                        results[other.label].budget_to_tell_s = _budget_for(deadline, guess)
                    self.hooks.warn(
                        f"nothing was timed: a run of the cell takes about "
                        f"{figures.seconds(guess)} and the checks left "
                        f"{figures.seconds(deadline.left())} of the "
                        f"{figures.seconds(deadline.seconds)} budget; "
                        f"`--budget {results[BASELINE].budget_to_tell_s:.0f}` would"
                    )
                    return
                continue
            self.hooks.progress(deadline.spent / deadline.seconds, f"first run: {label}")
            started = time.perf_counter()
            with (
                self._failures_noted(config, results[label]),
                self._out_of_time(measuring, config, deadline, started),
            ):
                if label == BASELINE and self.sample is not None and not self._plan.calibrated:
                    first = self.one_run(config, stop=self._stop())
                    measuring.firsts[BASELINE] = first
                    self._calibrate(first, deadline.left(), self._cutting(measuring.configs))
                    started = time.perf_counter()
                value = self._timed_run(measuring, config)
                if not any(f.one_time_cause for f in config.fixes):  # what a round will take
                    wall = lockstep.slowest(time.perf_counter() - started)
                    measuring.rounds.walls.setdefault(label, []).append(wall)
                measuring.runnable.append(config)
                if self.sample is not None:  # sampled: the first run is timed like any
                    first_round[label] = value
                    figures.fill(results[label], timing.Measurement(label, [value]))
            self._publish_partial(measuring, deadline)
            if BASELINE not in measuring.firsts:  # nothing to stand a fix against
                return
        if first_round:
            if only and measuring.rounds.rounds:  # a late configuration: not a round of its own
                measuring.rounds.rounds[-1].update(first_round)
            else:
                measuring.rounds.rounds.append(first_round)

    def _calibrate(self, first: RunTime, budget_s: float, cutting: int) -> None:
        """Set the stop step from the baseline's first uninstrumented run, so that the
        timed rounds fit in `budget_s` once the profiled runs are paid for (`cutting`:
        the configurations meant to cut memory)."""
        plan = self._plan
        total = self.count.total if self.count else None
        left = budget_s
        if plan.sampled is not None and first.lead_s is not None and first.step_s is not None:
            left -= self._profiled_reserve(plan.planned, cutting, first)
        self.plan = plans.agreed(plans.calibrated(plan, total, first.lead_s, first.step_s, left))

    @contextmanager
    def _out_of_time(
        self, measuring: Measuring, config: Config, deadline: timing.Deadline, started: float
    ) -> Iterator[None]:
        """A first run stopped at the deadline: the configuration is not measured, and the
        report says what budget would have had room for it."""
        try:
            yield
        except timing.OutOfTime:
            taken = time.perf_counter() - started
            measuring.results[config.label].budget_to_tell_s = _budget_for(deadline, taken)
            self.hooks.warn(
                f"{config.label}: a run did not finish within the budget (stopped after "
                f"{figures.seconds(taken)}), so it was not measured"
            )

    @contextmanager
    def _failures_noted(self, config: Config, variant: Variant) -> Iterator[None]:
        """A fix that cannot be applied, or a cell that raises with it, is noted on its
        variant and measuring goes on; the baseline raising is the cell's own error."""
        try:
            yield
        except fixes.FixError as error:
            variant.error = f"the fix could not be applied: {error.reason}"
        except lockstep.RankFailed as error:
            variant.error = str(error)
        except Exception as error:
            # under torchrun the other ranks may wait in the cell's collectives for this
            # one: the error stops this rank, and torchrun the others
            if config.label == BASELINE or lockstep.current() is not None:
                raise
            variant.error = f"the cell raised with this fix: {figures.error_text(error)}"

    def _timed_run(self, measuring: Measuring, config: Config) -> float:
        """One run of the configuration; the first captures what the cell produced
        (numerics). Returns its time: the whole run, or per step when sampled."""
        label = config.label
        observe = None
        if label not in measuring.outputs:
            observe = functools.partial(self._capture, measuring.outputs, label, measuring.watched)
        run = self.one_run(config, observe, self._stop())
        if label == BASELINE:
            measuring.baseline_runs.append(run)
            if run.split is not None:  # the observed run: where its time went
                self.time_split = run.split
        if label not in measuring.firsts:
            measuring.firsts[label] = run
        else:
            measuring.later[label].append(run)
        if self.sample is not None and run.step_s is not None:
            return run.step_s
        return run.total_s

    def _rounds(self, measuring: Measuring, deadline: timing.Deadline) -> None:
        """Paired rounds of every runnable configuration until each speedup has settled or
        the deadline leaves no room for another round."""
        runners = {
            c.label: functools.partial(self._timed_run, measuring, c) for c in measuring.runnable
        }
        if not runners:
            return
        if self.sample is not None:  # a fix doing a share of the steps: judged by the cell
            for config in measuring.runnable:
                share = math.prod(f.steps_share for f in config.fixes)
                if share < 1.0:
                    measuring.rounds.whole_cell[config.label] = 1.0 / share
        timing.paired_rounds(
            runners,
            BASELINE,
            deadline,
            progress=self.hooks.progress,
            on_run=lambda label, _m: self._publish_partial(measuring, deadline),
            begun=measuring.rounds,
            min_rounds=None if len(runners) > 1 else self._plan.baseline_only_rounds,
        )

    def _combined_config(self, measuring: Measuring) -> Config | None:
        """The recommended fixes together, once each alone has a verdict: two or more
        measured clearly faster with results the same (or within tolerance)."""
        recommended = [
            c.fixes[0]
            for c in measuring.runnable[1:]
            if len(c.fixes) == 1 and self._recommends(measuring, c)
        ]
        if len(recommended) < 2:
            return None
        label = "+".join(sorted(f.check_id for f in recommended))
        return Config(label, recommended)

    def _recommends(self, measuring: Measuring, config: Config) -> bool:
        """Measured faster with results the same, on every rank (under torchrun)."""
        return not lockstep.any_rank(not self._recommends_here(measuring, config))

    def _recommends_here(self, measuring: Measuring, config: Config) -> bool:
        speedup = measuring.rounds.speedup(config.label)
        if speedup is None or speedup.verdict != verdict.FASTER:
            return False
        outputs = measuring.outputs
        if BASELINE not in outputs or config.label not in outputs:
            return self.start_state is None  # nothing to compare: no snapshot, no claim
        tolerance = max(f.tolerance for f in config.fixes)
        return self._compared(outputs[BASELINE], outputs[config.label], tolerance).same_results

    def _compared(
        self, baseline: numerics.Produced, fixed: numerics.Produced, tolerance: float
    ) -> Numerics:
        """`numerics.compare` of the outputs, or "not compared" where perfcheck's
        comparison failed; with the loss curves' comparison beside it."""
        result = Numerics(detail="not compared: perfcheck's comparison failed (see its failures)")
        if baseline.outputs is not None and fixed.outputs is not None:
            with self.hooks.contained("numerics"):
                result = numerics.compare(baseline.outputs, fixed.outputs, tolerance)
        with self.hooks.contained("numerics"):
            return numerics.with_losses(result, baseline.losses, fixed.losses, tolerance)
        return result

    def _profiled_runs(self, measuring: Measuring, deadline: timing.Deadline) -> None:
        """Peak memory of each configuration and the model's FLOPs, each from a profiled run
        (sampled: a short one), where the deadline leaves room for it."""
        first = measuring.firsts.get(BASELINE)
        runs = len(measuring.runnable) + 1
        sample = self.sample
        self.profiled_steps = sample.stop if sample is not None else None
        guess = self._profiled_guess(first)
        if (
            sample is not None
            and not deadline.allows(runs * guess)
            and not self.profiled_whole_sample
        ):
            self.profiled_steps = min(sample.stop, steps.PROFILED_STEPS)
            guess = self._profiled_guess(first)
        memory_guess = self._memory_guess(guess)
        skipped = False
        for config in self._profiled_order(measuring):
            counted = self.flops is not None or self.flops_detail is not None
            if config is None and counted:  # once per session
                continue
            if not deadline.allows(guess if config is None else memory_guess):
                skipped = True
                continue
            if config is None:
                self._count_flops(measuring.configs[0])
                skipped = skipped or (self.flops is None and self.flops_detail is None)
                continue
            self.hooks.progress(1.0, f"peak memory: {config.label}")
            try:
                measuring.results[config.label].peak_memory_bytes = self._checked_run(config)
            except timing.OutOfTime:
                skipped = True
        if skipped:
            self.hooks.warn(
                f"peak memory and FLOPs were not measured for every configuration: a profiled "
                f"run takes about {figures.seconds(guess)} here and the budget had no room "
                "left for it (raise --budget to have them)"
            )

    def _conclude(
        self, measuring: Measuring, deadline: timing.Deadline
    ) -> tuple[list[Variant], Variant]:
        """Statistics, one-time costs, projections, speedups with their verdicts,
        throughput, numerics, and what a budget that ran out would have needed."""
        results, rounds = measuring.results, measuring.rounds
        for label in rounds.labels:
            figures.fill(results[label], rounds.measurement(label))
        if BASELINE not in rounds.labels and BASELINE in measuring.firsts:  # no round fitted:
            # the first run is all there is: per step where runs are sampled (its whole
            # time holds the code's setup and warm-up, which no per-step figure may carry)
            first = measuring.firsts[BASELINE]
            only = first.step_s if self.sample is not None else first.total_s
            if only is not None:
                figures.fill(results[BASELINE], timing.Measurement(BASELINE, [only]))
            for config in measuring.runnable[1:]:
                guess = self._run_guess(measuring, config)
                results[config.label].budget_to_tell_s = _budget_for(deadline, guess)
        timed = {label: rounds.measurement(label) for label in rounds.labels}
        configs = measuring.configs
        sampled = self._plan.sampled if self.sample is not None else None
        figures.set_one_time_costs(
            configs,
            results,
            measuring.firsts,
            timed,
            measuring.later,
            sampled is not None,
            self.first_costs,
        )
        total = self.count.total if self.count else None
        shares = {c.label: math.prod(f.steps_share for f in c.fixes) for c in configs}
        figures.set_projections(results, measuring.firsts, measuring.later, sampled, total, shares)
        base = results[BASELINE]
        figures.add_throughput(configs, results, self.flops, self.obs.device)
        speedups = []
        for config in configs[1:]:
            variant = results[config.label]
            speedup = rounds.speedup(config.label)
            figures.set_speedup(variant, base, speedup)
            if speedup is not None:
                speedups.append(speedup)
            if self.options.memory and all(f.saves_memory for f in config.fixes):
                variant.judged_by = "memory"
            elif config.label in rounds.whole_cell:
                variant.judged_by = "whole cell"
            if variant.error:
                continue
            tolerance = max(f.tolerance for f in config.fixes)
            outputs = measuring.outputs
            if BASELINE in outputs and config.label in outputs:
                variant.numerics = self._compared(
                    outputs[BASELINE], outputs[config.label], tolerance
                )
            elif self.start_state is None:
                variant.numerics.detail = "not compared: state restore is off"
        self._flag_nondeterminism(configs[0], results, measuring, deadline)
        wanted = verdict.budget_to_tell(
            speedups, deadline.seconds, rounds.seconds, deadline.spent - rounds.seconds
        )
        for config in configs[1:]:
            variant, speedup = results[config.label], rounds.speedup(config.label)
            if speedup is not None and not speedup.settled and not variant.error and wanted:
                variant.budget_to_tell_s = wanted
        return [results[c.label] for c in configs[1:]], base

    def _publish_partial(self, measuring: Measuring, deadline: timing.Deadline) -> None:
        """Numbers so far, to the front end, when one is due: provisional (the report's
        phase says measuring), so no verdict is drawn from them yet."""
        if not self.hooks.partial_due():
            return
        results, rounds = measuring.results, measuring.rounds
        for label in rounds.labels:
            figures.fill(results[label], rounds.measurement(label))
        base = results[BASELINE]
        current = [results[c.label] for c in measuring.configs[1:]]
        for config, variant in zip(measuring.configs[1:], current, strict=True):
            figures.set_speedup(variant, base, rounds.speedup(config.label))
            variant.verdict = None  # provisional: the interval is still moving
        self.hooks.partial(base, current, deadline)

    # runs that are not timed rounds -----------------------------------------------------
    def _flag_nondeterminism(
        self,
        baseline: Config,
        results: dict[str, Variant],
        measuring: Measuring,
        deadline: timing.Deadline,
    ) -> None:
        """A "changed" verdict only means something if the cell repeats itself: run the
        baseline once more (where the deadline leaves room) and say so when two baseline
        runs already differ; a changed loss is judged again against twice what the
        baseline's loss differs from itself by."""
        changed = [v for v in results.values() if v.numerics.verdict == "changed"]
        loss_off = {k: v for k, v in results.items() if v.numerics.loss_verdict == losses.CHANGED}
        outputs = measuring.outputs
        if not lockstep.any_rank(bool(changed or loss_off) and BASELINE in outputs):
            return
        walls = measuring.rounds.walls.get(BASELINE) or [0.0]
        if not deadline.allows(statistics.median(walls)):
            note = "not checked whether the cell itself repeats its results (no time left)"
            for variant in [*changed, *loss_off.values()]:
                variant.numerics.detail = _noted(variant.numerics.detail, note)
            return
        again: dict[str, numerics.Produced] = {}
        capture = functools.partial(self._capture, again, BASELINE, measuring.watched)
        try:
            self.one_run(baseline, capture, self._stop())
        except timing.OutOfTime:
            return
        if BASELINE not in outputs or BASELINE not in again:  # the run was another rank's call
            return
        self._note_drift(changed, outputs[BASELINE], again[BASELINE])
        self._rejudge_losses(loss_off, outputs, again[BASELINE])

    def _note_drift(
        self, changed: list[Variant], first: numerics.Produced, again: numerics.Produced
    ) -> None:
        """Say on each changed variant when two baseline runs' outputs already differ."""
        if not changed or first.outputs is None or again.outputs is None:
            return
        drift = self._compared(numerics.Produced(first.outputs, []), again, 0.0)
        if drift.verdict in ("identical", "not-compared"):
            return
        note = (
            "the cell itself is not deterministic: two baseline runs from the same state "
            f"already differ (max rel diff {drift.max_rel_diff or float('nan'):.1e})"
        )
        for variant in changed:
            variant.numerics.detail = _noted(variant.numerics.detail, note)

    @staticmethod
    def _rejudge_losses(
        loss_off: dict[str, Variant],
        outputs: dict[str, numerics.Produced],
        again: numerics.Produced,
    ) -> None:
        """Each changed loss judged again against the baseline's own repeat."""
        for label, variant in loss_off.items():
            if label in outputs:
                variant.numerics = numerics.rejudged(
                    variant.numerics, outputs[BASELINE].losses, outputs[label].losses, again.losses
                )

    def _count_flops(self, baseline: Config) -> None:
        """Model FLOPs of one untimed baseline run (sampled: per step, over a short run),
        once per session; a cell the counter cannot run under is measured all the same."""
        if self.flops is not None or self.flops_detail is not None:
            return
        stop = self._profiled_stop()
        try:
            count = utilisation.count(functools.partial(self.one_run, baseline, stop=stop))
        except timing.OutOfTime:  # no room left this time; a later measurement may count
            return
        except Exception as error:
            self.flops_detail = (
                "FLOPs not counted: the cell failed under FlopCounterMode "
                f"({figures.error_text(error)})"
            )
            return
        if stop is not None:  # per step, like the sampled times
            count = utilisation.FlopCount(
                count.total // stop, {k: v // stop for k, v in count.buckets.items()}
            )
        self.flops = count

    def _checked_run(self, config: Config) -> int | None:
        """One untimed run that records peak memory (a short one, `_memory_stop`)."""
        obs = self.obs
        # the probe could profile, so memory profiling is safe too
        measure = memory.profiled if obs.ops is not None else memory.tracked
        peak = self.one_run(config, None, self._memory_stop(), measure(obs.device)).watched.peak
        self.memory_label = peak.label if peak else None
        return peak.bytes if peak else None

    def one_run(
        self,
        config: Config,
        observe: Callable[[], Any] | None = None,
        stop: int | None = None,
        watched: AbstractContextManager[Any] | None = None,
    ) -> RunTime:
        """One run of the configuration (`Runner.run`), sampled as the plan says."""
        __tracebackhide__ = True
        return self.runner.run(config, self.sample, observe, stop, watched)

    def _capture(
        self,
        outputs: dict[str, numerics.Produced],
        label: str,
        watched: tuple[set[str], dict],
        loss_curve: list[float],
    ) -> None:
        """What the cell produced so far, from a restored start, and its loss per step
        (`Runner.run` records it on this run), for numerics."""
        if self.start_state is not None:
            names, modules = watched
            namespace = self.workload.namespace
            # a model the cell builds is a new one each run: read the one its name holds now
            modules = {
                label: value
                if isinstance(value := namespace.get(label), torch.nn.Module)
                else module
                for label, module in modules.items()
            }
            produced = outputs[label] = numerics.Produced(None, loss_curve)
            with self.hooks.contained("numerics"):
                produced.outputs = numerics.capture(namespace, names, modules)

    def _watched_outputs(self) -> tuple[set[str], dict[str, torch.nn.Module]]:
        """Names the cell (re)bound and the models it ran: what numerics compares."""
        obs = self.obs
        modules = {
            entry.name: entry.obj
            for entry in discovery.top_level_modules(obs.found)
            if any(id(m) in obs.modules for m in entry.obj.modules())
        }
        return set(self.cell_names), modules

    # guesses ----------------------------------------------------------------------------
    def _stop(self) -> int | None:
        sample = self.sample
        return sample.stop if sample is not None else None

    def _profiled_stop(self) -> int | None:
        """Sampled: profiled runs (memory, FLOPs) stop where the timed runs stop, so their
        peak covers the same work (an evaluation pass at an epoch's end included), or after
        a couple of steps where the budget has no room for that (`_profiled_runs`) — never
        when a fix meant to cut memory is measured: the part it acts on (an evaluation
        after the epoch) may come after those steps, and a peak without it would read
        "same memory" for a fix that cuts it."""
        sample = self.sample
        if sample is None:
            return None
        if self.profiled_steps:
            return self.profiled_steps
        return sample.stop if self.profiled_whole_sample else min(sample.stop, steps.PROFILED_STEPS)

    def _memory_stop(self) -> int | None:
        """Where a peak-memory run stops: where the profiled runs do when sampled; a cell
        run whole stops after PROFILED_STEPS of its steps as well, unless a fix meant to
        cut memory is measured (see `_profiled_stop`). Its profiler records every op with
        its memory: read back, the events of a whole run of many small steps take far
        longer than the run (a 3 s cell of 1,445 steps: 16 s of a 20 s budget)."""
        if self.sample is not None:
            return self._profiled_stop()
        trace = self.trace
        if trace is None or self.profiled_whole_sample or trace.count <= steps.PROFILED_STEPS:
            return None
        return steps.PROFILED_STEPS

    def _memory_guess(self, profiled_guess: float) -> float:
        """A peak-memory run's seconds: a profiled run's, cut to the steps it runs."""
        stop, trace = self._memory_stop(), self.trace
        if self.sample is not None or stop is None or trace is None:
            return profiled_guess
        return profiled_guess * min(1.0, (stop + 1) / trace.count)

    def _profiled_order(self, measuring: Measuring) -> list[Config | None]:
        """What the profiled runs measure, most wanted first (None: the FLOPs count): the
        baseline's peak (the reserve always has room for it and the FLOPs), the peaks of
        the fixes meant to cut memory on this device (the figure they are for), the
        FLOPs, then each other fix's peak while time is left."""
        configs = measuring.runnable
        if not configs or configs[0].label != BASELINE:  # no baseline run: no FLOPs either
            return list(configs)
        cuts = [c for c in configs[1:] if self._cuts_memory(c)]
        return [*configs[:1], *cuts, None, *(c for c in configs[1:] if c not in cuts)]

    def _cuts_memory(self, config: Config) -> bool:
        return any(self.obs.device in f.cuts_memory_on for f in config.fixes)

    def _cutting(self, configs: list[Config]) -> int:
        return sum(1 for c in configs[1:] if self._cuts_memory(c))

    def _profiled_reserve(self, planned: int, cutting: int, first: RunTime | None) -> float:
        """Seconds to keep for the profiled runs (one per configuration, one for FLOPs)
        where they are cheap enough (at most PROFILED_SHARE of the budget), else for the
        baseline's two (its peak memory and FLOPs) and one for each of the `cutting`
        configurations meant to cut memory (up to MEMORY_PROFILED_SHARE), else for the
        baseline's two; the others run if the rounds leave time."""
        guess, plan = self._profiled_guess(first), self._plan
        tiers = [(planned + 1, plan.profiled_most_s), (2, plan.profiled_most_s)]
        if cutting:
            tiers.insert(1, (2 + cutting, plan.memory_profiled_most_s))
        for runs, most in tiers:
            if runs * guess <= most:
                return runs * guess
        return 0.0

    def _profiled_guess(self, first: RunTime | None) -> float:
        """One profiled run's seconds: the plain run (sampled: its set-up and the steps it
        runs) slowed as much as the probe's steps were by our profiler, reading its events
        back included (a 3 s cell of 1,445 small steps: 9x, where the probe's whole run,
        mostly unprofiled, said 1.5x)."""
        obs = self.obs
        if first is None:
            return obs.wall_s
        sample = self.sample
        profiled_step = obs.profiled_step_s()
        if sample is not None and first.lead_s is not None and first.step_s is not None:
            setup = max(0.0, first.lead_s - sample.warmup * first.step_s)
            plain = setup + self._profiled_stop() * first.step_s  # type: ignore[operator]
            probe_step = profiled_step or (self.trace.mean_step_s() if self.trace else None)
            slowdown = probe_step / first.step_s if probe_step and first.step_s else None
        else:
            plain = first.total_s
            count = self.trace.count if self.trace is not None else 0
            if profiled_step and count:
                slowdown = profiled_step * count / first.total_s
            else:
                slowdown = obs.wall_s / first.total_s if not obs.stopped_early else None
        return plain * max(1.0, slowdown or PROBE_SLOWDOWN)

    def _run_guess(self, measuring: Measuring, config: Config) -> float:
        """How long a configuration's first run will take: the baseline's (measured, or
        guessed from the probe), with room for a one-time cost (compile, worker start)."""
        walls = measuring.rounds.walls.get(BASELINE)
        if walls:
            base = statistics.median(walls)
        else:
            obs = self.obs
            base = obs.wall_s / PROBE_SLOWDOWN
            sample = self.sample
            if sample is not None and self.trace is not None:
                step_s = self.trace.mean_step_s() or obs.wall_s
                base = sample.stop * step_s / PROBE_SLOWDOWN
        return base + sum(f.one_time_guess_s for f in config.fixes)


def _budget_for(deadline: timing.Deadline, guess: float) -> float:
    """The `--budget` that would leave room for a configuration that did not fit: its
    first run and enough rounds for a verdict, on top of this budget."""
    rounds = steps.TARGET_ROUNDS
    wanted = deadline.seconds + guess * (1 + 3 * rounds)
    return float(5 * math.ceil(wanted / 5))


def _noted(detail: str | None, note: str) -> str:
    """A numerics detail with one more note after it."""
    return f"{detail}; {note}" if detail else note
