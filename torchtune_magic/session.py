"""The workflow: probe → detect → measure → finish.

A Session lives as long as its panel: toggles call `apply`/`undo`, Re-time calls `measure`.
Findings go to the front end as soon as the checks are done (`on_report`), and each
configuration's numbers as soon as they are measured. Measuring always starts each run from
the state the cell started from (snapshot S0) and ends by putting back a known state; the
cell's one complete run (`finish`) then leaves the kernel as if the cell ran once.

Long cells are sampled (see `probe/steps.py`): the probe stops itself at a step boundary,
every measuring run stops after the same step K, and the report gives per-step times with
the whole cell projected; the complete run happens last, with the fixes asked for.

The parts, each in a module of its own: running the checks (`checks/detecting.py`), the
measuring plan (`measuring/plan.py`), the runs that carry it out (`measuring/runs.py`, one
run in `measuring/run.py`), the figures drawn from them (`measuring/figures.py`), and the
report assembled from what the session found and measured, with the panel's actions on it
(`reporting.py`, which `Session` extends: applied fixes, code changes).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from .cell.workload import CellError, Workload, captured
from .checks import Detection, cellchanges, detecting, registry
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
from .probe import launchers, load, oom, probe, steps
from .probe.observation import Observation
from .report import (
    CellRun,
    Checked,
    NotApplicable,
    Report,
)
from .reporting import Reporting

# Our profiler covers the probe's first steps for this long: reading its events back costs
# seconds per few seconds profiled (a 3000-step raw-tensor loop: ~5 s), and a few seconds
# of steps tell the checks the op shares of the cell.
PROFILE_SECONDS = 1.5
FINISH_PROGRESS_EVERY_S = 0.25

# Where the kernel stands relative to the contract "as if the cell ran once"
AFTER_ONE_RUN = "after one run"
BEFORE_CELL = "before the cell"
PART_RUN = "part of a run"  # the probe was stopped early


def _joined() -> lockstep.Ranks | None:
    """This process's ranks (`lockstep.joined`); the load meter then counts the job's other
    ranks on this host as this process's own work, not another process's."""
    ranks = lockstep.joined()
    if ranks is not None:
        load.count_as_ours(ranks.peers)
    return ranks


class Session(Reporting):
    """One %%perfcheck run: the flow. What it found and measured, the report assembled from
    it and the panel's actions on it afterwards are `Reporting`'s."""

    def __init__(
        self,
        workload: Workload,
        options: Options | None = None,
        progress: timing.Progress | None = None,
        on_report: Callable[[Report], None] | None = None,
    ):
        super().__init__(workload, options or Options(), on_report, _joined())
        self.progress = progress
        self._cell_names: set[str] = set()  # names the cell (re)binds
        self._out_of_memory: CellError | None = None
        self._kernel = AFTER_ONE_RUN
        self._start_state: state.Snapshot | None = None
        self._start_switches = state.TorchSwitches.capture()  # taken again by the probe
        # the stack a plain run of the cell would execute under: timed runs of a cell whose
        # cost depends on it execute there (`Runner._measuring_stack`)
        self._plain_stack = plain_stack.PlainStack.of_caller()
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
            self.ranks = _joined()
        with lockstep.active(self.ranks):
            if self.ranks is not None and self.observation is not None:
                self.observation.agreed_across_ranks(self.ranks.rank, self.step_trace)
                if lockstep.any_rank(bool(self._one_way)) and not self._one_way:
                    self._one_way = ["another rank's run changed what no restore puts back"]
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

    def probe(self) -> Observation:
        """The instrumented run. A long cell's probe stops at a step boundary after a share of
        the budget; what it printed is shown only when it ran the whole cell (else the cell's
        complete run prints it, once)."""
        __tracebackhide__ = True
        namespace = self.workload.namespace
        self._start_switches = state.TorchSwitches.capture()
        if self.options.restore:
            found = discovery.walk(namespace)
            if too_big := state.too_big(found):
                needed, free = too_big
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
                self.observation.uses_cuda()
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
            self.workload.probe_was_complete()
            sys.stdout.write(printed.getvalue())
        if self._start_state is not None:
            self._cell_names = self._start_state.rebound()
        obs.memory_asked = self.options.memory
        if self.options.device is None and obs.uses_cuda():
            obs.device = "cuda"
        self.step_trace = obs.leading_step()
        if self.step_trace is not None:
            self.step_count = steps.count_steps(obs, self.step_trace)
        return obs

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
        self.detections, self.not_applicable, self.checked = [], [], []
        with self.failures.part("detection"):
            for check in registry.all_checks():
                if self.options.wants(check.id):
                    with self.failures.part(f"check {check.id}"):
                        found = detecting.run_check(check, obs, self.ranks is not None)
                        if isinstance(found, NotApplicable):
                            self.not_applicable.append(found)
                            continue
                        for item in found:  # a finding, or a fix its trial found slower
                            if isinstance(item, Checked):
                                self.checked.append(item)
                            else:
                                self.detections.append(item)
            if self.ranks is not None:
                self.detections = detecting.found_on_every_rank(self.detections, self.warnings)
        for detection in self.detections:
            with self.failures.part(f"code change for {detection.finding.id}"):
                cellchanges.attach_cell_changes(self.workload, [detection])
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
            for fix in self.applied_fixes.fixes():  # the probe's objects are the kernel's
                self.failures.call(
                    f"applying {fix.check_id} to what the cell built",
                    fix.keep_for_kernel,
                    self.workload.namespace,
                    default=None,
                )
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
                self.workload.complete_run(),
                counter.counting() if counter else nullcontext(),
                fixes.combined_context(applied, self.workload.namespace, final=True),
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

    def _report_progress(self, fraction: float, message: str) -> None:
        if self.progress is not None:
            self.progress(fraction, message)
