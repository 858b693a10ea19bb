"""The report MIME renderer in a real JupyterLab: content, escaping, and saved outputs."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from .cells import display_report
from .lab import Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser


def test_report_renders_findings_table_and_chart(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook("render.ipynb", [display_report("render-1")])
    lab.open_notebook(notebook)
    report = lab.run_cell(0, ".ttm-report")
    expect(report).to_be_visible()

    # Our renderer wins over the bundle's HTML fallback.
    outputs = lab.cell(0).locator(".jp-OutputArea")
    expect(outputs.get_by_text("html fallback of the report")).to_have_count(0)

    summary = report.locator(".ttm-summary")
    expect(summary).to_contain_text("x86_64 CPU (cpu, 2 CPUs, 2 torch threads)")
    expect(summary).to_contain_text("2.13.0+cpu")
    expect(summary).to_contain_text("412 ms ± 11.0 ms")
    expect(summary).to_contain_text("288.0 MiB")

    rows = report.locator(".ttm-findings tbody tr")
    expect(rows).to_have_count(3)
    anomaly = report.locator("tr[data-finding='debug-anomaly']")
    expect(anomaly.locator(".ttm-speedup")).to_have_text("1.54× faster")
    expect(anomaly).to_contain_text("−4.0 MiB (−1.4%)")
    expect(anomaly.locator(".ttm-verdict-identical")).to_have_text("identical")
    slower = report.locator("tr[data-finding='zero-grad-none'] .ttm-speedup")
    expect(slower).to_have_text(re.compile("measured slower here — not recommended"))
    expect(slower).not_to_contain_text("faster")
    expect(report.locator("tr[data-finding='conv-bias-bn'] .ttm-speedup")).to_have_text(
        "not auto-fixable"
    )

    chart = report.locator("svg.ttm-chart")
    expect(chart).to_be_visible()
    # Time: baseline + 3 variants; memory: baseline + the 2 variants whose peak changed.
    expect(chart.locator("rect.ttm-chart-bar")).to_have_count(7)
    time_labels = ["baseline", "debug-anomaly", "zero-grad-none", "all fixes"]
    memory_labels = ["baseline", "debug-anomaly", "all fixes"]
    expect(chart.locator(".ttm-chart-label")).to_have_text([*time_labels, *memory_labels])
    expect(chart.locator(".ttm-bar-worse .ttm-chart-label")).to_have_text(["zero-grad-none"])

    changes = report.locator(".ttm-code-changes")
    expect(changes.locator(".ttm-diff-del")).to_contain_text(
        ["-torch.autograd.set_detect_anomaly(True)", "-    opt.zero_grad(set_to_none=False)"]
    )
    expect(changes.locator(".ttm-diff-add")).to_contain_text(["set_to_none=True"])
    expect(changes.locator(".ttm-elsewhere li")).to_have_text(
        ["model.features.0: nn.Conv2d(3, 16, 3, bias=False)"]
    )
    copy = changes.locator("button.ttm-copy")
    expect(copy).to_have_count(3)
    copy.first.click()
    expect(copy.first).to_have_text("Copied")

    expect(report.locator(".ttm-not-applicable")).to_contain_text("pin-memory")
    lab.screenshot("report")


def test_report_strings_are_rendered_as_text(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook("escaping.ipynb", [display_report("escaping-1")])
    lab.open_notebook(notebook)
    report = lab.run_cell(0, ".ttm-report")
    row = report.locator("tr[data-finding='conv-bias-bn']")
    expect(row.locator(".ttm-finding-title")).to_have_text(
        "Conv bias <img src=x onerror=alert(1)> before BatchNorm"
    )
    expect(row).to_contain_text("model.features.0 <script>alert(2)</script>")
    expect(report.locator("img, script, iframe, object")).to_have_count(0)
    expect(lab.page.locator("img[src='x']")).to_have_count(0)
    lab.page.wait_for_timeout(500)  # an injected onerror handler would have fired by now
    assert lab.dialogs == []
    lab.screenshot("escaping")


def test_saved_report_renders_after_kernel_shutdown_and_reload(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook("reload.ipynb", [display_report("reload-1")])
    lab.open_notebook(notebook)
    lab.run_cell(0, ".ttm-report")
    lab.save(notebook)
    jupyter_lab.shutdown_kernels()

    lab.page.reload()
    report = lab.cell(0).locator(".ttm-report")
    expect(report).to_be_visible()
    expect(report.locator(".ttm-findings tbody tr")).to_have_count(3)
    expect(report.locator("svg.ttm-chart rect.ttm-chart-bar")).to_have_count(7)
    lab.screenshot("reloaded")
