"""The report where no widget can render: a display updated in place, plus a progress line.

In a notebook front end without widgets (ipywidgets missing, an nbclient run without
widget state), the report bundle is displayed as soon as the findings are in and updated
in place as numbers arrive, so the saved notebook holds the last one. In a terminal, where
an "update" prints anew, the report is printed when the findings are in and when it is done.
"""

from __future__ import annotations

from typing import Any

from IPython.display import display

from ..report import Report
from . import bundle, text

PROGRESS_STEPS = 10  # the progress line changes at most this many times per phase


class StaticDisplay:
    """`progress` and `report` callbacks for a Session, shown without widgets."""

    def __init__(self, in_place: bool):
        self.in_place = in_place
        self._report_handle: Any = None
        self._shown_phases: set[str] = set()
        self._progress_handle = display({"text/plain": "measuring…"}, raw=True, display_id=True)
        self._progress_shown: tuple[int, str] = (-1, "")

    def progress(self, fraction: float, message: str) -> None:
        step = int(fraction * PROGRESS_STEPS)
        kind = message.split(":")[0]
        if (step, kind) == self._progress_shown or self._progress_handle is None:
            return
        self._progress_shown = (step, kind)
        line = f"{message} ({fraction:.0%})" if fraction else message
        self._progress_handle.update({"text/plain": line}, raw=True)

    def report(self, report: Report) -> None:
        if self.in_place:
            if self._report_handle is None:
                self._report_handle = display(bundle.render(report), raw=True, display_id=True)
            else:
                self._report_handle.update(bundle.render(report), raw=True)
            return
        if report.phase in self._shown_phases or report.phase not in ("measuring", "done"):
            return
        self._shown_phases.add(report.phase)
        print(text.render(report))
