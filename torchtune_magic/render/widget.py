"""The live panel: state and commands in Python, the view in the browser.

The view is the labextension's TypeScript view of the report, bundled as an anywidget ES
module (`torchtune_magic/static/widget.js`, built by the same `jlpm` build as the
labextension), so the live panel and the saved report are one view from one source, and
the panel renders wherever anywidget does: JupyterLab, Notebook 7, VS Code, Colab.

Python holds the state the view draws (synced traitlets: the report dict, progress,
busy, per-row messages) and carries out the commands the view sends as custom messages:
toggle a fix on or off, Re-time, Apply all measured wins, Revert all, Show code. "Apply
to notebook" never reaches the kernel: the view hands the report's `notebook_edits` to
the labextension, which alone can edit notebook cells.

The last report is also published as its own MIME output under a fixed display id,
updated on every change, because a saved notebook cannot restore widgets. Its place is
held right below the panel from the start (an empty output under that display id), so
what the cell prints comes after both: live, the cell's output sits below the panel, and
in the saved notebook below the report that stands in for it.

This is the only module that imports anywidget or ipywidgets: the engine never does.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator
from typing import Any

import anywidget
import traitlets
from IPython.display import display, update_display

from ..kernel import allocator
from ..kernel.fixes import FixError
from ..report import Report
from ..session import Session
from . import bundle
from .front_end import ES_MODULE, STYLES, missing_front_end

PROGRESS_EVERY_S = 1.0

# anywidget reads `_esm` and `_css` when the class below is defined: without the built
# files, say how to build them rather than fail deep inside anywidget (the magic asks
# `front_end.missing_front_end()` first and never imports this module then)
if (_unbuilt := missing_front_end()) is not None:
    raise ImportError(f"torchtune_magic's live panel cannot load: {_unbuilt}")


class PanelWidget(anywidget.AnyWidget):
    """The synced state of one live panel. The ES module redraws the view on any change."""

    _esm = ES_MODULE
    _css = STYLES

    report = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    run_id = traitlets.Unicode("").tag(sync=True)
    attached = traitlets.Bool(False).tag(sync=True)  # the controls act on a session
    busy = traitlets.Bool(True).tag(sync=True)  # measuring: controls off, progress shown
    progress = traitlets.Float(0.0).tag(sync=True)
    progress_message = traitlets.Unicode("").tag(sync=True)
    # finding id -> {"text", "kind": "refused"|"error"|"info", "rerun": bool}
    messages = traitlets.Dict().tag(sync=True)
    notice = traitlets.Unicode("").tag(sync=True)  # an action that failed, for the panel
    code_open = traitlets.Bool(False).tag(sync=True)

    def __repr__(self) -> str:
        """The `text/plain` a front end shows when it will not render widgets (an untrusted
        notebook); the labextension hides exactly this line next to the saved report, so
        it must stay in step with labextension/src/coexist.ts."""
        return f"torchtune-magic live panel (run {self.run_id})"


class Panel:
    """The live %%perfcheck panel for one Session.

    `Panel(shell, run_id)` builds it without displaying anything (tests, embedding); the
    magic uses `Panel.measuring(shell, run_id)` to show it at once, feeds `progress` and
    `update` (the report as it grows: findings first, then numbers) while the session
    runs, then calls `attach` with the session so the controls work, or `close` if the
    cell raised before any report.
    """

    def __init__(self, shell: Any | None = None, run_id: str = ""):
        self._shell = shell
        self.session: Session | None = None
        self.report: Report | None = None
        self._cell_parent: dict[str, Any] | None = None
        self._displayed_report = False
        self._progress_at, self._progress_step = 0.0, ""
        # marked from the start (the comm's opening state), for the labextension's coexist
        classes = ["ttm-live-panel", *([f"ttm-run-{run_id}"] if run_id else [])]
        self.widget = PanelWidget(run_id=run_id, _dom_classes=classes)
        self.widget.on_msg(self._on_message)

    @classmethod
    def measuring(cls, shell: Any, run_id: str) -> Panel:
        """Show the panel now, so its progress moves during the first measurement, and
        hold the saved report's place right below it (filled in when the findings are in)."""
        panel = cls(shell, run_id)
        display(panel.widget)
        panel._cell_parent = panel._current_parent()
        display(display_id=panel.display_id)  # empty until the first report
        panel._displayed_report = True
        return panel

    def _mark_run(self, run_id: str) -> None:
        """Tie the panel to its run, so the saved report of the same run hides behind it."""
        self.widget.run_id = run_id
        self.widget.add_class(f"ttm-run-{run_id}")

    @property
    def display_id(self) -> str | None:
        run_id = self.session.run_id if self.session else self.widget.run_id
        return f"ttm-report-{run_id}" if run_id else None

    # wiring ---------------------------------------------------------------------------------
    def progress(self, fraction: float, message: str) -> None:
        """The Session's progress callback ("round 2 of at most 9: debug-anomaly"), at most
        every PROGRESS_EVERY_S unless the step changes (first runs, rounds, profiled runs):
        each message makes the browser redraw, on the CPUs the kernel's next timed run
        needs."""
        now, step = time.perf_counter(), message.split(" ", 1)[0]
        if now - self._progress_at < PROGRESS_EVERY_S and step == self._progress_step:
            return
        self._progress_at, self._progress_step = now, step
        with self.widget.hold_sync():
            self.widget.progress = max(0.0, min(1.0, fraction))
            self.widget.progress_message = message

    def update(self, report: Report) -> None:
        """Show the report as it stands (the session's `on_report`): findings as soon as
        they are in, numbers as they are measured; the saved-report output follows."""
        self.report = report
        if report.run_id and self.widget.run_id != report.run_id:
            self._mark_run(report.run_id)
        self.widget.report = report.to_dict()
        self._publish(report)

    def attach(self, session: Session, report: Report) -> None:
        """Bind the session so toggles, Re-time and the other controls act on it."""
        self.session = session
        session.progress = self.progress
        session.on_report = self.update
        self.update(report)
        with self.widget.hold_sync():
            self.widget.attached = True
            self.widget.busy = False

    def close(self) -> None:
        """Close the panel's widget (the cell raised, or the panel is done)."""
        self.widget.close()

    # actions (what the buttons do; callable from Python too) ---------------------------------
    def toggle(self, check_id: str, on: bool) -> None:
        """Apply or undo a fix at once. A fix that cannot apply (a name rebound since the
        probe, an object it cannot change) says why in its row and stays off."""
        session = self._session()
        self._set_message(check_id, None)
        if not on:
            self._show_notes(session.undo(check_id))
            return
        try:
            session.apply(check_id)
        except FixError as error:
            refused = {"text": f"could not apply: {error.reason}", "kind": "refused", "rerun": True}
            self._set_message(check_id, refused)

    def retime(self) -> Report:
        """Measure the applied set (and each applied fix alone) against the baseline; with
        nothing applied, every fix alone and all together again. Earlier measurements stay
        in the report, marked as such."""
        session = self._session()
        applied = session.applied_ids
        fix_sets = [applied, *([i] for i in applied)] if len(applied) > 1 else [applied]
        try:
            with self._busy():
                return session.measure(
                    fix_sets if applied else None, budget_s=session.options.budget
                )
        finally:
            allocator.give_back_freed()  # what the profiled runs freed (see its docstring)

    def apply_wins(self) -> None:
        """Apply every fix whose newest solo measurement was clearly faster than the
        baseline: its interval above 1 (a 1.01x is no clear change, not a win)."""
        report = self._session().report
        if report is None:
            return
        applied = self._session().applied_ids
        for finding in report.findings:
            variant = report.variant_for([finding.id])
            won = finding.fixable and variant is not None and variant.is_win
            if won and finding.id not in applied:
                self.toggle(finding.id, True)

    def revert_all(self) -> None:
        """Undo every applied fix; a place the user rebound keeps their object (said so)."""
        self.widget.messages = {}
        self._show_notes(self._session().revert_all())

    def show_code(self, open_: bool) -> None:
        """Open or close the code changes (the view keeps them in step with the fixes)."""
        self.widget.code_open = open_

    # internals ------------------------------------------------------------------------------
    def _on_message(self, _widget: Any, content: dict[str, Any], _buffers: list[Any]) -> None:
        """A command from the view. Errors land in the panel, never lost: in JupyterLab,
        what a comm handler prints or raises is shown nowhere."""
        command = content.get("command")
        self.widget.notice = ""
        try:
            if command == "toggle":
                self.toggle(str(content["id"]), bool(content["on"]))
            elif command == "retime":
                self.retime()
            elif command == "apply_wins":
                self.apply_wins()
            elif command == "revert_all":
                self.revert_all()
            elif command == "show_code":
                self.show_code(bool(content.get("open")))
            else:
                raise ValueError(f"unknown panel command {command!r}")
        except Exception as error:
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            self.widget.notice = f"{command}: {last}"

    def _session(self) -> Session:
        if self.session is None:
            raise RuntimeError("the panel has no session yet: attach() first")
        return self.session

    def _set_message(self, check_id: str, message: dict[str, Any] | None) -> None:
        messages = {k: v for k, v in self.widget.messages.items() if k != check_id}
        if message is not None:
            messages[check_id] = message
        self.widget.messages = messages  # a new dict: traitlets syncs on assignment only

    def _show_notes(self, notes: list[str]) -> None:
        """Undo notes ("debug-anomaly: … left as you rebound it") in their fix's row."""
        for note in notes:
            check_id, _, text = note.partition(": ")
            self._set_message(check_id, {"text": f"left as you rebound it: {text}", "kind": "info"})

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
        """Controls off and progress shown while measuring; back on however it ends."""
        with self.widget.hold_sync():
            self.widget.busy = True
            self.widget.progress = 0.0
            self.widget.progress_message = "measuring…"
        try:
            yield
        finally:
            self.widget.busy = False
