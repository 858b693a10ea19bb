"""The saved report and the live ipywidgets panel of the same run never show together."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from .cells import live_panel_and_report
from .lab import REPORT_MIME, Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser

RUN_ID = "live-0001"
WIDGET_VIEW = {
    "application/vnd.jupyter.widget-view+json": {
        "model_id": "0123456789abcdef0123456789abcdef",
        "version_major": 2,
        "version_minor": 0,
    },
    # The live panel's repr, which the Python side makes recognisable.
    "text/plain": f"torchtune-magic live panel (run {RUN_ID})",
}


def test_live_panel_hides_report_until_the_kernel_is_gone(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook(
        "live.ipynb", [live_panel_and_report(RUN_ID), 'panel.close()\nprint("closed")']
    )
    lab.open_notebook(notebook)
    cell = lab.cell(0)
    panel = lab.run_cell(0, f".ttm-live-panel.ttm-run-{RUN_ID}")
    report = cell.locator(".ttm-report")

    expect(panel).to_be_visible()
    expect(panel).to_contain_text("live perfcheck panel")
    expect(report).to_be_attached()
    expect(report).to_be_hidden()
    lab.screenshot("live")

    # The panel goes away (closed widget): the report shows instead.
    lab.run_cell(1, ".jp-RenderedText")
    expect(cell.locator(".ttm-live-panel")).to_have_count(0)
    expect(report).to_be_visible()

    lab.save(notebook)
    jupyter_lab.shutdown_kernels()
    lab.page.reload()

    report = lab.cell(0).locator(".ttm-report")
    expect(report).to_be_visible()
    # The saved widget view cannot be restored and is hidden once it has failed.
    expect(lab.cell(0).locator(".jp-OutputArea-child[data-ttm-hidden]")).to_have_count(1)
    expect(lab.page.get_by_text("Error displaying widget").filter(visible=True)).to_have_count(0)
    expect(report).to_be_visible()
    lab.screenshot("reopened")


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_saved_report_replaces_the_panel_placeholder_without_a_kernel(
    lab: Lab, jupyter_lab: JupyterLab, sample_report: dict[str, Any], trusted: bool
) -> None:
    """Trusted: the widget view stays "Loading widget..." (no kernel, no manager);
    untrusted: JupyterLab shows the panel's text/plain repr. Either way only the report shows."""
    report_bundle = {REPORT_MIME: {**sample_report, "run_id": RUN_ID}, "text/plain": "report"}
    notebook = jupyter_lab.write_saved_notebook(
        f"no-kernel-{'trusted' if trusted else 'untrusted'}.ipynb",
        "%%perfcheck\ntrain()",
        [WIDGET_VIEW, report_bundle],
        trusted=trusted,
    )
    lab.goto_notebook(notebook)
    lab.page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-reject").click()  # "No Kernel"

    cell = lab.cell(0)
    expect(cell.locator(".ttm-report")).to_be_visible()
    hidden = cell.locator(".jp-OutputArea-child[data-ttm-hidden] .jp-OutputArea-output")
    expect(hidden).to_have_count(1)
    if trusted:
        expect(hidden).to_have_text("Loading widget...")
    else:
        expect(hidden).to_have_attribute("data-mime-type", "text/plain")
    for text in ("Loading widget", "Error displaying widget", "torchtune-magic live panel"):
        expect(lab.page.get_by_text(text).filter(visible=True)).to_have_count(0)
    lab.screenshot("no-kernel")
