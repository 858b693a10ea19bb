"""Cell sources used by the browser tests."""

from __future__ import annotations

DISPLAY_REPORT = """\
import json
from IPython.display import display

report = json.load(open({source!r}))
report["run_id"] = {run_id!r}
{edit}display({{
    "application/vnd.torchtune-magic.report.v1+json": report,
    "text/html": "<b>html fallback of the report</b>",
    "text/plain": "<torchtune-magic report>",
}}, raw=True)
"""

LIVE_PANEL = """\
import ipywidgets as widgets

panel = widgets.VBox([widgets.Label("live perfcheck panel")])
panel.add_class("ttm-live-panel")
panel.add_class("ttm-run-" + {run_id!r})
display(panel)
"""


def display_report(run_id: str, source: str = "sample_report.json", edit: str = "") -> str:
    """A cell that displays a sample report bundle with this run id; `edit` is code run on
    `report` (the parsed JSON) before it is displayed."""
    return DISPLAY_REPORT.format(run_id=run_id, source=source, edit=edit)


def live_panel_and_report(run_id: str) -> str:
    """A cell that shows a live panel and then the report of the same run."""
    return LIVE_PANEL.format(run_id=run_id) + "\n" + display_report(run_id)


PANEL_OF_REPORT = """\
import json
from torchtune_magic.render.widget import Panel
from torchtune_magic.report import Report

report = json.load(open({source!r}))
report["run_id"] = {run_id!r}
{edit}panel = Panel.measuring(get_ipython(), {run_id!r})  # as %%perfcheck shows it
panel.update(Report.from_dict(report))  # the saved report follows, as in a real run
panel.widget.busy = False
"""


def panel_of_report(run_id: str, source: str = "sample_report.json", edit: str = "") -> str:
    """A cell that shows the live panel (the real anywidget, no session) of a sample
    report, and the saved report of the same run, as `%%perfcheck` does."""
    return PANEL_OF_REPORT.format(run_id=run_id, source=source, edit=edit)
