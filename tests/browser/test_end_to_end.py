"""A real `%%perfcheck` run in JupyterLab: live panel, toggle + Re-time, and the saved report."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from torchtune_magic import demo

from .lab import Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser

# Measuring on a busy 2-core machine: the probe, warm-ups and interleaved runs take a while.
MEASURE_TIMEOUT = 120_000


def test_perfcheck_cell_toggle_retime_and_saved_report(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook(
        "demo.ipynb",
        ["%load_ext torchtune_magic\n" + demo.SETUP, "%%perfcheck --budget 2\n" + demo.CELL],
    )
    lab.open_notebook(notebook)
    lab.run_cell(0)
    panel = lab.run_cell(1, ".ttm-live-panel[class*='ttm-run-']", timeout=MEASURE_TIMEOUT)
    report = lab.cell(1).locator(".ttm-report")

    def speedup(finding: str):
        return report.locator(f"tr[data-finding='{finding}'] .ttm-speedup")

    # Live: the panel lists the findings; the saved report is there, up to date, but hidden.
    # (The panel carries its run id from the start: wait for the measuring to finish.)
    expect(panel).to_be_visible()
    for finding in ("debug-anomaly", "zero-grad-none"):
        expect(panel.locator("code", has_text=finding).first).to_be_visible(timeout=MEASURE_TIMEOUT)
        expect(speedup(finding)).to_contain_text("×")
    expect(report).to_be_hidden()
    lab.screenshot("measured")

    # Toggle one fix on and re-time: the panel and the saved report both update.
    code = lab.page.locator("code", has_text="debug-anomaly")
    row = panel.locator(".widget-hbox").filter(has=code)
    row.last.locator("input[type='checkbox']").check()
    panel.get_by_role("button", name="Re-time").click()
    expect(speedup("zero-grad-none")).to_have_text("not measured", timeout=MEASURE_TIMEOUT)
    expect(speedup("debug-anomaly")).to_contain_text("×")
    expect(report.locator("tr[data-finding='debug-anomaly'] .ttm-badge-applied")).to_have_count(1)
    expect(report).to_be_hidden()
    lab.screenshot("retimed")

    # Reopened without the kernel: the last report shows, the dead panel does not.
    lab.save(notebook)
    jupyter_lab.shutdown_kernels()
    lab.page.reload()
    report = lab.cell(1).locator(".ttm-report")
    expect(report).to_be_visible()
    expect(speedup("zero-grad-none")).to_have_text("not measured")
    expect(lab.cell(1).locator(".jp-OutputArea-child[data-ttm-hidden]")).to_have_count(1)
    expect(lab.page.get_by_text("Error displaying widget").filter(visible=True)).to_have_count(0)
    lab.screenshot("reopened")
