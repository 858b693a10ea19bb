"""The runs that carry out a measuring plan: first runs, paired rounds, the recommended
fixes together, profiled runs (peak memory, FLOPs), and the conclusions drawn from them.

Every run starts from the state the cell started from (snapshot S0), applies its
configuration's fixes, and stops after the plan's step K when sampled. What the runs
measure becomes a variant through `figures`; what they find worth saying goes to the
session through its `Hooks`.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import (
    allocator,
    discovery,
    fixes,
    load,
    memory,
    numerics,
    oom,
    plain_stack,
    probe,
    state,
    steps,
    timing,
    utilisation,
    verdict,
)
from ..engine.workload import CellError, Workload, silenced
from ..options import Options
from ..report import MachineLoad, Variant
from . import figures
from . import plan as plans
from .plan import BASELINE, PROBE_SLOWDOWN, MeasuringPlan


@dataclass
class Config:
    """One configuration to measure: a label and the fixes it applies."""

    label: str
    fixes: list[fixes.Fix]

    @property
    def ids(self) -> list[str]:
        return sorted(f.check_id for f in self.fixes)


@dataclass
class RunTime:
    """One measuring run: its seconds and, when sampled, the time to the end of the warm-up
    steps and the mean time per timed step."""

    total_s: float
    lead_s: float | None = None
    step_s: float | None = None
    watched: Any = None  # what the run's `watched` context gave (a memory Profile, …)
    faults: int = 0  # minor page faults during the run
    restart_s: float | None = None  # an epoch restart's cost, where the timed steps held one


@dataclass
class Measuring:
    """Everything one measurement gathers: each configuration's variant, its first run and
    later runs, what the cell produced (numerics) and the paired rounds (with each run's
    wall time, to foresee whether the next one fits the deadline)."""

    configs: list[Config]
    watched: tuple[set[str], dict[str, torch.nn.Module]]
    results: dict[str, Variant] = field(default_factory=dict)
    outputs: dict[str, numerics.Outputs] = field(default_factory=dict)
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


class Runs:
    """The measuring runs of one session, after its probe. What holds for the session (the
    plan's sampling, FLOPs, each fix's first one-time cost) is kept here between
    measurements, so a re-time compares like with like."""

    def __init__(
        self,
        workload: Workload,
        obs: probe.Observation,
        trace: probe.StepTrace | None,
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
        self.start_state, self.start_switches = start_state, start_switches
        # the stack a plain run of the cell would execute under: timed runs of a cell whose
        # cost depends on it execute there (`_measuring_stack`)
        self.plain_stack = stack
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
        self.give_up_at: float | None = None  # a run to a step past this stops (measuring)
        self.load: MachineLoad | None = None  # other processes' CPU time, last measurement

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

    @contextmanager
    def state_kept(self, from_start: bool) -> Iterator[None]:
        """Whatever happens while measuring, the kernel ends as it was — with what the user
        did since the cell ran — except for a probe's leftovers from part of a run, which
        give way to the state before the cell (`from_start`: the complete run starts from
        there). Without a snapshot, torch's global modes still go back (they cost nothing
        to keep)."""
        if self.start_state is None:
            switches = state.TorchSwitches.capture()
            try:
                yield
            finally:
                switches.restore()
            return
        current = None
        if not from_start:
            namespace = self.workload.namespace
            current = state.take(namespace, discovery.walk(namespace), self.workload.source)
        try:
            yield
        finally:
            self._note_unseen_writes()
            if current is not None:
                current.restore()
            else:
                self.start_state.restore()

    def _note_unseen_writes(self) -> None:
        """Say so when a measuring run wrote a tensor the probe had left as it was, in a way
        torch does not see: the restores between runs passed over it (`Snapshot.
        note_unwritten`), so the runs after that write started from its changed values."""
        if self.start_state is None:
            return
        for label in self.start_state.written_unseen_objects():
            self.hooks.warn(
                f"a measuring run changed `{label}` in place in a way the restores between "
                "runs passed over (its length and ends unchanged), so the runs after it "
                "started from the changed contents; it is back as it was now"
            )
        changed = self.start_state.written_unseen()
        if changed:
            shapes = ", ".join(str(tuple(t.shape)) for t in changed[:3])
            self.hooks.warn(
                f"a measuring run wrote {len(changed)} tensor(s) of shape {shapes} that the "
                "probe's run had left as they were, in a way torch does not see (through "
                "`.data` or numpy), so the runs after it started from the changed values; "
                "they are back as they were now"
            )

    # a measurement ----------------------------------------------------------------------
    def measure(self, plan: MeasuringPlan) -> tuple[list[Variant], Variant]:
        """First runs, paired rounds, then the recommended fixes together (with `combine`),
        then the profiled runs (peak memory, FLOPs) — each only where the deadline leaves
        room for it; what did not fit says what `--budget` would have measured it."""
        self.plan = plan
        configs = [
            Config(plans.label(ids), [self.fix_for(i) for i in ids]) for ids in plan.configurations
        ]
        self.give_up_at = plan.give_up_at
        try:
            return self._measured(configs, plan.deadline, plan.combine)
        finally:
            self.give_up_at = None

    def _measured(
        self, configs: list[Config], deadline: timing.Deadline, combine: bool
    ) -> tuple[list[Variant], Variant]:
        measuring = Measuring(configs, self._watched_outputs())
        self._first_runs(measuring, deadline)
        reserve = self._profiled_reserve(len(measuring.runnable), measuring.firsts.get(BASELINE))
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
                    self._calibrate(first, deadline.left())
                    started = time.perf_counter()
                value = self._timed_run(measuring, config)
                if not any(f.one_time_cause for f in config.fixes):  # what a round will take
                    wall = time.perf_counter() - started
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

    def _calibrate(self, first: RunTime, budget_s: float) -> None:
        """Set the stop step from the baseline's first uninstrumented run, so that the
        timed rounds fit in `budget_s` once the profiled runs are paid for."""
        plan = self._plan
        total = self.count.total if self.count else None
        left = budget_s
        if plan.sampled is not None and first.lead_s is not None and first.step_s is not None:
            left -= self._profiled_reserve(plan.planned, first)
        self.plan = plans.calibrated(plan, total, first.lead_s, first.step_s, left)

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
        except Exception as error:
            if config.label == BASELINE:
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
        speedup = measuring.rounds.speedup(config.label)
        if speedup is None or speedup.verdict != verdict.FASTER:
            return False
        outputs = measuring.outputs
        if BASELINE not in outputs or config.label not in outputs:
            return self.start_state is None  # nothing to compare: no snapshot, no claim
        tolerance = max(f.tolerance for f in config.fixes)
        compared = numerics.compare(outputs[BASELINE], outputs[config.label], tolerance)
        return compared.verdict in ("identical", "close")

    def _profiled_runs(self, measuring: Measuring, deadline: timing.Deadline) -> None:
        """Peak memory of each configuration and the model's FLOPs, each from a profiled run
        (sampled: a short one), where the deadline leaves room for it."""
        first = measuring.firsts.get(BASELINE)
        runs = len(measuring.runnable) + 1
        sample = self.sample
        self.profiled_steps = sample.stop if sample is not None else None
        guess = self._profiled_guess(first)
        if sample is not None and not deadline.allows(runs * guess):
            self.profiled_steps = min(sample.stop, steps.PROFILED_STEPS)
            guess = self._profiled_guess(first)
        skipped = False
        # the baseline's peak memory and FLOPs first (the reserve is kept for those at least),
        # then each fix's peak memory while time is left
        for config in measuring.runnable:
            if not deadline.allows(guess):
                skipped = True
                continue
            self.hooks.progress(1.0, f"peak memory: {config.label}")
            try:
                measuring.results[config.label].peak_memory_bytes = self._checked_run(config)
            except timing.OutOfTime:
                skipped = True
            if config.label == BASELINE:
                if deadline.allows(guess):
                    self._count_flops(measuring.configs[0])
                elif self.flops is None and self.flops_detail is None:
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
            only = measuring.firsts[BASELINE].total_s  # the first run is all there is
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
        figures.set_projections(results, measuring.firsts, measuring.later, sampled, total)
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
            if variant.error:
                continue
            tolerance = max(f.tolerance for f in config.fixes)
            outputs = measuring.outputs
            if BASELINE in outputs and config.label in outputs:
                variant.numerics = numerics.compare(
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
        runs already differ."""
        changed = [v for v in results.values() if v.numerics.verdict == "changed"]
        outputs = measuring.outputs
        if not changed or BASELINE not in outputs:
            return
        walls = measuring.rounds.walls.get(BASELINE) or [0.0]
        if not deadline.allows(statistics.median(walls)):
            note = "not checked whether the cell itself repeats its results (no time left)"
            for variant in changed:
                variant.numerics.detail = f"{variant.numerics.detail}; {note}"
            return
        again: dict[str, numerics.Outputs] = {}
        capture = functools.partial(self._capture, again, BASELINE, measuring.watched)
        try:
            self.one_run(baseline, capture, self._stop())
        except timing.OutOfTime:
            return
        drift = numerics.compare(outputs[BASELINE], again.get(BASELINE, {}), 0.0)
        if drift.verdict in ("identical", "not-compared"):
            return
        note = (
            "the cell itself is not deterministic: two baseline runs from the same state "
            f"already differ (max rel diff {drift.max_rel_diff or float('nan'):.1e})"
        )
        for variant in changed:
            variant.numerics.detail = f"{variant.numerics.detail}; {note}"

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
        """One untimed run that records peak memory (sampled: a short one)."""
        obs = self.obs
        # the probe could profile, so memory profiling is safe too
        measure = memory.profiled if obs.ops is not None else memory.tracked
        peak = self.one_run(config, None, self._profiled_stop(), measure(obs.device)).watched.peak
        self.memory_label = peak.label if peak else None
        return peak.bytes if peak else None

    def measure_fits(self, tried: list[Config], failure: CellError | None) -> None:
        """After the cell ran out of memory: one run with each memory fix (`tried`), from
        the state before the cell to one step past the step that failed (the whole cell
        where it has no steps), says whether the fix makes the cell fit, with that run's
        peak memory and time. The kernel then goes back to what the failed run left, as
        the plain cell leaves it."""
        if not tried:
            return
        if self.start_state is None:
            self.hooks.note(
                "the memory fixes were not run: without a snapshot of the state before the "
                "cell, a run with them would not start where the failed run started"
            )
            return
        failed = failure.original if failure is not None else None
        if failed is not None and oom.release_failed_run(failed, self.workload):
            self.hooks.note(
                "to run the memory fixes, the tensors the failed run still held (the locals "
                "of the frames in its traceback, below the cell) were freed; the traceback "
                "still shows where it failed"
            )
        namespace = self.workload.namespace
        try:
            left_by_failure = state.take(namespace, discovery.walk(namespace), self.workload.source)
        except (MemoryError, OSError) as error:  # our snapshot did not fit either
            self.hooks.note(f"the memory fixes were not run: no memory for a snapshot ({error})")
            return
        self.hooks.publish()
        stop = self.trace.count + 1 if self.trace is not None else None
        # the probe's op stream is missing after a failure; a profiler of the user's own is not
        obs = self.obs
        mine = obs.profiler_entries or obs.profiler_at_start
        watch = memory.tracked if mine else memory.profiled
        try:
            for config in tried:
                variant = Variant(fixes=config.ids)
                self.hooks.progress(0.0, f"does it fit with {config.label}?")
                try:
                    run = self.one_run(config, stop=stop, watched=watch(obs.device))
                except CellError as error:
                    variant.fits = False if oom.is_out_of_memory(error.original) else None
                    cause = "still out of memory" if variant.fits is False else "the cell raised"
                    variant.error = f"{cause} with this fix: {figures.error_text(error.original)}"
                except fixes.FixError as error:
                    variant.error = f"the fix could not be applied: {error.reason}"
                else:
                    peak = run.watched.peak if run.watched is not None else None
                    variant.fits, variant.median_s, variant.runs = True, run.total_s, 1
                    variant.peak_memory_bytes = peak.bytes if peak is not None else None
                variant.measured_at = figures.now()
                self.hooks.measured(variant)
                self.hooks.publish()
        finally:
            left_by_failure.restore()

    # one run ----------------------------------------------------------------------------
    def one_run(
        self,
        config: Config,
        observe: Callable[[], Any] | None = None,
        stop: int | None = None,
        watched: AbstractContextManager[Any] | None = None,
    ) -> RunTime:
        """Run the cell once from the start state with the config's fixes applied; with
        `stop`, the run ends after that step (`observe` sees the state there). `watched`
        (peak memory, FLOPs) opens once the start state is back, so what the previous run
        left and the restore frees is not counted against this run. A run to a step that
        is still going when the measurement's deadline has passed stops at the next step
        boundary and raises timing.OutOfTime (a fix that makes the cell far slower than
        foreseen cannot overrun the budget by more than a step).

        A measuring run of a cell whose cost depends on the stack (anomaly detection on)
        executes the cell under the stack a plain run of it has (`plain_stack`)."""
        __tracebackhide__ = True
        if self.start_state is not None:
            self.start_state.restore(written_only=True)
        else:  # no snapshot: each run still starts in the modes the cell started in
            self.start_switches.restore()
        namespace = self.workload.namespace
        source = fixes.combined_source(self.workload.source, config.fixes)
        counter = None
        plan = self.sample
        timed_run = plan is not None and stop == plan.stop  # not a short profiled run
        if stop is not None and plan is not None:
            epoch_end = plan.epoch_end if timed_run else None
            counter = steps.StepCounter(
                plan.source,
                warmup=plan.warmup,
                stop=stop,
                epoch_end=epoch_end,
                give_up_at=self.give_up_at,
            )
        elif stop is not None and self.trace is not None:  # a run to a step, untimed
            counter = steps.StepCounter(
                steps.source_of(self.obs, self.trace),
                stop=stop,
                give_up_at=self.give_up_at,
            )
        with (
            watched or nullcontext() as seen,
            fixes.applied(config.fixes, namespace),
            fixes.combined_context(config.fixes, namespace, in_cell=False),
            silenced(),
            counter.counting() if counter else nullcontext() as times,
        ):
            started, faults = time.perf_counter(), allocator.minor_faults()
            in_cell = fixes.combined_context(config.fixes, namespace, in_cell=True)
            loop_keys = counter.source.loop_keys if counter else frozenset()
            try:
                seconds = self.workload.run(
                    source, self._measuring_stack(config), in_cell, loop_keys
                )
            except steps.StepLimitReached:
                seconds = time.perf_counter() - started
            faults = allocator.minor_faults() - faults
            if times is not None and times.gave_up:
                raise timing.OutOfTime(f"{config.label}: stopped at step {times.count}")
            if observe is not None:
                observe()
        if times is None or plan is None:
            return RunTime(seconds, watched=seen, faults=faults)
        per_epoch = plan.per_epoch if timed_run else None
        step_s = times.per_step(plan.warmup, per_epoch)
        if not times.stopped and times.lead_s is not None and times.count > plan.warmup:
            step_s = (seconds - times.lead_s) / (times.count - plan.warmup)
            self.hooks.warn(
                f"{config.label}: the run ended after {times.count} steps, before step {stop}; "
                "its per-step time includes what runs after the last step"
            )
        restart_s = times.restart(plan.warmup) if per_epoch else None
        return RunTime(seconds, times.lead_s, step_s, seen, faults, restart_s)

    def _measuring_stack(self, config: Config) -> plain_stack.PlainStack | None:
        """The stack a measuring run executes the cell under: the plain cell's where the
        run's cost follows it (anomaly detection, which stores the Python stack with every
        autograd node, seen on in the probe and not turned off by the config's fixes) and a
        stack of its own can be had; else where it stands. (A run on a stack of its own
        pays ~0.1 ms to start it, so runs whose cost does not follow the stack stay.)"""
        obs = self.obs
        follows = bool(obs.forward_with_anomaly or obs.backward_with_anomaly)
        if not follows or any(fix.ends_stack_cost for fix in config.fixes):
            return None
        return self.plain_stack if plain_stack.fresh_stack_available() else None

    def _capture(
        self, outputs: dict[str, numerics.Outputs], label: str, watched: tuple[set[str], dict]
    ) -> None:
        """What the cell produced so far, from a restored start, for numerics."""
        if self.start_state is not None:
            names, modules = watched
            outputs[label] = numerics.capture(self.workload.namespace, names, modules)

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
        a couple of steps where the budget has no room for that (`_profiled_runs`)."""
        sample = self.sample
        if sample is None:
            return None
        return self.profiled_steps or min(sample.stop, steps.PROFILED_STEPS)

    def _profiled_reserve(self, configurations: int, first: RunTime | None) -> float:
        """Seconds to keep for the profiled runs (one per configuration, one for FLOPs)
        where they are cheap enough (at most PROFILED_SHARE of the budget), else for the
        baseline's two (its peak memory and FLOPs); the others run if the rounds leave
        time."""
        guess, most = self._profiled_guess(first), self._plan.profiled_most_s
        for runs in (configurations + 1, 2):
            if runs * guess <= most:
                return runs * guess
        return 0.0

    def _profiled_guess(self, first: RunTime | None) -> float:
        """One profiled run's seconds: the plain run (sampled: its set-up and
        PROFILED_STEPS steps) slowed as much as the probe was slowed by its
        instrumentation."""
        obs = self.obs
        if first is None:
            return obs.wall_s
        sample = self.sample
        if sample is not None and first.lead_s is not None and first.step_s is not None:
            setup = max(0.0, first.lead_s - sample.warmup * first.step_s)
            plain = setup + self._profiled_stop() * first.step_s  # type: ignore[operator]
            probe_step = self.trace.mean_step_s() if self.trace else None
            slowdown = probe_step / first.step_s if probe_step and first.step_s else None
        else:
            plain = first.total_s
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
    rounds = verdict.min_rounds() + 1
    wanted = deadline.seconds + guess * (1 + 2 * rounds)
    return float(5 * math.ceil(wanted / 5))
