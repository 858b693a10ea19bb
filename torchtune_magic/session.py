"""The workflow: probe → detect → measure → finish, and the stack of applied fixes.

A Session lives as long as its panel: toggles call `apply`/`undo`, Re-time calls `measure`.
Findings go to the front end as soon as the checks are done (`on_report`), and each
configuration's numbers as soon as they are measured. Measuring always starts each run from
the state the cell started from (snapshot S0) and ends by putting back a known state; the
cell's one complete run (`finish`) then leaves the kernel as if the cell ran once.

Long cells are sampled (see `engine/steps.py`): the probe stops itself at a step boundary,
every measuring run stops after the same step K, and the report gives per-step times with
the whole cell projected; the complete run happens last, with the fixes asked for.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .checks import Detection, registry
from .engine import (
    allocator,
    codeedit,
    discovery,
    fixes,
    history,
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
from .engine.verdict import Speedup
from .engine.workload import CellError, Workload, captured, silenced
from .options import Options
from .report import (
    CellRun,
    CodeChange,
    MachineLoad,
    NotApplicable,
    NotebookEdits,
    OutOfMemory,
    Report,
    Sampling,
    Stats,
    Variant,
)

BASELINE = "baseline"
SNAPSHOT_SHARE_OF_FREE_MEMORY = 0.5
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
# Our profiler covers the probe's first steps for this long: reading its events back costs
# seconds per few seconds profiled (a 3000-step raw-tensor loop: ~5 s), and a few seconds
# of steps tell the checks the op shares of the cell.
PROFILE_SECONDS = 1.5
# partial reports go to the front end at most this often: each one is serialized, sent
# and redrawn in the browser, on the CPUs the next timed run shares with it
PUBLISH_EVERY_S = 2.0
# page faults the baseline's runs did not all pay, worth more than this share of a run:
# the allocator's state changed under the measurement (said in the report)
ALLOCATOR_DRIFT_SHARE = 0.05
FINISH_PROGRESS_EVERY_S = 0.25
# The budget as a promise (`timing.Deadline`): how it is shared out
COMBINED_SHARE_OF_ROUNDS = 0.35  # kept for the recommended fixes together, once known
PROFILED_SHARE = 0.25  # profiled runs are reserved for only when they cost at most this
BASELINE_ONLY_ROUNDS = 3  # timed runs of a cell with no fix to measure
TRIALS_SHARE = 0.25  # of the budget, for the checks' own trials together
GIVE_UP_AFTER_DEADLINE_S = 1.0  # a run to a step still going this long past the deadline stops

# Where the kernel stands relative to the contract "as if the cell ran once"
AFTER_ONE_RUN = "after one run"
BEFORE_CELL = "before the cell"
PART_RUN = "part of a run"  # the probe was stopped early


@dataclass
class _Config:
    """One configuration to measure: a label and the fixes it applies."""

    label: str
    fixes: list[fixes.Fix]

    @property
    def ids(self) -> list[str]:
        return sorted(f.check_id for f in self.fixes)


@dataclass
class _RunTime:
    """One measuring run: its seconds and, when sampled, the time to the end of the warm-up
    steps and the mean time per timed step."""

    total_s: float
    lead_s: float | None = None
    step_s: float | None = None
    watched: Any = None  # what the run's `watched` context gave (a memory Profile, …)
    faults: int = 0  # minor page faults during the run
    restart_s: float | None = None  # an epoch restart's cost, where the timed steps held one


@dataclass
class _Measuring:
    """Everything one measurement gathers: each configuration's variant, its first run and
    later runs, what the cell produced (numerics) and the paired rounds (with each run's
    wall time, to foresee whether the next one fits the deadline)."""

    configs: list[_Config]
    watched: tuple[set[str], dict[str, torch.nn.Module]]
    results: dict[str, Variant] = field(default_factory=dict)
    outputs: dict[str, numerics.Outputs] = field(default_factory=dict)
    firsts: dict[str, _RunTime] = field(default_factory=dict)
    later: dict[str, list[_RunTime]] = field(default_factory=dict)
    runnable: list[_Config] = field(default_factory=list)
    baseline_runs: list[_RunTime] = field(default_factory=list)
    rounds: timing.Rounds = field(default_factory=lambda: timing.Rounds(BASELINE))

    def __post_init__(self) -> None:
        for config in self.configs:
            self.results.setdefault(config.label, Variant(fixes=config.ids))
            self.later.setdefault(config.label, [])

    def add(self, config: _Config) -> None:
        self.configs.append(config)
        self.__post_init__()


class Session:
    """One %%perfcheck run and everything done with its result afterwards."""

    def __init__(
        self,
        workload: Workload,
        options: Options | None = None,
        progress: timing.Progress | None = None,
        on_report: Callable[[Report], None] | None = None,
    ):
        self.workload = workload
        self.options = options or Options()
        self.progress = progress
        self.on_report = on_report
        self.run_id = uuid.uuid4().hex[:12]
        self.observation: probe.Observation | None = None
        self.detections: list[Detection] = []
        self.not_applicable: list[NotApplicable] = []
        self.warnings: list[str] = []
        self.report: Report | None = None
        self.step_trace: probe.StepTrace | None = None
        self.step_count: steps.StepCount | None = None
        self.plan: steps.SamplePlan | None = None  # set once the first measurement samples
        self.cell_run: CellRun | None = None
        self._plan_decided = False  # whether to sample is decided once per session
        self._plan_calibrated = False
        self._cell_names: set[str] = set()  # names the cell (re)binds
        self.oom: OutOfMemory | None = None  # the cell ran out of memory in the probe
        self._out_of_memory: CellError | None = None
        self._kernel = AFTER_ONE_RUN
        self._history: list[Variant] = []  # every finished measurement's variants, in order
        self._start_state: state.Snapshot | None = None
        self._start_switches = state.TorchSwitches.capture()  # taken again by the probe
        # the stack a plain run of the cell would execute under: timed runs of a cell whose
        # cost depends on it execute there (`_measuring_stack`)
        self._plain_stack = plain_stack.PlainStack.of_caller()
        self._applied: dict[str, fixes.Fix] = {}
        self._flops: utilisation.FlopCount | None = None  # counted once: fixes keep the math
        self._flops_detail: str | None = None
        self._memory_label: str | None = None
        self._published_at = 0.0
        # each fix's one-time cost the first time it ran alone (its artifacts, such as a
        # compiled module, are cached on the fix, so a later set with it pays nothing again)
        self._first_costs: dict[str, float] = {}
        # notebook edits by the fix ids they are for (they change only with the applied set)
        self._notebook_edits: dict[tuple[str, ...], NotebookEdits | None] = {}
        # the budget as a promise: set when the probe is done (the checks' trials and the
        # first measurement count against it; the probe is bounded by a share of it); a
        # later Re-time gets a budget of its own
        self._deadline: timing.Deadline | None = None
        self._load: MachineLoad | None = None  # other processes' CPU time, last measurement
        # what the probe's run changed that no restore puts back (a generator advanced, a
        # file written): the cell is then not run again, and these say why
        self._one_way: list[str] = []
        self._profiled_steps: int | None = None  # where the profiled runs stop (sampled)
        self._give_up_at: float | None = None  # a run to a step past this stops (measuring)

    # the one-shot flow ----------------------------------------------------------------------
    def run(self) -> Report:
        """Probe, detect (findings go out at once), measure, apply `--apply` fixes, then the
        cell's complete run. The cell's own exception propagates (as CellError); Ctrl-C
        propagates after the report says where it stopped."""
        __tracebackhide__ = True
        self.probe()
        self._deadline = timing.Deadline(self.options.budget)
        self.detect()
        if self._out_of_memory is not None:  # a report on what happened, then the traceback
            self.cell_run = CellRun("failed", detail=self.oom.error if self.oom else None)
            with self._interrupt_said():
                self._measure_fits()
            self.publish(self._build_report(phase="done"))
            raise self._out_of_memory
        self.publish(self._build_report(phase="measuring"))
        with self._interrupt_said():
            report = self.measure()
        if not self.options.finish:  # before --apply: its fixes then stay on that state
            self._back_to_start()
        for check_id in self._requested_fixes(report):
            try:
                self._apply(check_id)
            except fixes.FixError as error:
                self.warnings.append(f"--apply {check_id}: not applied: {error.reason}")
        self.finish()
        return self.report or report

    @contextmanager
    def _interrupt_said(self) -> Iterator[None]:
        """Ctrl-C while measuring: the report out so far says it was interrupted."""
        try:
            yield
        except KeyboardInterrupt:
            if self.report is not None:
                self.report.phase = "interrupted"
                self.publish(self.report)
            raise

    def probe(self) -> probe.Observation:
        """The instrumented run. A long cell's probe stops at a step boundary after a share of
        the budget; what it printed is shown only when it ran the whole cell (else the cell's
        complete run prints it, once)."""
        __tracebackhide__ = True
        namespace = self.workload.namespace
        self._start_switches = state.TorchSwitches.capture()
        if self.options.restore:
            found = discovery.walk(namespace)
            needed = state.estimate_bytes(found)
            free = state.available_memory_bytes()
            if free is not None and needed > SNAPSHOT_SHARE_OF_FREE_MEMORY * free:
                self.warnings.append(
                    f"state not restored: a snapshot would need {needed / 2**30:.1f} GiB of "
                    f"{free / 2**30:.1f} GiB free host memory, so the extra measuring runs have "
                    "changed the model/optimizer state; re-run the cells that set them up"
                )
            else:
                self._start_state = state.take(namespace, found, self.workload.source)
        device = self.options.device or "cpu"
        low, high = PROBE_SECONDS
        stop_after: float | None = min(high, max(low, PROBE_SHARE_OF_BUDGET * self.options.budget))
        if self._start_state is not None and self._start_state.reaches_one_way_state:
            # a generator, iterator or file the cell could advance: if it does, no restore
            # puts it back, and the probe must then be the cell's one complete run
            stop_after = None
        failed: CellError | None = None
        with captured() as printed:
            try:
                self.observation = probe.run(
                    self.workload, device, stop_after_s=stop_after, profile_for_s=PROFILE_SECONDS
                )
            except CellError as error:
                failed = error
        if failed is not None:
            sys.stdout.write(printed.getvalue())  # what the cell printed before it raised
            if failed.observation is None or not oom.is_out_of_memory(failed.original):
                raise failed
            # out of memory: findings from what the probe saw, memory fixes first
            self.observation, self._out_of_memory = failed.observation, failed
            if self.options.device is None and (
                _uses_cuda(self.observation)
                or (
                    isinstance(failed.original, torch.OutOfMemoryError)
                    and torch.cuda.is_available()
                )
            ):
                device = self.observation.device = "cuda"
            self.oom = oom.describe(failed.original, self.workload, device)
            self.observation.memory_asked = self.observation.out_of_memory = True
            self._kernel = PART_RUN
            self.step_trace = self.observation.leading_step()
            return self.observation
        obs = self.observation
        if self._start_state is not None:
            self._start_state.note_unwritten()
            self._one_way = self._start_state.unrestorable_changes()
            for line in self._start_state.not_covered:
                self._warn_once(line)
        if self._one_way:
            self._warn_once(
                "not measured: the cell changed what no restore can put back — "
                + "; ".join(self._one_way)
                + " — so running it again would change what you see: it ran once (the "
                "probe, whose findings are below) and nothing was timed"
            )
        if obs.stopped_early:
            self._kernel = PART_RUN
        else:
            sys.stdout.write(printed.getvalue())
        if self._start_state is not None:
            start = self._start_state.bindings
            self._cell_names = {
                name
                for name, value in namespace.items()
                if not name.startswith("_") and start.get(name, _MISSING) is not value
            }
        obs.memory_asked = self.options.memory
        if self.options.device is None and _uses_cuda(obs):
            obs.device = "cuda"
        self.step_trace = obs.leading_step()
        if self.step_trace is not None:
            self.step_count = steps.count_steps(obs, self.step_trace)
        return obs

    def detect(self) -> list[Detection]:
        """Run every check wanted on the probe's observation. Their trials (worker counts,
        thread counts, plain runs) share TRIALS_SHARE of the budget: they come out of it."""
        obs = self._observed()
        # a cell that changed what no restore can put back is not run again, trials included
        obs.trials_s = 0.0 if self._one_way else TRIALS_SHARE * self.options.budget
        self.detections, self.not_applicable = [], []
        for check in registry.all_checks():
            if not self.options.wants(check.id):
                continue
            reason = check.not_applicable(obs)
            if reason is not None:
                self.not_applicable.append(NotApplicable(check.id, reason))
                continue
            self.detections.extend(check.detect(obs))
        self._attach_cell_changes()
        return self.detections

    def finish(self) -> None:
        """The cell's one complete run, after the report is out, unless the probe already
        was one; with `--no-finish` the kernel goes back to before the cell instead.

        It runs with the fixes applied now (`--apply`), prints what the cell prints, and
        shows its progress by steps. Ctrl-C stops it as it would stop the plain cell (the
        fixes asked for stay applied, nothing else of ours is); a cell that raises gets its
        own traceback, the report stays."""
        __tracebackhide__ = True
        ids = self.applied_ids
        if not self.options.finish:
            self._back_to_start()
            self._finished(CellRun("skipped", fixes=ids, detail="--no-finish: kernel as before"))
            return
        if self._kernel == AFTER_ONE_RUN:
            steps_done = self.step_count.total if self.step_count else None
            self._finished(CellRun("probe", steps=steps_done, fixes=ids))
            return
        self._back_to_start()
        self.cell_run = CellRun("running", fixes=ids)
        self.publish(self._build_report(phase="finishing"))
        applied = [self._applied[i] for i in ids]
        counter = self._finish_counter()
        started = time.perf_counter()
        try:
            with (
                counter.counting() if counter else nullcontext(),
                fixes.combined_context(applied, self.workload.namespace),
            ):
                self._kernel = PART_RUN
                seconds = self.workload.run(
                    fixes.combined_source(self.workload.source, applied),
                    loop_keys=counter.source.loop_keys if counter else frozenset(),
                )
        except (KeyboardInterrupt, CellError) as error:
            done = counter.times.count if counter else None
            interrupted = isinstance(error, KeyboardInterrupt)
            detail = "stopped by Ctrl-C" if interrupted else _error_text(error)
            self.cell_run = CellRun(
                "interrupted" if interrupted else "failed",
                time.perf_counter() - started,
                done,
                ids,
                detail,
            )
            self.publish(self._build_report(phase="done"))
            raise
        self._kernel = AFTER_ONE_RUN
        count = counter.times.count if counter else None
        if count and self.step_count is not None and self.step_count.total is None:
            self.step_count = steps.StepCount(count, "counted in the cell's complete run")
        self._finished(CellRun("complete", seconds, count, ids))

    def _back_to_start(self) -> None:
        """Put the kernel back as it was before the cell (where a snapshot was taken)."""
        if self._start_state is not None and self._kernel != BEFORE_CELL:
            self._start_state.restore()
            self._kernel = BEFORE_CELL

    def _finished(self, cell_run: CellRun) -> None:
        self.cell_run = cell_run
        self.publish(self._build_report(phase="done"))

    def _finish_counter(self) -> steps.StepCounter | None:
        """Counts the complete run's steps to show "finishing the cell: step 130 of 480"."""
        if self.step_trace is None:
            self._report_progress(0.0, "finishing the cell")
            return None
        total = self.step_count.total if self.step_count else None
        shown = {"at": 0.0}

        def on_step(count: int) -> None:
            now = time.perf_counter()
            if now - shown["at"] < FINISH_PROGRESS_EVERY_S:
                return
            shown["at"] = now
            of = f" of {total}" if total else ""
            fraction = min(1.0, count / total) if total else 0.0
            self._report_progress(fraction, f"finishing the cell: step {count}{of}")

        return steps.StepCounter(
            steps.source_of(self._observed(), self.step_trace), on_step=on_step
        )

    # fixes ----------------------------------------------------------------------------------
    @property
    def applied_ids(self) -> list[str]:
        return sorted(self._applied)

    def fix_for(self, check_id: str) -> fixes.Fix:
        for detection in self.detections:
            if detection.finding.id == check_id and detection.fix is not None:
                return detection.fix
        raise KeyError(f"no live fix for {check_id!r} in this report")

    def apply(self, check_id: str) -> None:
        """Apply a fix to the live objects and publish the report with it applied. Raises
        FixError with nothing left applied, e.g. when a name the fix changes was rebound
        since the probe ran (the user's new object is never replaced)."""
        self._apply(check_id)
        self._publish_applied()

    def undo(self, check_id: str) -> list[str]:
        """Undo a fix and publish the report without it. Returns (and keeps as warnings)
        notes on places the user rebound while it was applied: those keep the user's object."""
        notes = self._undo(check_id)
        self._publish_applied()
        return notes

    def revert_all(self) -> list[str]:
        """Undo every applied fix (panel's Revert all, `%perfcheck revert`); notes as `undo`."""
        notes = [note for check_id in reversed(self.applied_ids) for note in self._undo(check_id)]
        self._publish_applied()
        return notes

    def _apply(self, check_id: str) -> None:
        fix = self.fix_for(check_id)
        fix.apply(self.workload.namespace)
        self._applied[check_id] = fix

    def _undo(self, check_id: str) -> list[str]:
        fix = self._applied.pop(check_id, None)
        notes = fix.undo() if fix is not None else []
        for note in notes:
            self._warn_once(note)
        return notes

    def _publish_applied(self) -> None:
        """The saved report follows the applied state: republish the current report (its
        numbers as they stand) with `applied` as it is now."""
        if self.report is not None:
            self.publish(self._build_report(phase=self.report.phase))

    @property
    def fixable(self) -> list[Detection]:
        return [d for d in self.detections if d.fix is not None]

    def wins(self, report: Report | None = None) -> list[str]:
        """Fixes whose own newest measurement was clearly faster (its interval above 1, past
        the no-change band, without error) and left what the cell produced bit-identical:
        `--apply wins` never changes results silently (amp, tf32 and the like are applied
        by name)."""
        return [
            variant.fixes[0]
            for variant in self._solo_variants(report)
            if variant.is_win and variant.numerics.verdict == "identical"
        ]

    def recommended(self, variants: list[Variant] | None = None) -> list[str]:
        """Fixes whose own newest measurement was clearly faster with results identical or
        within the fix's stated tolerance: what the combined row, `--apply all`, the code
        changes and Apply to notebook carry by default. Others are opt-in, their verdict
        beside them."""
        chosen = []
        for variant in self._solo_variants(None, variants):
            if variant.is_win and variant.numerics.verdict in ("identical", "close"):
                chosen.append(variant.fixes[0])
        return chosen

    def _solo_variants(
        self, report: Report | None, variants: list[Variant] | None = None
    ) -> list[Variant]:
        """The newest solo measurement of each fixable finding, in finding order."""
        if variants is None:
            report = report or self.report
            variants = report.variants if report is not None else []
        newest = {tuple(v.fixes): v for v in variants}
        return [newest[(d.finding.id,)] for d in self.fixable if (d.finding.id,) in newest]

    def _requested_fixes(self, report: Report) -> list[str]:
        """`--apply IDS|all|wins`, as fix ids found in this cell: ids as named, `all` the
        recommended fixes, `wins` the clear wins with identical results."""
        wanted = set(self.options.apply)
        if "wins" in wanted:
            wanted.update(self.wins(report))
        if "all" in wanted:
            wanted.update(self.recommended(report.variants))
        return [d.finding.id for d in self.fixable if d.finding.id in wanted]

    def suggested_cell(self) -> str:
        """The cell with the code changes of the fixes applied now (of the recommended
        ones, when none is)."""
        return self.optimized_cell(self.applied_ids or self.recommended())

    def optimized_cell(self, check_ids: list[str] | None = None) -> str:
        """The cell with the code changes of these findings (default: all) applied."""
        versions = [
            d.fixed_source
            for d in self.detections
            if d.fixed_source is not None and (check_ids is None or d.finding.id in check_ids)
        ]
        return codeedit.combine(self.workload.source, versions)

    def notebook_edits(self) -> NotebookEdits | None:
        """Every notebook cell to edit for the fixes applied now (for the recommended ones,
        when none is): the earlier cells that built the objects and the checked cell,
        several fixes' edits of one cell in one entry. None when no cell changes."""
        chosen = [d for d in self._chosen() if d.fixed_source is not None or d.earlier]
        key = tuple(d.finding.id for d in chosen)
        if key not in self._notebook_edits:
            cells = history.cell_changes(
                self.workload,
                [d.fixed_source for d in chosen if d.fixed_source is not None],
                [edit for d in chosen for edit in d.earlier],
            )
            self._notebook_edits[key] = NotebookEdits(list(key), cells) if cells else None
        return self._notebook_edits[key]

    def cell_to_insert(self) -> tuple[str, list[history.Rebuild], list[tuple[str, str]]]:
        """What `%perfcheck insert` puts below: the suggested cell as typed, preceded by the
        earlier cells' statements that rebuild the loaders and optimizers the fixes change
        (the live fixes do not outlive the kernel; these lines carry the biggest wins).
        Returns the cell, those rebuilds, and (fix id, what to edit by hand) for changes a
        statement cannot carry (a model's convs: rebuilding the model resets its weights)."""
        typed = history.as_typed(self.workload, self.suggested_cell()).splitlines(keepends=True)
        body = "".join(typed[next((i for i, t in enumerate(typed) if t.strip()), 0) :])
        edits = [(d.finding.id, edit) for d in self._chosen() for edit in d.earlier]
        rebuilt, left = history.rebuilds(self.workload.notebook, edits)
        head = [
            f"# from In[{r.execution_count}] with {', '.join(r.fixes)}:\n{r.text}\n"
            for r in rebuilt
        ]
        cell = "".join(head) + ("\n" if head else "") + body
        by_hand = [(check, f"In[{edit.execution_count}] line {edit.line}") for check, edit in left]
        return cell, rebuilt, by_hand

    def _chosen(self) -> list[Detection]:
        """The detections whose changes count now: the applied fixes', else the recommended
        ones' (none before they are measured: a finding's own change is offered with it)."""
        chosen = set(self.applied_ids) or set(self.recommended(self._history))
        return [d for d in self.detections if d.finding.id in chosen]

    def _attach_cell_changes(self) -> None:
        """Each finding's own notebook cells to edit (`code_change.cells`)."""
        for detection in self.detections:
            versions = [detection.fixed_source] if detection.fixed_source is not None else []
            cells = history.cell_changes(self.workload, versions, detection.earlier)
            if not cells:
                continue
            if detection.finding.code_change is None:
                detection.finding.code_change = CodeChange()
            detection.finding.code_change.cells = cells

    # measuring ------------------------------------------------------------------------------
    def measure(
        self, fix_sets: list[list[str]] | None = None, *, budget_s: float | None = None
    ) -> Report:
        """Time the baseline against fix sets (default: each fix alone, then the recommended
        ones together) in paired rounds, within `budget_s` counted from now (default: what
        is left of the run's budget, which the checks have drawn on). Applied
        fixes are lifted for the duration and put back after. Earlier measurements stay in
        the report; each variant says when it was taken and against which baseline."""
        __tracebackhide__ = True
        deadline = self._measuring_deadline(budget_s)
        if self._one_way:  # a run more would change what the user sees: none is made
            self.publish(self._build_report(deadline=deadline, phase="measuring"))
            return self.report  # type: ignore[return-value]  # set by publish
        configs = self._configs(fix_sets)
        combine = fix_sets is None and not self.options.quick and len(configs) > 2
        with self._fixes_lifted(), self._state_kept(), self._load_watched():
            variants, baseline = self._measure_configs(configs, deadline, combine)
        measured_at = _now()
        for variant in [baseline, *variants]:
            variant.measured_at = measured_at
        self._history.extend(variants)
        # a re-time after the cell's complete run is done; the first measurement is not
        phase = "done" if self.cell_run is not None else "measuring"
        self.publish(self._build_report(baseline, deadline=deadline, phase=phase))
        return self.report  # type: ignore[return-value]  # set by publish

    def _measuring_deadline(self, budget_s: float | None) -> timing.Deadline:
        """The run's own deadline for its first measurement (the probe and the checks spent
        part of it); a fresh one for a Re-time or an explicit budget."""
        if budget_s is None and self._deadline is not None and not self._history:
            return self._deadline
        return timing.Deadline(budget_s or self.options.budget)

    @contextmanager
    def _load_watched(self) -> Iterator[None]:
        """What other processes ran on this kernel's CPUs while measuring (`load`): the
        rounds pair each fix with a baseline run taken back to back, so speedups hold on a
        busy machine, but their intervals widen and the times per run grow."""
        start = load.reading()
        try:
            yield
        finally:
            end = load.reading()
            seen = load.between(start, end) if start and end else None
            self._load = None
            if seen is not None:  # the report says it when it is more than a trace
                self._load = MachineLoad(seen.window_s, seen.other_cpu_s, seen.cpus)

    def _measure_fits(self) -> None:
        """After the cell ran out of memory: one run with each memory fix, from the state
        before the cell to one step past the step that failed (the whole cell where it has
        no steps), says whether the fix makes the cell fit, with that run's peak memory and
        time. The kernel then goes back to what the failed run left, as the plain cell
        leaves it."""
        obs = self._observed()
        tried = [d for d in self.fixable if obs.device in d.fix.cuts_memory_on]
        if not tried:
            return
        if self._start_state is None:
            self.warnings.append(
                "the memory fixes were not run: without a snapshot of the state before the "
                "cell, a run with them would not start where the failed run started"
            )
            return
        failed = self._out_of_memory.original if self._out_of_memory is not None else None
        if failed is not None and oom.release_failed_run(failed, self.workload):
            self.warnings.append(
                "to run the memory fixes, the tensors the failed run still held (the locals "
                "of the frames in its traceback, below the cell) were freed; the traceback "
                "still shows where it failed"
            )
        namespace = self.workload.namespace
        try:
            left_by_failure = state.take(namespace, discovery.walk(namespace), self.workload.source)
        except (MemoryError, OSError) as error:  # our snapshot did not fit either
            self.warnings.append(
                f"the memory fixes were not run: no memory for a snapshot ({error})"
            )
            return
        self.publish(self._build_report(phase="measuring"))
        stop = self.step_trace.count + 1 if self.step_trace is not None else None
        # the probe's op stream is missing after a failure; a profiler of the user's own is not
        mine = obs.profiler_entries or obs.profiler_at_start
        watch = memory.tracked if mine else memory.profiled
        try:
            for detection in tried:
                config = _Config(detection.finding.id, [detection.fix])
                variant = Variant(fixes=config.ids)
                self._report_progress(0.0, f"does it fit with {config.label}?")
                try:
                    run = self._one_run(config, stop=stop, watched=watch(obs.device))
                except CellError as error:
                    variant.fits = False if oom.is_out_of_memory(error.original) else None
                    cause = "still out of memory" if variant.fits is False else "the cell raised"
                    variant.error = f"{cause} with this fix: {_error_text(error.original)}"
                except fixes.FixError as error:
                    variant.error = f"the fix could not be applied: {error.reason}"
                else:
                    peak = run.watched.peak if run.watched is not None else None
                    variant.fits, variant.median_s, variant.runs = True, run.total_s, 1
                    variant.peak_memory_bytes = peak.bytes if peak is not None else None
                variant.measured_at = _now()
                self._history.append(variant)
                self.publish(self._build_report(phase="measuring"))
        finally:
            left_by_failure.restore()

    def publish(self, report: Report) -> None:
        """Hand a report to the front end and keep it as the current one; a final one (done
        or interrupted) also goes to `--json`."""
        self.report = report
        self._published_at = time.perf_counter()
        if self.options.json and report.phase in ("done", "interrupted"):
            report.write_json(self.options.json)
        if self.on_report is not None:
            self.on_report(report)

    def _configs(self, fix_sets: list[list[str]] | None) -> list[_Config]:
        """The baseline and the fix sets: by default each fix alone (the recommended ones
        together are added once those have a verdict: `_measure_configs`); with `--quick`,
        all fixes together only."""
        if fix_sets is None:
            every = [d.finding.id for d in self.fixable]
            fix_sets = [every] if self.options.quick and every else [[i] for i in every]
        configs = [_Config(BASELINE, [])]
        for ids in fix_sets:
            label = "+".join(sorted(ids))
            if label and label not in {c.label for c in configs}:
                configs.append(_Config(label, [self.fix_for(i) for i in ids]))
        return configs

    @contextmanager
    def _fixes_lifted(self) -> Iterator[None]:
        lifted = self.applied_ids
        for check_id in reversed(lifted):
            self._undo(check_id)
        try:
            yield
        finally:
            for check_id in lifted:
                try:
                    self._apply(check_id)
                except fixes.FixError as error:
                    self.warnings.append(f"could not re-apply {check_id}: {error.reason}")

    @contextmanager
    def _state_kept(self) -> Iterator[None]:
        """Whatever happens while measuring, the kernel ends as it was — with what the user
        did since the cell ran — except for a probe's leftovers from part of a run, which
        give way to the state before the cell (the complete run starts from there). Without
        a snapshot, torch's global modes still go back (they cost nothing to keep)."""
        if self._start_state is None:
            switches = state.TorchSwitches.capture()
            try:
                yield
            finally:
                switches.restore()
            return
        current = None
        if self._kernel != PART_RUN:
            namespace = self.workload.namespace
            current = state.take(namespace, discovery.walk(namespace), self.workload.source)
        try:
            yield
        finally:
            self._note_unseen_writes()
            if current is not None:
                current.restore()
            else:
                self._start_state.restore()
                self._kernel = BEFORE_CELL

    def _note_unseen_writes(self) -> None:
        """Say so when a measuring run wrote a tensor the probe had left as it was, in a way
        torch does not see: the restores between runs passed over it (`Snapshot.
        note_unwritten`), so the runs after that write started from its changed values."""
        if self._start_state is None:
            return
        for label in self._start_state.written_unseen_objects():
            self._warn_once(
                f"a measuring run changed `{label}` in place in a way the restores between "
                "runs passed over (its length and ends unchanged), so the runs after it "
                "started from the changed contents; it is back as it was now"
            )
        changed = self._start_state.written_unseen()
        if changed:
            shapes = ", ".join(str(tuple(t.shape)) for t in changed[:3])
            self._warn_once(
                f"a measuring run wrote {len(changed)} tensor(s) of shape {shapes} that the "
                "probe's run had left as they were, in a way torch does not see (through "
                "`.data` or numpy), so the runs after it started from the changed values; "
                "they are back as they were now"
            )

    def _one_run(
        self,
        config: _Config,
        observe: Callable[[], Any] | None = None,
        stop: int | None = None,
        watched: AbstractContextManager[Any] | None = None,
    ) -> _RunTime:
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
        if self._start_state is not None:
            self._start_state.restore(written_only=True)
        else:  # no snapshot: each run still starts in the modes the cell started in
            self._start_switches.restore()
        namespace = self.workload.namespace
        source = fixes.combined_source(self.workload.source, config.fixes)
        counter = None
        plan = self.plan
        timed_run = plan is not None and stop == plan.stop  # not a short profiled run
        if stop is not None and plan is not None:
            epoch_end = plan.epoch_end if timed_run else None
            counter = steps.StepCounter(
                plan.source,
                warmup=plan.warmup,
                stop=stop,
                epoch_end=epoch_end,
                give_up_at=self._give_up_at,
            )
        elif stop is not None and self.step_trace is not None:  # a run to a step, untimed
            counter = steps.StepCounter(
                steps.source_of(self._observed(), self.step_trace),
                stop=stop,
                give_up_at=self._give_up_at,
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
        if times is None or self.plan is None:
            return _RunTime(seconds, watched=seen, faults=faults)
        per_epoch = self.plan.per_epoch if timed_run else None
        step_s = times.per_step(self.plan.warmup, per_epoch)
        if not times.stopped and times.lead_s is not None and times.count > self.plan.warmup:
            step_s = (seconds - times.lead_s) / (times.count - self.plan.warmup)
            self._warn_once(
                f"{config.label}: the run ended after {times.count} steps, before step {stop}; "
                "its per-step time includes what runs after the last step"
            )
        restart_s = times.restart(self.plan.warmup) if per_epoch else None
        return _RunTime(seconds, times.lead_s, step_s, seen, faults, restart_s)

    def _measuring_stack(self, config: _Config) -> plain_stack.PlainStack | None:
        """The stack a measuring run executes the cell under: the plain cell's where the
        run's cost follows it (anomaly detection, which stores the Python stack with every
        autograd node, seen on in the probe and not turned off by the config's fixes) and a
        stack of its own can be had; else where it stands. (A run on a stack of its own
        pays ~0.1 ms to start it, so runs whose cost does not follow the stack stay.)"""
        obs = self.observation
        follows = obs is not None and bool(obs.forward_with_anomaly or obs.backward_with_anomaly)
        if not follows or any(fix.ends_stack_cost for fix in config.fixes):
            return None
        return self._plain_stack if plain_stack.fresh_stack_available() else None

    def _sample_plan(self, configurations: int, budget_s: float) -> steps.SamplePlan | None:
        """Whether to stop every run at a step, and where first (the baseline's first run
        then calibrates the stop: `_calibrate`). Decided once per session, so a later
        re-time compares like with like."""
        if self._plan_decided:
            return self.plan
        self._plan_decided = True
        obs, trace = self._observed(), self.step_trace
        if trace is None:
            return None
        total = self.step_count.total if self.step_count else None
        depth = self._prefetch_depth()
        warmup = steps.warmup_for(total if total is not None else trace.count, depth)
        min_timed = max(steps.MIN_TIMED_STEPS, depth)
        if total is not None and total < warmup + min_timed + 1:
            return None
        if not obs.stopped_early:
            plain = obs.wall_s / PROBE_SLOWDOWN
            if not steps.worth_sampling(plain, configurations, budget_s):
                return None
        step_s = trace.mean_step_s() or obs.wall_s
        lead_s = (trace.first_s or step_s) + (warmup - 1) * step_s
        per_epoch = steps.batches_per_epoch(trace)
        settle = max(steps.MIN_TIMED_STEPS, depth)
        if steps.has_epochs(per_epoch, total):  # room for an epoch restart in the timed steps
            min_timed = steps.MIN_TIMED_STEPS + settle
        else:
            per_epoch = None
        stop = steps.choose_stop(budget_s, configurations, lead_s, step_s, warmup, total, min_timed)
        source = steps.source_of(obs, trace)
        self.plan = steps.SamplePlan(source, warmup, stop, min_timed, per_epoch, settle)
        return self.plan

    def _prefetch_depth(self) -> int:
        """The deepest prefetch of a DataLoader with workers in play: the user's own (the
        cell's step source) or one a fix builds."""
        own = 0
        trace = self.step_trace
        if trace is not None and trace.unit == "batch":
            own = steps.prefetch_depth(trace.obj.num_workers, trace.obj.prefetch_factor)
        return max([own, *(d.fix.warmup_steps for d in self.fixable if d.fix is not None)])

    def _calibrate(self, first: _RunTime, configurations: int, budget_s: float) -> None:
        """Set the stop step from the baseline's first uninstrumented run, so that the
        timed rounds fit in `budget_s` once the profiled runs are paid for."""
        plan = self.plan
        self._plan_calibrated = True
        if plan is None or first.lead_s is None or first.step_s is None:
            return
        total = self.step_count.total if self.step_count else None
        left = budget_s - self._profiled_reserve(configurations, first)
        stop = steps.choose_stop(
            left, configurations, first.lead_s, first.step_s, plan.warmup, total, plan.min_timed
        )
        self.plan = replace(plan, stop=stop)

    def _measure_configs(
        self, configs: list[_Config], deadline: timing.Deadline, combine: bool
    ) -> tuple[list[Variant], Variant]:
        """First runs, paired rounds, then the recommended fixes together (with `combine`),
        then the profiled runs (peak memory, FLOPs) — each only where the deadline leaves
        room for it; what did not fit says what `--budget` would have measured it."""
        planned = len(configs) + (1 if combine else 0)
        self._sample_plan(planned, deadline.left())
        self._give_up_at = deadline.start + deadline.seconds + GIVE_UP_AFTER_DEADLINE_S
        try:
            return self._measured(configs, deadline, combine, planned)
        finally:
            self._give_up_at = None

    def _measured(
        self, configs: list[_Config], deadline: timing.Deadline, combine: bool, planned: int
    ) -> tuple[list[Variant], Variant]:
        measuring = _Measuring(configs, self._watched_outputs())
        self._first_runs(measuring, deadline, planned)
        reserve = self._profiled_reserve(len(measuring.runnable), measuring.firsts.get(BASELINE))
        rounds_deadline = timing.Deadline(max(0.0, deadline.seconds - reserve), deadline.start)
        if combine:  # the fixes alone first, leaving room for the recommended ones together
            left = rounds_deadline.left()
            alone = rounds_deadline.spent + (1 - COMBINED_SHARE_OF_ROUNDS) * left
            self._rounds(measuring, timing.Deadline(alone, rounds_deadline.start))
            together = self._combined_config(measuring)
            if together is not None:
                measuring.add(together)
                self._first_runs(measuring, rounds_deadline, planned, only=[together])
        self._rounds(measuring, rounds_deadline)
        self._profiled_runs(measuring, deadline)
        self._note_allocator_drift(measuring.configs, measuring.baseline_runs)
        return self._conclude(measuring, deadline)

    def _first_runs(
        self,
        measuring: _Measuring,
        deadline: timing.Deadline,
        planned: int,
        only: list[_Config] | None = None,
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
                results[label].budget_to_tell_s = self._budget_for(deadline, guess)
                if label == BASELINE:  # nothing to stand a fix against: none runs
                    for other in measuring.configs[1:]:
                        results[other.label].budget_to_tell_s = self._budget_for(deadline, guess)
                    self._warn_once(
                        f"nothing was timed: a run of the cell takes about {_seconds(guess)} "
                        f"and the checks left {_seconds(deadline.left())} of the "
                        f"{_seconds(deadline.seconds)} budget; "
                        f"`--budget {results[BASELINE].budget_to_tell_s:.0f}` would"
                    )
                    return
                continue
            self._report_progress(deadline.spent / deadline.seconds, f"first run: {label}")
            started = time.perf_counter()
            with (
                self._failures_noted(config, results[label]),
                self._out_of_time(measuring, config, deadline, started),
            ):
                if label == BASELINE and self.plan is not None and not self._plan_calibrated:
                    first = self._one_run(config, stop=self._stop())
                    measuring.firsts[BASELINE] = first
                    self._calibrate(first, planned, deadline.left())
                    started = time.perf_counter()
                value = self._timed_run(measuring, config)
                if not any(f.one_time_cause for f in config.fixes):  # what a round will take
                    wall = time.perf_counter() - started
                    measuring.rounds.walls.setdefault(label, []).append(wall)
                measuring.runnable.append(config)
                if self.plan is not None:  # sampled: the first run is timed like any
                    first_round[label] = value
                    _fill(results[label], timing.Measurement(label, [value]))
            self._publish_partial(measuring, deadline)
            if BASELINE not in measuring.firsts:  # nothing to stand a fix against
                return
        if first_round:
            if only and measuring.rounds.rounds:  # a late configuration: not a round of its own
                measuring.rounds.rounds[-1].update(first_round)
            else:
                measuring.rounds.rounds.append(first_round)

    @contextmanager
    def _out_of_time(
        self, measuring: _Measuring, config: _Config, deadline: timing.Deadline, started: float
    ) -> Iterator[None]:
        """A first run stopped at the deadline: the configuration is not measured, and the
        report says what budget would have had room for it."""
        try:
            yield
        except timing.OutOfTime:
            taken = time.perf_counter() - started
            measuring.results[config.label].budget_to_tell_s = self._budget_for(deadline, taken)
            self._warn_once(
                f"{config.label}: a run did not finish within the budget (stopped after "
                f"{_seconds(taken)}), so it was not measured"
            )

    def _timed_run(self, measuring: _Measuring, config: _Config) -> float:
        """One run of the configuration; the first captures what the cell produced
        (numerics). Returns its time: the whole run, or per step when sampled."""
        label = config.label
        observe = None
        if label not in measuring.outputs:
            observe = functools.partial(self._capture, measuring.outputs, label, measuring.watched)
        run = self._one_run(config, observe, self._stop())
        if label == BASELINE:
            measuring.baseline_runs.append(run)
        if label not in measuring.firsts:
            measuring.firsts[label] = run
        else:
            measuring.later[label].append(run)
        if self.plan is not None and run.step_s is not None:
            return run.step_s
        return run.total_s

    def _rounds(self, measuring: _Measuring, deadline: timing.Deadline) -> None:
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
            progress=self._report_progress,
            on_run=lambda label, _m: self._publish_partial(measuring, deadline),
            begun=measuring.rounds,
            min_rounds=None if len(runners) > 1 else BASELINE_ONLY_ROUNDS,
        )

    def _combined_config(self, measuring: _Measuring) -> _Config | None:
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
        return _Config(label, recommended)

    def _recommends(self, measuring: _Measuring, config: _Config) -> bool:
        speedup = measuring.rounds.speedup(config.label)
        if speedup is None or speedup.verdict != verdict.FASTER:
            return False
        outputs = measuring.outputs
        if BASELINE not in outputs or config.label not in outputs:
            return self._start_state is None  # nothing to compare: no snapshot, no claim
        tolerance = max(f.tolerance for f in config.fixes)
        compared = numerics.compare(outputs[BASELINE], outputs[config.label], tolerance)
        return compared.verdict in ("identical", "close")

    def _profiled_runs(self, measuring: _Measuring, deadline: timing.Deadline) -> None:
        """Peak memory of each configuration and the model's FLOPs, each from a profiled run
        (sampled: a short one), where the deadline leaves room for it."""
        first = measuring.firsts.get(BASELINE)
        runs = len(measuring.runnable) + 1
        self._profiled_steps = self.plan.stop if self.plan is not None else None
        guess = self._profiled_guess(first)
        if self.plan is not None and not deadline.allows(runs * guess):
            self._profiled_steps = min(self.plan.stop, steps.PROFILED_STEPS)
            guess = self._profiled_guess(first)
        skipped = False
        # the baseline's peak memory and FLOPs first (the reserve is kept for those at least),
        # then each fix's peak memory while time is left
        for config in measuring.runnable:
            if not deadline.allows(guess):
                skipped = True
                continue
            self._report_progress(1.0, f"peak memory: {config.label}")
            try:
                measuring.results[config.label].peak_memory_bytes = self._checked_run(config)
            except timing.OutOfTime:
                skipped = True
            if config.label == BASELINE:
                if deadline.allows(guess):
                    self._count_flops(measuring.configs[0])
                elif self._flops is None and self._flops_detail is None:
                    skipped = True
        if skipped:
            self._warn_once(
                f"peak memory and FLOPs were not measured for every configuration: a profiled "
                f"run takes about {_seconds(guess)} here and the budget had no room left for "
                "it (raise --budget to have them)"
            )

    def _profiled_reserve(self, configurations: int, first: _RunTime | None) -> float:
        """Seconds to keep for the profiled runs (one per configuration, one for FLOPs)
        where they are cheap enough (at most PROFILED_SHARE of the budget), else for the
        baseline's two (its peak memory and FLOPs); the others run if the rounds leave
        time."""
        guess, most = self._profiled_guess(first), PROFILED_SHARE * self.options.budget
        for runs in (configurations + 1, 2):
            if runs * guess <= most:
                return runs * guess
        return 0.0

    def _profiled_guess(self, first: _RunTime | None) -> float:
        """One profiled run's seconds: the plain run (sampled: its set-up and
        PROFILED_STEPS steps) slowed as much as the probe was slowed by its
        instrumentation."""
        obs = self._observed()
        if first is None:
            return obs.wall_s
        plan = self.plan
        if plan is not None and first.lead_s is not None and first.step_s is not None:
            setup = max(0.0, first.lead_s - plan.warmup * first.step_s)
            plain = setup + self._profiled_stop() * first.step_s  # type: ignore[operator]
            probe_step = self.step_trace.mean_step_s() if self.step_trace else None
            slowdown = probe_step / first.step_s if probe_step and first.step_s else None
        else:
            plain = first.total_s
            slowdown = obs.wall_s / first.total_s if not obs.stopped_early else None
        return plain * max(1.0, slowdown or PROBE_SLOWDOWN)

    def _run_guess(self, measuring: _Measuring, config: _Config) -> float:
        """How long a configuration's first run will take: the baseline's (measured, or
        guessed from the probe), with room for a one-time cost (compile, worker start)."""
        walls = measuring.rounds.walls.get(BASELINE)
        if walls:
            base = statistics.median(walls)
        else:
            obs = self._observed()
            base = obs.wall_s / PROBE_SLOWDOWN
            if self.plan is not None and self.step_trace is not None:
                step_s = self.step_trace.mean_step_s() or obs.wall_s
                base = self.plan.stop * step_s / PROBE_SLOWDOWN
        return base + sum(f.one_time_guess_s for f in config.fixes)

    def _budget_for(self, deadline: timing.Deadline, guess: float) -> float:
        """The `--budget` that would leave room for a configuration that did not fit: its
        first run and enough rounds for a verdict, on top of this budget."""
        rounds = verdict.min_rounds() + 1
        wanted = deadline.seconds + guess * (1 + 2 * rounds)
        return float(5 * math.ceil(wanted / 5))

    def _note_allocator_drift(self, configs: list[_Config], runs: list[_RunTime]) -> None:
        """Say so when page faults moved the baseline's times by more than
        ALLOCATOR_DRIFT_SHARE of a run. Either its first timed run paid for faults the later
        ones did not — glibc raises its mmap threshold when a mapped block is freed, so a
        kernel's first runs of the cell are slower than the runs measured here — or its runs
        faulted unevenly: where a cell's large tensors fall on glibc's heap decides whether
        their memory goes back to the OS and is faulted in again, and a cell freeing 16 MiB
        activations was seen to take 4k-90k faults a run (113-217 ms) in a plain Python
        loop, with nothing else running. Then its time, and any speedup, moves that much
        from run to run in a kernel too. Not said when a measured fix set the thresholds
        itself (cpu-allocator): the change would be ours, and that finding's caveat says
        what its undo leaves."""
        if len(runs) < 3 or any(fix.sets_allocator for c in configs for fix in c.fixes):
            return
        first, later = runs[0], runs[1:]
        run_s = statistics.median(run.total_s for run in later)
        fault_s = allocator.fault_cost_s()
        if run_s <= 0:
            return
        most = max(run.faults for run in later)
        if (first.faults - most) * fault_s >= ALLOCATOR_DRIFT_SHARE * run_s:
            steady = statistics.median(run.faults for run in later)
            self._warn_once(
                f"glibc's allocator changed state while measuring: the baseline's first timed "
                f"run took {first.faults:,} page faults, the later ones {steady:,.0f} "
                f"(≈{(first.faults - steady) * fault_s * 1e3:.1f} ms on top of a "
                f"{run_s * 1e3:.0f} ms run); glibc raises its mmap threshold as large blocks "
                "are freed, so this cell's first runs in a kernel can be slower than this "
                "baseline (cpu-allocator measures fixing that)"
            )
            return
        low, high = min(run.faults for run in runs), max(run.faults for run in runs)
        if (high - low) * fault_s >= ALLOCATOR_DRIFT_SHARE * run_s:
            self._warn_once(
                f"glibc's allocator served this cell unevenly: its runs took {low:,} to "
                f"{high:,} page faults (≈{(high - low) * fault_s * 1e3:.1f} ms apart, of a "
                f"{run_s * 1e3:.0f} ms run); where its large tensors fall on glibc's heap "
                "decides whether their memory goes back to the OS and is faulted in again, so "
                "its time varies that much from run to run in a kernel too, with a fix or "
                f"without, and the speedups are medians over {len(runs)} runs of the baseline "
                "(cpu-allocator measures fixing that)"
            )

    @contextmanager
    def _failures_noted(self, config: _Config, variant: Variant) -> Iterator[None]:
        """A fix that cannot be applied, or a cell that raises with it, is noted on its
        variant and measuring goes on; the baseline raising is the cell's own error."""
        try:
            yield
        except fixes.FixError as error:
            variant.error = f"the fix could not be applied: {error.reason}"
        except Exception as error:
            if config.label == BASELINE:
                raise
            variant.error = f"the cell raised with this fix: {_error_text(error)}"

    def _conclude(
        self, measuring: _Measuring, deadline: timing.Deadline
    ) -> tuple[list[Variant], Variant]:
        """Statistics, one-time costs, projections, speedups with their verdicts,
        throughput, numerics, and what a budget that ran out would have needed."""
        results, rounds = measuring.results, measuring.rounds
        for label in rounds.labels:
            _fill(results[label], rounds.measurement(label))
        if BASELINE not in rounds.labels and BASELINE in measuring.firsts:  # no round fitted:
            only = measuring.firsts[BASELINE].total_s  # the first run is all there is
            _fill(results[BASELINE], timing.Measurement(BASELINE, [only]))
            for config in measuring.runnable[1:]:
                guess = self._run_guess(measuring, config)
                results[config.label].budget_to_tell_s = self._budget_for(deadline, guess)
        timed = {label: rounds.measurement(label) for label in rounds.labels}
        configs = measuring.configs
        self._set_one_time_costs(configs, results, measuring.firsts, timed, measuring.later)
        self._set_projections(results, measuring.firsts, measuring.later)
        base = results[BASELINE]
        self._add_throughput(configs, results)
        speedups = []
        for config in configs[1:]:
            variant = results[config.label]
            speedup = rounds.speedup(config.label)
            _set_speedup(variant, base, speedup)
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
            elif self._start_state is None:
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

    def _stop(self) -> int | None:
        return self.plan.stop if self.plan is not None else None

    def _set_one_time_costs(
        self,
        configs: list[_Config],
        results: dict[str, Variant],
        firsts: dict[str, _RunTime],
        timed: dict[str, timing.Measurement],
        later: dict[str, list[_RunTime]],
    ) -> None:
        """First-run cost of fixes that can have one, beyond the baseline's own first run
        (sampled: the first run's time to the end of its warm-up steps against the steady
        runs' time to that point), with its cause. A set of fixes costs at least what its
        fixes cost when each first ran alone: applied fresh, a user pays those again, even
        though this measurement reused their cached artifacts."""

        def extra(label: str) -> float | None:
            first = firsts.get(label)
            if first is None or label not in timed:
                return None
            leads = [run.lead_s for run in later.get(label, []) if run.lead_s is not None]
            if self.plan is not None and first.lead_s is not None and leads:
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
                self._first_costs.setdefault(config.fixes[0].check_id, net)
            known = sum(self._first_costs.get(f.check_id, 0.0) for f in config.fixes)
            cost = max(net, known)
            if cost > 0:
                variant = results[config.label]
                variant.one_time_s, variant.one_time_cause = cost, ", ".join(causes)

    def _set_projections(
        self,
        results: dict[str, Variant],
        firsts: dict[str, _RunTime],
        later: dict[str, list[_RunTime]],
    ) -> None:
        """Sampled: the whole cell as one run of it would take (the first run's time to the
        end of its warm-up steps, one-time costs included, then every later step). Where
        the per-step times count epoch restarts (one per epoch's batches), a restart's
        median over the runs sets the count right: the steps after W hold every epoch's
        start but the first, which is in the time to W. (Each run times one restart, a
        single event: on a busy machine one worker start can take twice another.)"""
        total = self.step_count.total if self.step_count else None
        plan = self.plan
        if plan is None or total is None:
            return
        remaining = max(0, total - plan.warmup)
        for label, variant in results.items():
            first = firsts.get(label)
            if first is None or first.lead_s is None or variant.median_s is None:
                continue
            projected = first.lead_s + remaining * variant.median_s
            runs = [first, *later.get(label, [])]
            restarts = [r.restart_s for r in runs if r.restart_s is not None]
            if plan.per_epoch and restarts:
                due = max(0, math.ceil(total / plan.per_epoch) - 1)
                projected += (due - remaining / plan.per_epoch) * statistics.median(restarts)
            variant.projected_cell_s = projected

    def _flag_nondeterminism(
        self,
        baseline: _Config,
        results: dict[str, Variant],
        measuring: _Measuring,
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
            self._one_run(baseline, capture, self._stop())
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

    def _count_flops(self, baseline: _Config) -> None:
        """Model FLOPs of one untimed baseline run (sampled: per step, over a short run),
        once per session; a cell the counter cannot run under is measured all the same."""
        if self._flops is not None or self._flops_detail is not None:
            return
        stop = self._profiled_stop()
        try:
            count = utilisation.count(functools.partial(self._one_run, baseline, stop=stop))
        except timing.OutOfTime:  # no room left this time; a later measurement may count
            return
        except Exception as error:
            self._flops_detail = (
                f"FLOPs not counted: the cell failed under FlopCounterMode ({_error_text(error)})"
            )
            return
        if stop is not None:  # per step, like the sampled times
            count = utilisation.FlopCount(
                count.total // stop, {k: v // stop for k, v in count.buckets.items()}
            )
        self._flops = count

    def _add_throughput(self, configs: list[_Config], results: dict[str, Variant]) -> None:
        """Achieved TFLOP/s and share of peak for every measured configuration."""
        if self._flops is None:
            return
        device = self._observed().device
        peaks, _ = utilisation.peaks_for(device, _device_name(device))
        for config in configs:
            variant = results[config.label]
            if variant.error:
                continue
            got = utilisation.throughput(
                self._flops, variant.median_s, peaks, config.ids, _amp_dtype(config.fixes)
            )
            variant.flops = self._flops.total
            variant.achieved_tflops = got.achieved_tflops
            variant.utilisation = got.utilisation
            variant.peak_tflops = got.peak_tflops

    def _profiled_stop(self) -> int | None:
        """Sampled: profiled runs (memory, FLOPs) stop where the timed runs stop, so their
        peak covers the same work (an evaluation pass at an epoch's end included), or after
        a couple of steps where the budget has no room for that (`_profiled_runs`)."""
        if self.plan is None:
            return None
        return self._profiled_steps or min(self.plan.stop, steps.PROFILED_STEPS)

    def _checked_run(self, config: _Config) -> int | None:
        """One untimed run that records peak memory (sampled: a short one)."""
        obs = self._observed()
        # the probe could profile, so memory profiling is safe too
        measure = memory.profiled if obs.ops is not None else memory.tracked
        peak = self._one_run(config, None, self._profiled_stop(), measure(obs.device)).watched.peak
        self._memory_label = peak.label if peak else None
        return peak.bytes if peak else None

    def _capture(
        self, outputs: dict[str, numerics.Outputs], label: str, watched: tuple[set[str], dict]
    ) -> None:
        """What the cell produced so far, from a restored start, for numerics."""
        if self._start_state is not None:
            names, modules = watched
            outputs[label] = numerics.capture(self.workload.namespace, names, modules)

    def _watched_outputs(self) -> tuple[set[str], dict[str, torch.nn.Module]]:
        """Names the cell (re)bound and the models it ran: what numerics compares."""
        obs = self._observed()
        modules = {
            entry.name: entry.obj
            for entry in discovery.top_level_modules(obs.found)
            if any(id(m) in obs.modules for m in entry.obj.modules())
        }
        return set(self._cell_names), modules

    def _report_progress(self, fraction: float, message: str) -> None:
        if self.progress is not None:
            self.progress(fraction, message)

    def _warn_once(self, warning: str) -> None:
        if warning not in self.warnings:
            self.warnings.append(warning)

    def _publish_partial(self, measuring: _Measuring, deadline: timing.Deadline) -> None:
        """Numbers so far, to the front end, at most every PUBLISH_EVERY_S: provisional
        (the report's phase says measuring), so no verdict is drawn from them yet."""
        if self.on_report is None or time.perf_counter() - self._published_at < PUBLISH_EVERY_S:
            return
        results, rounds = measuring.results, measuring.rounds
        for label in rounds.labels:
            _fill(results[label], rounds.measurement(label))
        base = results[BASELINE]
        current = [results[c.label] for c in measuring.configs[1:]]
        for config, variant in zip(measuring.configs[1:], current, strict=True):
            _set_speedup(variant, base, rounds.speedup(config.label))
            variant.verdict = None  # provisional: the interval is still moving
        self.publish(self._build_report(base, current, deadline, phase="measuring"))

    # report ---------------------------------------------------------------------------------
    def _build_report(
        self,
        baseline: Variant | None = None,
        current: list[Variant] | None = None,
        deadline: timing.Deadline | None = None,
        *,
        phase: str,
    ) -> Report:
        """The report as it stands: findings, every finished measurement plus `current` (a
        measurement under way), the baseline of the newest one, sampling and the cell's run.
        Without arguments it repeats the newest measurement's numbers (or none yet)."""
        obs = self._observed()
        previous = self.report
        if baseline is None and previous is not None:
            stats, budget_s, elapsed_s = previous.baseline, previous.budget_s, previous.elapsed_s
        else:
            stats = _stats(baseline or Variant(fixes=[]), self._flops, self._flops_detail)
            budget_s = deadline.seconds if deadline else None
            elapsed_s = round(deadline.spent, 3) if deadline else None
        variants = [*self._history, *(current or [])]
        by_fix = {tuple(v.fixes): v for v in variants}

        def gain(detection: Detection) -> float:
            variant = by_fix.get((detection.finding.id,))
            return -(variant.speedup or 0.0) if variant and variant.speedup else 0.0

        findings = [d.finding for d in sorted(self.detections, key=gain)]
        return Report(
            environment=environment(obs.device, self._memory_label),
            baseline=stats,
            findings=findings,
            variants=variants,
            not_applicable=list(self.not_applicable),
            applied=self.applied_ids,
            warnings=list(self.warnings),
            cell=self.workload.cell,
            run_id=self.run_id,
            budget_s=budget_s,
            elapsed_s=elapsed_s,
            phase=phase,
            sampling=self._sampling(),
            cell_run=self.cell_run,
            oom=self.oom,
            notebook_edits=self.notebook_edits(),
            recommended=self.recommended(variants) if phase != "measuring" else None,
            load=self._load,
        )

    def _sampling(self) -> Sampling | None:
        if self.plan is None or self.step_trace is None:
            return None
        count = self.step_count
        return Sampling(
            unit=self.plan.source.unit,
            steps_per_run=count.total if count else None,
            steps_detail=count.detail if count else "",
            warmup_steps=self.plan.warmup,
            steps_timed=self.plan.timed,
            probe_steps=self.step_trace.count,
            probe_complete=not self._observed().stopped_early,
            epoch_end_step=self.plan.epoch_end,
            steps_per_epoch=self.plan.per_epoch,
        )

    def _observed(self) -> probe.Observation:
        if self.observation is None:
            raise RuntimeError("probe() has not run yet")
        return self.observation


_MISSING = object()


def _fill(variant: Variant, measurement: timing.Measurement) -> None:
    """A variant's timing statistics from its measurement so far."""
    variant.median_s, variant.iqr_s = measurement.median, measurement.iqr
    variant.runs, variant.noisy = measurement.runs, measurement.noisy


def _set_speedup(variant: Variant, base: Variant, speedup: Speedup | None) -> None:
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


def _seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.1f} s"


def _stats(
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


def _error_text(error: BaseException) -> str:
    original = getattr(error, "original", error)
    return f"{type(original).__name__}: {original}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _uses_cuda(obs: probe.Observation) -> bool:
    for use in obs.modules.values():
        for tensor in use.module.parameters():
            return tensor.is_cuda
    return False


def environment(device: str, memory_label: str | None) -> dict[str, Any]:
    """Facts a reader needs to judge the numbers."""
    name = _device_name(device)
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


def _device_name(device: str) -> str:
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
