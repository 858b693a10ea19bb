"""The live panel: core ipywidgets only, so it renders in JupyterLab, Notebook 7, VS Code, Colab.

One row per finding, with a toggle that applies or undoes its fix on the live objects at
once; Re-time measures the toggled set against the baseline; a chart, the code changes and
the optimized cell. The last report is also published as its own MIME output under a fixed
display id, updated on every re-time, because a saved notebook cannot restore widgets.

This is the only module that imports ipywidgets: the engine never does.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from html import escape
from typing import Any

import ipywidgets as widgets
from IPython.display import display, update_display

from ..engine import codeedit
from ..engine.fixes import FixError
from ..report import Finding, Report, Variant
from ..session import Session
from . import bundle, html, summary

WIN, LOSS, NEUTRAL = "#2e7d32", "#c62828", "#616161"
MEMORY_CHANGE = 0.01  # peak memory moved by less than this share is not called a change

NO_INSERT_FROM_BUTTON = (
    "Jupyter can only insert a cell in answer to a running cell, not to a button click: "
    "run `%perfcheck insert` in a cell to put the optimized cell below it, or copy it from "
    "the box below."
)


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _badge(text: str, color: str = NEUTRAL) -> str:
    return (
        f'<span style="border:1px solid {color};color:{color};border-radius:3px;'
        f'padding:0 4px;margin-right:4px">{_e(text)}</span>'
    )


def _result_html(report: Report, variant: Variant) -> str:
    """Speedup (a slower fix says so, never shown as a win), memory and numerics badges."""
    if variant.error or variant.is_slower:
        color = LOSS
    elif variant.is_win:
        color = WIN
    else:
        color = NEUTRAL
    badges = "".join(
        _badge(text)
        for text in (
            summary.memory_change(report, variant),
            summary.numerics(variant),
            summary.throughput(variant),
        )
        if text
    )
    return f'<b style="color:{color}">{_e(summary.speedup(report, variant))}</b> {badges}'


class _Row:
    """One finding: its toggle (only with a live fix), what was seen, what its fix measured."""

    def __init__(self, finding: Finding):
        self.finding = finding
        self.toggle = (
            widgets.Checkbox(
                value=False,
                description="apply",
                indent=False,
                tooltip="apply this fix to the live objects now",
                layout=widgets.Layout(width="72px", flex="0 0 auto"),
            )
            if finding.fixable
            else None
        )
        caveat = f"<div><i>caveat:</i> {_e(finding.caveat)}</div>" if finding.caveat else ""
        self.info = widgets.HTML(
            f"<b>{_e(finding.title)}</b> <code>{_e(finding.id)}</code>"
            f"<div>{_e(finding.evidence)}</div>"
            f"<div><i>where:</i> {_e(finding.where)} · <i>guide:</i> {_e(finding.guide)}</div>"
            f"{caveat}"
        )
        self.result = widgets.HTML()
        self.problem = widgets.HTML()
        self.measured_win = False  # the latest solo measurement beat the baseline clearly
        self._last_result = ""
        spacer = widgets.Box(layout=widgets.Layout(width="72px", flex="0 0 auto"))
        self.box = widgets.HBox(
            [self.toggle or spacer, widgets.VBox([self.info, self.result, self.problem])],
            layout=widgets.Layout(border_bottom="1px solid #ddd", padding="4px 0"),
        )

    def show(self, report: Report) -> None:
        """The fix's own measurement in this report, else the last one, marked as earlier."""
        if not self.finding.fixable:
            self.result.value = "<i>no live fix: make the code change (Show code changes)</i>"
            return
        variant = summary.solo_variant(report, self.finding)
        if variant is None and report.measuring:
            self.result.value = f"<i>{summary.MEASURING}</i>"
        elif variant is not None:
            self.measured_win = variant.is_win
            self._last_result = _result_html(report, variant)
            self.result.value = self._last_result
        elif self._last_result:
            self.result.value = f"{self._last_result} <i>(earlier measurement)</i>"
        else:
            self.result.value = "<i>not measured alone; toggle it on and Re-time</i>"


