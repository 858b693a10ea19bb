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


# A report with the issue-31 fields (the time split, each finding's part of it, one sentence
# of evidence with its details folded, a check its own trial found slower), prose with
# `code` spans and an option, a fix with more peak memory and a fix set with the same, and
# the not-applicable checks of a CPU run under two reasons.
AT_A_GLANCE = """\
report["time_split"] = {"data_wait": 2.1, "forward": 0.47, "backward": 0.5, "optimizer": 0.1,
                        "other": 0.16}
anomaly, zero_grad, conv = report["findings"]
anomaly.update(
    segment="backward",
    evidence="anomaly mode checked 40 of 40 backward passes (`set_detect_anomaly(True)` at "
    "line 1)",
    details="a trial without it took 0.27 s\\nper batch: 6.8 ms → 4.4 ms",
)
zero_grad.update(segment="optimizer")
conv.update(segment="forward")
base = report["baseline"]["peak_memory_bytes"]
report["variants"][1].update(speedup=1.01, verdict="no clear change", budget_to_tell_s=90.0,
                             peak_memory_bytes=int(base * 1.3))  # more memory
report["variants"][2].update(peak_memory_bytes=base + 1000,  # the same memory
                             numerics={"verdict": "not-compared", "max_rel_diff": None})
report["checked"] = [{
    "id": "channels-last", "title": "Convolutions run in the default memory format",
    "outcome": "slower here",
    "evidence": "slower in channels_last here: model.2.0 (0.66 ms → 10.39 ms, 15.75x the time)",
}]
cuda = "not applicable on CPU: this only matters for work on a CUDA device"
alone = "not a distributed run (torch.distributed is not initialised)"
report["not_applicable"] = [
    *({"id": i, "reason": cuda} for i in ("pin-memory", "tf32", "cudnn-benchmark")),
    *({"id": i, "reason": alone} for i in ("ddp-no-sync", "rank-imbalance")),
]
"""
