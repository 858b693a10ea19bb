"""The saved report and the live ipywidgets panel of the same run never show together."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from .cells import live_panel_and_report
from .lab import Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser

RUN_ID = "live-0001"


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
