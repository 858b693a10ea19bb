"""A session's report: assembled from what the session found and measured, published to the
front end, and kept in step with what the panel does afterwards.

`Session` (`session.py`) holds the flow (probe, detect, measure, finish) and fills in what
this class holds: the observation, the findings, every finished measurement's variants, the
cell's complete run. Here is everything that turns them into a `Report` (`build_report`)
and hands it out (`publish`), and the panel's actions on the result: applying and undoing
fixes (the report follows the applied state), the recommended fixes, and the code changes
of the chosen findings (`checks/cellchanges.py`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from . import own_failures
from .cell.history import Rebuild
from .cell.workload import Workload
from .checks import Detection, cellchanges
from .distributed import lockstep
from .kernel import applied, fixes
from .measuring import figures
from .measuring.runs import Runs
from .measuring.timing import Deadline
from .options import Options
from .probe import steps
from .probe.observation import Observation, StepTrace
from .report import (
    CellRun,
    Checked,
    Distributed,
    NotApplicable,
    NotebookEdits,
    OutOfMemory,
    Report,
    Variant,
)

# partial reports go to the front end at most this often: each one is serialized, sent
# and redrawn in the browser, on the CPUs the next timed run shares with it
PUBLISH_EVERY_S = 2.0


class Reporting:
    """What a session found and measured, and the report assembled from it."""

    def __init__(
        self,
        workload: Workload,
        options: Options,
        on_report: Callable[[Report], None] | None,
        ranks: lockstep.Ranks | None,
    ):
        self.workload = workload
        self.options = options
        self.on_report = on_report
        self.run_id = uuid.uuid4().hex[:12]
        # under torchrun, the job's ranks: each decision that shapes measuring is agreed
        # with them (`distributed/lockstep.py`) while the session probes and measures
        self.ranks = ranks
        self.observation: Observation | None = None
        self.detections: list[Detection] = []
        self.not_applicable: list[NotApplicable] = []
        self.checked: list[Checked] = []  # checks whose own trial measured the fix slower
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
        self.oom: OutOfMemory | None = None  # the cell ran out of memory in the probe
        self._history: list[Variant] = []  # every finished measurement's variants, in order
        self._published_at = 0.0
        # notebook edits by the fix ids they are for (they change only with the applied set)
        self._notebook_edits: dict[tuple[str, ...], NotebookEdits | None] = {}

    # the report -----------------------------------------------------------------------------
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

    def _finished(self, cell_run: CellRun) -> None:
        self.cell_run = cell_run
        self.publish(self._build_report(phase="done"))

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

    def _partial_due(self) -> bool:
        """Partial reports go to the front end at most every PUBLISH_EVERY_S."""
        return (
            self.on_report is not None
            and time.perf_counter() - self._published_at >= PUBLISH_EVERY_S
        )

    def _publish_partial(self, base: Variant, current: list[Variant], deadline: Deadline) -> None:
        self.publish(self._build_report(base, current, deadline, phase="measuring"))

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

    def _build_report(
        self,
        baseline: Variant | None = None,
        current: list[Variant] | None = None,
        deadline: Deadline | None = None,
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
            checked=list(self.checked),
        )

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

    # the fixes applied now --------------------------------------------------------------
    def recommended(self, variants: list[Variant] | None = None) -> list[str]:
        """The recommended fixes (`kernel.applied.recommended`) among these measurements
        (default: the current report's)."""
        if variants is None:
            variants = self.report.variants if self.report is not None else []
        return applied.recommended([d.finding.id for d in self.fixable], variants)

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

    def cell_to_insert(self) -> tuple[str, list[Rebuild], list[tuple[str, str]]]:
        """What `%perfcheck insert` puts below (`cellchanges.cell_to_insert`)."""
        return cellchanges.cell_to_insert(self.workload, self.suggested_cell(), self._chosen())

    def _chosen(self) -> list[Detection]:
        """The detections whose changes count now: the applied fixes', else the recommended
        ones' (none before they are measured: a finding's own change is offered with it)."""
        chosen = set(self.applied_ids) or set(self.recommended(self._history))
        return [d for d in self.detections if d.finding.id in chosen]

    def _observed(self) -> Observation:
        if self.observation is None:
            raise RuntimeError("probe() has not run yet")
        return self.observation

    def _warn_once(self, warning: str) -> None:
        if warning not in self.warnings:
            self.warnings.append(warning)