class _PanelRoot(widgets.VBox):
    """The panel's outermost box. Its `text/plain` is what a front end shows when it will not
    render widgets (an untrusted notebook); the JupyterLab renderer hides exactly that line
    next to the saved report, so it must stay in step with labextension/src/coexist.ts."""

    run_id = ""

    def __repr__(self) -> str:
        return f"torchtune-magic live panel (run {self.run_id})"


class Panel:
    """The live %%perfcheck panel for one Session.

    `Panel(shell)` builds it without displaying anything (tests, embedding); the magic uses
    `Panel.measuring(shell)` to show it at once, feeds `progress` and `update` (the report
    as it grows: findings first, then numbers) while the session runs, then calls `attach`
    with the session so the controls work, or `close` if the cell raised before any report.
    """

    def __init__(self, shell: Any | None = None, run_id: str = ""):
        self._shell = shell
        self.session: Session | None = None
        self.report: Report | None = None
        self.rows: dict[str, _Row] = {}
        self._syncing = False
        self._cell_parent: dict[str, Any] | None = None
        self._displayed_report = False

        self.header = widgets.HTML("<b>%%perfcheck</b> · running the cell, then measuring…")
        self.bar = widgets.FloatProgress(
            value=0.0, min=0.0, max=1.0, layout=widgets.Layout(width="240px")
        )
        self.status = widgets.Label("")
        self.progress_box = widgets.HBox([self.bar, self.status])
        self.rows_box = widgets.VBox()
        self.retime_button = widgets.Button(
            description="Re-time",
            icon="refresh",
            tooltip="measure the fixes toggled on (together and each alone) against the baseline",
        )
        self.wins_button = widgets.Button(
            description="Apply all measured wins",
            tooltip="toggle on every fix measured faster than the baseline",
        )
        self.revert_button = widgets.Button(
            description="Revert all", tooltip="undo every applied fix"
        )
        self.code_toggle = widgets.ToggleButton(description="Show code changes")
        self.chart = widgets.HTML()
        self.code_view = widgets.HTML()
        self.optimized = widgets.Textarea(
            layout=widgets.Layout(width="100%", height="180px"),
            tooltip="the cell with the code changes: select all and copy",
        )
        self.code_box = widgets.VBox(
            [
                self.code_view,
                widgets.HTML(f"<i>{_e(NO_INSERT_FROM_BUTTON)}</i>"),
                self.optimized,
            ],
            layout=widgets.Layout(display="none"),
        )
        self.notes = widgets.HTML()
        self.log = widgets.Output()
        self.buttons = widgets.HBox(
            [self.retime_button, self.wins_button, self.revert_button, self.code_toggle]
        )
        for button in self.buttons.children:
            button.layout.width = "auto"  # the default width cuts the longer labels
        self.root = _PanelRoot(
            [
                self.header,
                self.progress_box,
                self.rows_box,
                self.buttons,
                self.chart,
                self.code_box,
                self.notes,
                self.log,
            ]
        )
        self.root.add_class("ttm-live-panel")
        if run_id:
            self._mark_run(run_id)
        self._set_busy(True)

        self.retime_button.on_click(lambda _: self._guarded(self.retime))
        self.wins_button.on_click(lambda _: self._guarded(self.apply_wins))
        self.revert_button.on_click(lambda _: self._guarded(self.revert_all))
        self.code_toggle.observe(lambda _: self._guarded(self._refresh_code), "value")

    @classmethod
    def measuring(cls, shell: Any, run_id: str) -> Panel:
        """Show the panel now, so its progress bar moves during the first measurement."""
        panel = cls(shell, run_id)
        display(panel.root)
        return panel

    def _mark_run(self, run_id: str) -> None:
        """Tie the panel to its run, so the saved report of the same run hides behind it."""
        self.root.run_id = run_id
        self.root.add_class(f"ttm-run-{run_id}")

    @property
    def display_id(self) -> str | None:
        run_id = self.session.run_id if self.session else self.root.run_id
        return f"ttm-report-{run_id}" if run_id else None

    # wiring ---------------------------------------------------------------------------------
    def progress(self, fraction: float, message: str) -> None:
        """The Session's progress callback."""
        self.bar.value = max(0.0, min(1.0, fraction))
        self.status.value = message

    def update(self, report: Report) -> None:
        """Show the report as it stands (the session's `on_report`): rows as soon as the
        findings are in, numbers as they are measured; the saved-report output follows."""
        ids = [f.id for f in report.findings]
        if set(self.rows) != set(ids):
            self._build_rows(report)
        elif list(self.rows) != ids:  # re-sorted by measured gain: same rows, new order
            self.rows = {i: self.rows[i] for i in ids}
            self.rows_box.children = [row.box for row in self.rows.values()]
        if self.root.run_id != report.run_id and report.run_id:
            self._mark_run(report.run_id)
        self._show(report)
        self._publish(report)

    def attach(self, session: Session, report: Report) -> None:
        """Bind the session so toggles, Re-time and the other controls act on it."""
        self.session = session
        session.progress = self.progress
        session.on_report = self.update
        self.update(report)
        self._sync_toggles()
        self._set_busy(False)

    def _build_rows(self, report: Report) -> None:
        self.rows = {f.id: _Row(f) for f in report.findings}
        for row in self.rows.values():
            if row.toggle is not None:
                row.toggle.disabled = self.session is None
                row.toggle.observe(
                    lambda change, row=row: self._guarded(lambda: self._toggled(row, change)),
                    "value",
                )
        self.rows_box.children = [row.box for row in self.rows.values()]

    def close(self) -> None:
        """Close every widget of the panel (the cell raised, or the panel is done)."""
        for widget in self._widgets():
            widget.close()

    # actions (what the buttons do; callable from Python too) ---------------------------------
    def retime(self) -> Report:
        """Measure the toggled set (and each toggled fix alone) against the baseline; with
        nothing toggled, every fix alone and all together again."""
        session = self._session()
        applied = session.applied_ids
        fix_sets = [applied, *([i] for i in applied)] if len(applied) > 1 else [applied]
        with self._busy():
            report = session.measure(fix_sets if applied else None, budget_s=session.options.budget)
        return report

    def apply_wins(self) -> None:
        """Toggle on every fix whose latest solo measurement was clearly faster than the
        baseline (a 1.01x is no measurable change, not a win)."""
        for row in self.rows.values():
            if row.toggle is not None and row.measured_win:
                row.toggle.value = True

    def revert_all(self) -> None:
        self._session().revert_all()
        for row in self.rows.values():
            row.problem.value = ""
        self._sync_toggles()
        self._refresh_code()

    # internals ------------------------------------------------------------------------------
    def _session(self) -> Session:
        if self.session is None:
            raise RuntimeError("the panel has no session yet: attach() first")
        return self.session

    def _toggled(self, row: _Row, change: dict[str, Any]) -> None:
        """Apply or undo at once; a fix that cannot apply says why and switches back off."""
        if self._syncing:
            return
        session = self._session()
        row.problem.value = ""
        if change["new"]:
            try:
                session.apply(row.finding.id)
            except FixError as error:
                row.problem.value = (
                    f'<span style="color:{LOSS}">could not apply: {_e(error.reason)}</span>'
                )
                self._sync_toggles()
        else:
            session.undo(row.finding.id)
        self._refresh_code()

    def _sync_toggles(self) -> None:
        """Make every toggle show what is applied, without re-triggering apply/undo."""
        applied = set(self._session().applied_ids)
        self._syncing = True
        try:
            for check_id, row in self.rows.items():
                if row.toggle is not None:
                    row.toggle.value = check_id in applied
        finally:
            self._syncing = False

    def _show(self, report: Report) -> None:
        self.report = report
        context = "".join(
            f"<br>{_e(line)}"
            for line in (
                summary.phase_line(report),
                summary.sampling_line(report),
                summary.cell_run_line(report),
            )
            if line
        )
        self.header.value = f"<b>%%perfcheck</b> · {_e(summary.baseline_line(report))}{context}" + (
            ""
            if report.findings
            else "<br>No findings: nothing in this cell matches the tuning guide's checks."
        )
        for row in self.rows.values():
            row.show(report)
        self.chart.value = self._chart_html(report)
        notes = [f"<li><code>{_e(n.id)}</code>: {_e(n.reason)}</li>" for n in report.not_applicable]
        notes += [f"<li>warning: {_e(w)}</li>" for w in report.warnings]
        self.notes.value = f"<ul>{''.join(notes)}</ul>" if notes else ""
        self._refresh_code()

    @staticmethod
    def _chart_html(report: Report) -> str:
        """The shared SVG time chart, the sets measured together, and memory where it moved."""
        together = "".join(
            f"<div>together ({_e(', '.join(v.fixes))}): {_result_html(report, v)}</div>"
            for v in report.latest_variants()
            if len(v.fixes) > 1
        )
        base = report.baseline.peak_memory_bytes
        memory = "".join(
            f"<div>peak memory with {_e('+'.join(v.fixes))}: "
            f"{_e(summary.memory_change(report, v))}</div>"
            for v in report.latest_variants()
            if v.peak_memory_bytes is not None
            and base
            and abs(v.peak_memory_bytes / base - 1) >= MEMORY_CHANGE
        )
        return f"{html.chart(report)}{together}{memory}"

    def _refresh_code(self) -> None:
        """The diff of the cell with the changes of the fixes toggled on (all when none is),
        the edits to make elsewhere, and the optimized cell to copy."""
        self.code_box.layout.display = "flex" if self.code_toggle.value else "none"
        if not self.code_toggle.value or self.session is None or self.report is None:
            return
        applied = self.session.applied_ids
        cell = self.session.suggested_cell()
        diff = codeedit.unified_diff(self.session.workload.source, cell)
        elsewhere = [
            item
            for finding in self.report.findings
            if finding.code_change and (not applied or finding.id in applied)
            for item in finding.code_change.elsewhere
        ]
        scope = f"the fixes toggled on ({', '.join(applied)})" if applied else "all findings"
        self.code_view.value = (
            f"<div>Code changes for {_e(scope)}:</div>"
            + (f"<pre>{_e(diff)}</pre>" if diff else "<div><i>no change to the cell</i></div>")
            + (
                "<div>Elsewhere:</div><ul>"
                + "".join(f"<li>{_e(item)}</li>" for item in elsewhere)
                + "</ul>"
                if elsewhere
                else ""
            )
        )
        self.optimized.value = cell

    def _publish(self, report: Report) -> None:
        """Show or update the saved-report output, as an output of the %%perfcheck cell.

        A button click is a comm message, and JupyterLab/Notebook 7 route an output update
        to a cell only when its parent is that cell's execute request; so the update is
        sent under the parent the cell had when the report was first displayed.
        """
        if self._shell is None:
            return
        if not self._displayed_report:
            self._displayed_report = True
            self._cell_parent = self._current_parent()
            display(bundle.render(report), raw=True, display_id=self.display_id)
            return
        publisher = getattr(self._shell, "display_pub", None)
        token = None
        if self._cell_parent and hasattr(publisher, "set_thread_parent"):
            token = publisher.set_thread_parent(self._cell_parent)
        try:
            update_display(bundle.render(report), raw=True, display_id=self.display_id)
        finally:
            if token is not None:
                publisher.reset_thread_parent(token)

    def _current_parent(self) -> dict[str, Any] | None:
        """The kernel message being handled now (the cell's execute request), if any."""
        parent = getattr(self._shell, "parent_header", None)
        return parent if isinstance(parent, dict) and parent.get("header") else None

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Controls off and the bar shown while measuring; back on however it ends."""
        self._set_busy(True)
        self.progress(0.0, "measuring…")
        try:
            yield
        finally:
            self._set_busy(False)
            self._sync_toggles()

    def _set_busy(self, busy: bool) -> None:
        self.progress_box.layout.display = "flex" if busy else "none"
        for button in (self.retime_button, self.wins_button, self.revert_button):
            button.disabled = busy
        for row in self.rows.values():
            if row.toggle is not None:
                row.toggle.disabled = busy

    def _guarded(self, action: Callable[[], object]) -> None:
        """Run a callback so that its output and any error land in the panel, never lost
        (in JupyterLab, output of a widget callback outside an Output widget is dropped)."""
        with self.log:
            try:
                action()
            except Exception:
                self.log.append_stderr(traceback.format_exc())

    def _widgets(self) -> Iterator[widgets.Widget]:
        """Every widget of the panel, children before parents."""

        def walk(widget: widgets.Widget) -> Iterator[widgets.Widget]:
            for child in getattr(widget, "children", ()):
                yield from walk(child)
            yield widget

        yield from walk(self.root)
