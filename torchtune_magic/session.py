"""The workflow: probe → detect → measure → finish.

A Session lives as long as its panel: toggles call `apply`/`undo`, Re-time calls `measure`.
Findings go to the front end as soon as the checks are done (`on_report`), and each
configuration's numbers as soon as they are measured. Measuring always starts each run from
the state the cell started from (snapshot S0) and ends by putting back a known state; the
cell's one complete run (`finish`) then leaves the kernel as if the cell ran once.

Long cells are sampled (see `probe/steps.py`): the probe stops itself at a step boundary,
every measuring run stops after the same step K, and the report gives per-step times with
the whole cell projected; the complete run happens last, with the fixes asked for.

The parts, each in a module of its own: the measuring plan (`measuring/plan.py`), the runs
that carry it out (`measuring/runs.py`, one run in `measuring/run.py`), the figures drawn
from them (`measuring/figures.py`), the applied fixes (`kernel/applied.py`) and the code
changes (`checks/cellchanges.py`).
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from . import own_failures
from .cell import history
from .cell.workload import CellError, Workload, captured
from .checks import Check, Detection, cellchanges, registry
from .distributed import lockstep
from .kernel import applied, discovery, fixes, plain_stack, state
from .measuring import figures, fits, timing
from .measuring import plan as plans
from .measuring.plan import (
    PROBE_SECONDS,
    PROBE_SHARE_OF_BUDGET,
    TRIALS_SHARE,
)
from .measuring.run import Config
from .measuring.runs import Hooks, Runs
from .options import Options
from .probe import launchers, oom, probe, steps
from .probe.observation import Observation, StepTrace
from .report import (
    CellRun,
    Distributed,
    NotApplicable,
    NotebookEdits,
    OutOfMemory,
    Report,
    Variant,
)

SNAPSHOT_SHARE_OF_FREE_MEMORY = 0.5
# Our profiler covers the probe's first steps for this long: reading its events back costs
# seconds per few seconds profiled (a 3000-step raw-tensor loop: ~5 s), and a few seconds
# of steps tell the checks the op shares of the cell.
PROFILE_SECONDS = 1.5
# partial reports go to the front end at most this often: each one is serialized, sent
# and redrawn in the browser, on the CPUs the next timed run shares with it
PUBLISH_EVERY_S = 2.0
FINISH_PROGRESS_EVERY_S = 0.25

# Where the kernel stands relative to the contract "as if the cell ran once"
AFTER_ONE_RUN = "after one run"
BEFORE_CELL = "before the cell"
PART_RUN = "part of a run"  # the probe was stopped early


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
        # under torchrun, the job's ranks: each decision that shapes measuring is agreed
        # with them (`distributed/lockstep.py`) while this session probes and measures
        self.ranks = lockstep.joined()
        self.observation: Observation | None = None
        self.detections: list[Detection] = []
        self.not_applicable: list[NotApplicable] = []
        self.warnings: list[str] = []
        # perfcheck's own failures after the probe, each contained at its part: the cell
        # never fails for them, and the report says which part failed and why
        self.failures = own_failures.OwnFailures()
        self.report: Report | None = None
        self.step_trace: StepTrace | None = None
        self.step_count: steps.StepCount | None = None
        self.cell_run: CellRun | None = None
        self.applied_fixes = applied.AppliedFixes(workload.namespace, self._warn_once)
        self._runs: Runs | None = None  # the measuring runs, once the probe has run
        self._cell_names: set[str] = set()  # names the cell (re)binds
        self.oom: OutOfMemory | None = None  # the cell ran out of memory in the probe
        self._out_of_memory: CellError | None = None
        self._kernel = AFTER_ONE_RUN
        self._history: list[Variant] = []  # every finished measurement's variants, in order
        self._start_state: state.Snapshot | None = None
        self._start_switches = state.TorchSwitches.capture()  # taken again by the probe
        # the stack a plain run of the cell would execute under: timed runs of a cell whose
        # cost depends on it execute there (`Runner._measuring_stack`)
        self._plain_stack = plain_stack.PlainStack.of_caller()
        self._published_at = 0.0
        # notebook edits by the fix ids they are for (they change only with the applied set)
        self._notebook_edits: dict[tuple[str, ...], NotebookEdits | None] = {}
        # the budget as a promise: set when the probe is done (the checks' trials and the
        # first measurement count against it; the probe is bounded by a share of it); a
        # later Re-time gets a budget of its own
        self._deadline: timing.Deadline | None = None
        # what the probe's run changed that no restore puts back (a generator advanced, a
        # file written): the cell is then not run again, and these say why
        self._one_way: list[str] = []
        # the launcher that runs the cell's training in child processes perfcheck does not
        # see (`probe/launchers.py`): the cell is then not run again either
        self._launcher: str | None = None

    # the one-shot flow ----------------------------------------------------------------------
    def run(self) -> Report:
        """Probe, detect (findings go out at once), measure, apply `--apply` fixes, then the
        cell's complete run. The cell's own exception propagates (as CellError); Ctrl-C
        propagates after the report says where it stopped."""
        __tracebackhide__ = True
        with lockstep.active(self.ranks):
            self.probe()
        if self.ranks is None and lockstep.launched_by_torchrun():
            # the cell joined the job itself (Lightning's `fit` initialises the process
            # group): the ranks agree from here on
            self.ranks = lockstep.joined()
        with lockstep.active(self.ranks):
            if self.ranks is not None and self.observation is not None:
                self._probe_figures_agreed(self.observation, self.ranks)
            return self._after_probe()

    def _after_probe(self) -> Report:
        __tracebackhide__ = True
        self._deadline = timing.Deadline(self.options.budget)
        self.detect()
        if self._out_of_memory is not None:  # a report on what happened, then the traceback
            self.cell_run = CellRun("failed", detail=self.oom.error if self.oom else None)
            with self._interrupt_said():
                self._measure_fits()
            self.publish(self._build_report(phase="done"))
            raise self._out_of_memory
        self.publish(self._build_report(phase="measuring"))
        with self._interrupt_said(), self.failures.part("measuring"):
            self.measure()
        if not self.options.finish:  # before --apply: its fixes then stay on that state
            self._back_to_start()
        fixable = [d.finding.id for d in self.fixable]
        measured = self.report.variants if self.report is not None else []
        for check_id in applied.requested(self.options.apply, fixable, measured):
            with self.failures.part(f"--apply {check_id}"):
                try:
                    self.applied_fixes.apply(check_id, self.fix_for(check_id))
                except fixes.FixError as error:
                    self.warnings.append(f"--apply {check_id}: not applied: {error.reason}")
        self.finish()
        return self.report  # type: ignore[return-value]  # set by publish

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

    def probe(self) -> Observation:
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
        if self.ranks is None and lockstep.launched_by_torchrun():
            stop_after = None  # no process group yet for the ranks to agree where to stop
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
        self._launcher = launchers.child_process_launcher(self.workload.tree, namespace)
        if self._launcher is not None:
            self._warn_once(launchers.not_measured_line(self._launcher))
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

    def _probe_figures_agreed(self, obs: Observation, ranks: lockstep.Ranks) -> None:
        """Under torchrun, every rank's work in the probe (for rank-imbalance and the rank
        table), the probe's times as its slowest rank took them, and a change no restore
        puts back on any rank holds every rank to the one run (the figures the measuring
        plan and the first runs' guesses are made from)."""
        obs.rank_work = lockstep.gathered(obs.own_work(ranks.rank))
        trace = self.step_trace
        first_s, last_s = (trace.first_s, trace.last_s) if trace is not None else (None, None)
        wall_s, first_s, last_s = lockstep.slowest_of([obs.wall_s, first_s, last_s])
        obs.wall_s = wall_s if wall_s is not None else obs.wall_s
        if trace is not None:
            trace.first_s, trace.last_s = first_s, last_s
        if lockstep.any_rank(bool(self._one_way)) and not self._one_way:
            self._one_way = ["another rank's run changed what no restore puts back"]

    @property
    def _runs_once(self) -> bool:
        """The probe was the cell's one run: running it again would change what the user
        sees, or time a launcher's wait for processes perfcheck does not see."""
        return bool(self._one_way) or self._launcher is not None

    def detect(self) -> list[Detection]:
        """Run every check wanted on the probe's observation. Their trials (worker counts,
        thread counts, plain runs) share TRIALS_SHARE of the budget: they come out of it."""
        obs = self._observed()
        # a cell that changed what no restore can put back is not run again, trials included
        obs.trials_s = 0.0 if self._runs_once else TRIALS_SHARE * self.options.budget
        self.detections, self.not_applicable = [], []
        with self.failures.part("detection"):
            for check in registry.all_checks():
                if self.options.wants(check.id):
                    with self.failures.part(f"check {check.id}"):
                        self._run_check(check, obs)
            if self.ranks is not None:
                self.detections = self._found_on_every_rank(self.detections)
        for detection in self.detections:
            with self.failures.part(f"code change for {detection.finding.id}"):
                cellchanges.attach_cell_changes(self.workload, [detection])
        return self.detections

    def _run_check(self, check: Check, obs: Observation) -> None:
        """One check's findings, or why it does not apply here."""
        reason = check.not_applicable(obs)
        if reason is None and self.ranks is not None:
            reason = check.not_applicable_under_torchrun()
        if reason is not None:
            self.not_applicable.append(NotApplicable(check.id, reason))
        else:
            self.detections.extend(check.detect(obs))

    def _found_on_every_rank(self, detections: list[Detection]) -> list[Detection]:
        """Under torchrun, the findings every rank made (each rank's fix is applied on
        that rank, all together); one seen on some ranks only is said, not measured."""
        seen = lockstep.gathered([d.finding.id for d in detections])
        everywhere = set.intersection(*(set(ids) for ids in seen))
        for finding_id in dict.fromkeys(i for ids in seen for i in ids):
            if finding_id not in everywhere:
                ranks = ", ".join(str(r) for r, ids in enumerate(seen) if finding_id in ids)
                self.warnings.append(
                    f"{finding_id}: found on rank(s) {ranks} only, so it is not measured "
                    "(a fix must run on every rank, as the cell's collectives do)"
                )
        return [d for d in detections if d.finding.id in everywhere]

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
        applied = self.applied_fixes.fixes()
        counter = self.failures.call(
            "counting the complete run's steps", self._finish_counter, default=None
        )
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
            detail = "stopped by Ctrl-C" if interrupted else figures.error_text(error)
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
            if self._runs is not None:  # a re-time projects the whole cell from it
                self._runs.count = self.step_count
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
        return self.applied_fixes.ids

    @property
    def fixable(self) -> list[Detection]:
        return [d for d in self.detections if d.fix is not None]

    def fix_for(self, check_id: str) -> fixes.Fix:
        for detection in self.detections:
            if detection.finding.id == check_id and detection.fix is not None:
                return detection.fix
        raise KeyError(f"no live fix for {check_id!r} in this report")

    def apply(self, check_id: str) -> None:
        """Apply a fix to the live objects and publish the report with it applied. Raises
        FixError with nothing left applied, e.g. when a name the fix changes was rebound
        since the probe ran (the user's new object is never replaced)."""
        self.applied_fixes.apply(check_id, self.fix_for(check_id))
        self._publish_applied()

    def undo(self, check_id: str) -> list[str]:
        """Undo a fix and publish the report without it. Returns (and keeps as warnings)
        notes on places the user rebound while it was applied: those keep the user's object."""
        notes = self.applied_fixes.undo(check_id)
        self._publish_applied()
        return notes

    def revert_all(self) -> list[str]:
        """Undo every applied fix (panel's Revert all, `%perfcheck revert`); notes as `undo`."""
        notes = self.applied_fixes.revert_all()
        self._publish_applied()
        return notes

    def current_report(self) -> Report:
        """The report as it stands now (its numbers as they stand, failures and the applied
        fixes as they are now), published."""
        phase = self.report.phase if self.report is not None else "measuring"
        self.publish(self._build_report(phase=phase))
        return self.report  # type: ignore[return-value]  # set by publish

    def _publish_applied(self) -> None:
        """The saved report follows the applied state: republish the current report (its
        numbers as they stand) with `applied` as it is now."""
        if self.report is not None:
            self.publish(self._build_report(phase=self.report.phase))

    def recommended(self, variants: list[Variant] | None = None) -> list[str]:
        """The recommended fixes (`kernel.applied.recommended`) among these measurements
        (default: the current report's)."""
        if variants is None:
            variants = self.report.variants if self.report is not None else []
        return applied.recommended([d.finding.id for d in self.fixable], variants)

    # code changes (checks/cellchanges.py) ---------------------------------------------------
    def suggested_cell(self) -> str:
        """The cell with the code changes of the fixes applied now (of the recommended
        ones, when none is)."""
        return self.optimized_cell(self.applied_ids or self.recommended())

    def optimized_cell(self, check_ids: list[str] | None = None) -> str:
        """The cell with the code changes of these findings (default: all) applied."""
        return cellchanges.optimized_cell(self.workload, self.detections, check_ids)

    def notebook_edits(self) -> NotebookEdits | None:
        """Every notebook cell to edit for the fixes applied now (for the recommended ones,
        when none is); None when no cell changes."""
        chosen = self._chosen()
        key = tuple(d.finding.id for d in chosen if d.fixed_source is not None or d.earlier)
        if key not in self._notebook_edits:
            self._notebook_edits[key] = cellchanges.notebook_edits(self.workload, chosen)
        return self._notebook_edits[key]

    def cell_to_insert(self) -> tuple[str, list[history.Rebuild], list[tuple[str, str]]]:
        """What `%perfcheck insert` puts below (`cellchanges.cell_to_insert`)."""
        return cellchanges.cell_to_insert(self.workload, self.suggested_cell(), self._chosen())

    def _chosen(self) -> list[Detection]:
        """The detections whose changes count now: the applied fixes', else the recommended
        ones' (none before they are measured: a finding's own change is offered with it)."""
        chosen = set(self.applied_ids) or set(self.recommended(self._history))
        return [d for d in self.detections if d.finding.id in chosen]

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
        with lockstep.active(self.ranks):
            return self._measure(fix_sets, budget_s)

    def _measure(self, fix_sets: list[list[str]] | None, budget_s: float | None) -> Report:
        __tracebackhide__ = True
        deadline = self._measuring_deadline(budget_s)
        if self._runs_once:  # a run more would change what the user sees: none is made
            self.publish(self._build_report(deadline=deadline, phase="measuring"))
            return self.report  # type: ignore[return-value]  # set by publish
        runs = self.runs
        with self.applied_fixes.lifted(self.warnings), self._state_kept(), runs.load_watched():
            plan = plans.agreed(
                plans.make(
                    self._observed(),
                    self.options,
                    self.step_trace,
                    self.step_count,
                    self.fixable,
                    fix_sets,
                    deadline,
                    runs.plan,
                )
            )
            variants, baseline = runs.measure(plan)
        measured_at = figures.now()
        for variant in [baseline, *variants]:
            variant.measured_at = measured_at
        self._history.extend(variants)
        self.detections, fallen = registry.without_win(self.detections, variants, self.applied_ids)
        self.not_applicable.extend(fallen)
        # a re-time after the cell's complete run is done; the first measurement is not
        phase = "done" if self.cell_run is not None else "measuring"
        self.publish(self._build_report(baseline, deadline=deadline, phase=phase))
        return self.report  # type: ignore[return-value]  # set by publish

    @property
    def runs(self) -> Runs:
        """The measuring runs of this session (made once, after the probe)."""
        if self._runs is None:
            hooks = Hooks(
                warn=self._warn_once,
                note=self.warnings.append,
                progress=self._report_progress,
                partial_due=self._partial_due,
                partial=self._publish_partial,
                measured=self._history.append,
                publish=lambda: self.publish(self._build_report(phase="measuring")),
                contained=self.failures.part,
            )
            self._runs = Runs(
                self.workload,
                self._observed(),
                self.step_trace,
                self.step_count,
                self.options,
                self._start_state,
                self._start_switches,
                self._plain_stack,
                self._cell_names,
                self.fix_for,
                hooks,
            )
        return self._runs

    def _measuring_deadline(self, budget_s: float | None) -> timing.Deadline:
        """The run's own deadline for its first measurement (the probe and the checks spent
        part of it); a fresh one for a Re-time or an explicit budget."""
        if budget_s is None and self._deadline is not None and not self._history:
            return self._deadline
        return timing.Deadline(budget_s or self.options.budget)

    @contextmanager
    def _state_kept(self) -> Iterator[None]:
        """The kernel ends measuring as it was (`Runner.state_kept`), or, where the probe ran
        part of the cell, as before the cell."""
        part_run = self._kernel == PART_RUN
        try:
            with self.runs.runner.state_kept(from_start=part_run):
                yield
        finally:
            if part_run and self._start_state is not None:
                self._kernel = BEFORE_CELL

    def _measure_fits(self) -> None:
        """After the cell ran out of memory: whether each memory fix makes it fit
        (`fits.measure_fits`)."""
        device = self._observed().device
        tried = [
            Config(d.finding.id, [d.fix])
            for d in self.fixable
            if d.fix is not None and device in d.fix.cuts_memory_on
        ]
        fits.measure_fits(self.runs.runner, tried, self._out_of_memory, self.runs.hooks)

    # report ---------------------------------------------------------------------------------
    def publish(self, report: Report) -> None:
        """Hand a report to the front end and keep it as the current one; a final one (done
        or interrupted) also goes to `--json`."""
        self.report = report
        self._published_at = time.perf_counter()
        first_rank = self.ranks is None or self.ranks.first
        if self.options.json and first_rank and report.phase in ("done", "interrupted"):
            report.write_json(self.options.json)
        if self.on_report is not None:
            with self.failures.part("showing the report"):
                self.on_report(report)

    def _distributed(self, runs: Runs | None) -> Distributed | None:
        ranks = self.ranks
        if ranks is None:
            return None
        rank_times = (runs.rank_times if runs is not None else None) or []
        work = {w.rank: w for w in (self.observation and self.observation.rank_work) or []}
        for rank_time in rank_times:
            own = work.get(rank_time.rank)
            if own is not None and own.steps and own.wall_s > 0:
                rank_time.collective_share = min(1.0, own.collective_s / own.wall_s)
        return Distributed(ranks.world, ranks.backend, ranks.nodes, rank_times)

    def _partial_due(self) -> bool:
        """Partial reports go to the front end at most every PUBLISH_EVERY_S."""
        return (
            self.on_report is not None
            and time.perf_counter() - self._published_at >= PUBLISH_EVERY_S
        )

    def _publish_partial(
        self, base: Variant, current: list[Variant], deadline: timing.Deadline
    ) -> None:
        self.publish(self._build_report(base, current, deadline, phase="measuring"))

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
        runs = self._runs
        previous = self.report
        if baseline is None and previous is not None:
            stats, budget_s, elapsed_s = previous.baseline, previous.budget_s, previous.elapsed_s
        else:
            flops = runs.flops if runs is not None else None
            flops_detail = runs.flops_detail if runs is not None else None
            stats = figures.stats(baseline or Variant(fixes=[]), flops, flops_detail)
            budget_s = deadline.seconds if deadline else None
            elapsed_s = round(deadline.spent, 3) if deadline else None
        variants = [*self._history, *(current or [])]
        by_fix = {tuple(v.fixes): v for v in variants}

        def gain(detection: Detection) -> float:
            variant = by_fix.get((detection.finding.id,))
            return -(variant.speedup or 0.0) if variant and variant.speedup else 0.0

        findings = [d.finding for d in sorted(self.detections, key=gain)]
        return Report(
            environment=figures.environment(
                obs.device, runs.memory_label if runs is not None else None
            ),
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
            sampling=figures.sampling(
                runs.sample if runs is not None else None, self.step_trace, self.step_count, obs
            ),
            cell_run=self.cell_run,
            oom=self.oom,
            notebook_edits=self.failures.call("code changes", self.notebook_edits, default=None),
            recommended=self.recommended(variants) if phase != "measuring" else None,
            load=runs.load if runs is not None else None,
            distributed=self._distributed(runs),
            failures=list(self.failures.seen),
            time_split=runs.time_split if runs is not None else None,
        )

    def _observed(self) -> Observation:
        if self.observation is None:
            raise RuntimeError("probe() has not run yet")
        return self.observation

    def _report_progress(self, fraction: float, message: str) -> None:
        if self.progress is not None:
            self.progress(fraction, message)

    def _warn_once(self, warning: str) -> None:
        if warning not in self.warnings:
            self.warnings.append(warning)


_MISSING = object()


def _uses_cuda(obs: Observation) -> bool:
    for use in obs.modules.values():
        for tensor in use.module.parameters():
            return tensor.is_cuda
    return False
