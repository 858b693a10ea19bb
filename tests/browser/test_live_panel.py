"""The live panel: it and the saved report of the same run never show together; its badges
read in the dark and the light theme; a cell with no torch work gets no action buttons."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

from .cells import AT_A_GLANCE, live_panel_and_report, panel_of_report
from .lab import ALL_TEXT, LIVE_PANEL, RAW_TEXT, REPORT_MIME, SAVED_REPORT, Lab
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


# Every kind of badge: applied, noisy, each verdict, memory less (good) / more (bad).
EVERY_BADGE = """\
report["applied"] = ["debug-anomaly"]
anomaly, zero_grad, together = report["variants"]
anomaly.update(noisy=True)
zero_grad.update(speedup=1.3, numerics={"verdict": "changed", "max_rel_diff": 0.1})
together.update(peak_memory_bytes=400_000_000, numerics={"verdict": "close", "max_rel_diff": 1e-6})
report["variants"].append(dict(together, fixes=["debug-anomaly", "conv-bias-bn"],
                               numerics={"verdict": "not-compared", "max_rel_diff": None}))
"""

# WCAG 2 contrast of each badge's (and coloured figure's) text over what is behind it.
CONTRASTS = """root => {
  function parse(value) {
    let m = value.match(/rgba?\\(([^)]+)\\)/);
    if (m) {
      const p = m[1].split(/[\\s,/]+/).filter(Boolean).map(Number);
      return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
    }
    m = value.match(/color\\(srgb ([^)]+)\\)/);
    if (m) {
      const p = m[1].split(/[\\s/]+/).filter(Boolean).map(Number);
      return [p[0] * 255, p[1] * 255, p[2] * 255, p.length > 3 ? p[3] : 1];
    }
    return [0, 0, 0, 0];
  }
  const over = (top, bottom) =>
    [0, 1, 2].map(i => top[i] * top[3] + bottom[i] * (1 - top[3])).concat([1]);
  function behind(node) {
    const chain = [];
    for (let n = node; n; n = n.parentElement) chain.unshift(n);
    return chain.reduce((bg, n) => over(parse(getComputedStyle(n).backgroundColor), bg),
                        [255, 255, 255, 1]);
  }
  function luminance(c) {
    const [r, g, b] = c.slice(0, 3).map(v => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  }
  return Array.from(root.querySelectorAll('.ttm-badge, .ttm-speedup-text')).map(node => {
    const bg = behind(node);
    const fg = over(parse(getComputedStyle(node).color), bg);
    const [hi, lo] = [luminance(fg), luminance(bg)].sort((a, b) => b - a);
    return [node.textContent, Math.round(((hi + 0.05) / (lo + 0.05)) * 100) / 100];
  });
}"""


@pytest.mark.parametrize("theme", ["JupyterLab Dark", "JupyterLab Light"])
def test_badges_are_readable_in_the_dark_and_the_light_theme(
    lab: Lab, jupyter_lab: JupyterLab, theme: str
) -> None:
    notebook = jupyter_lab.write_notebook(
        f"badges-{theme.split()[-1].lower()}.ipynb",
        [panel_of_report("badges-1", edit=EVERY_BADGE)],
    )
    lab.open_notebook(notebook)
    light = "false" if theme == "JupyterLab Dark" else "true"
    lab.command("apputils:change-theme", {"theme": theme})
    try:
        expect(lab.page.locator(f"body[data-jp-theme-light='{light}']")).to_have_count(1)
        lab.run_cell(0, ".ttm-live-panel.ttm-run-badges-1 .ttm-findings")
        panel = lab.cell(0).locator(".ttm-live-panel")
        panel.evaluate("p => p.querySelectorAll('details').forEach(d => (d.open = true))")
        kinds = panel.locator(".ttm-badge").evaluate_all(
            "nodes => [...new Set(nodes.flatMap(n => [...n.classList]))]"
        )
        for kind in ("ttm-badge-applied", "ttm-badge-noisy", "ttm-tone-good", "ttm-tone-bad"):
            assert kind in kinds
        for verdict in ("identical", "close", "changed", "not-compared"):
            assert f"ttm-verdict-{verdict}" in kinds
        contrasts = panel.evaluate(CONTRASTS)
        assert len(contrasts) >= 10
        low = [(text, ratio) for text, ratio in contrasts if ratio < 4.5]
        assert low == [], f"below WCAG AA 4.5:1 in {theme}: {low}"
        # badges never wrap mid-word
        heights = panel.locator(".ttm-badge").evaluate_all(
            "nodes => nodes.map(n => n.getClientRects().length)"
        )
        assert set(heights) == {1}
        lab.screenshot(f"{theme.split()[-1].lower()}-theme", of=panel)
    finally:
        lab.command("apputils:change-theme", {"theme": "JupyterLab Light"})


def test_a_cell_with_no_torch_work_shows_no_action_buttons(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook(
        "no-torch.ipynb",
        # (cpu-allocator skipped: it counts the probe's own page faults on such a cell)
        ["%load_ext torchtune_magic", "%%perfcheck --budget 0.5 --skip cpu-allocator\nx = 1 + 1"],
    )
    lab.open_notebook(notebook)
    lab.run_cell(0)
    lab.run_cell(1, ".ttm-live-panel[class*='ttm-run-'] .ttm-act", timeout=60_000)
    panel = lab.cell(1).locator(".ttm-live-panel")
    expect(panel.locator(".ttm-progress")).to_have_count(0, timeout=60_000)
    expect(panel).to_contain_text("No findings: nothing in this cell matches")
    expect(panel.locator("button")).to_have_count(0)
    expect(panel.locator(".ttm-actions")).to_have_count(0)
    lab.screenshot("no-torch", of=panel)


DONE = """\
del report["phase"]  # every number is in
panel.update(Report.from_dict(report))
"""


def test_the_panel_reads_in_plain_words_mid_run_and_done_in_both_themes(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    """Mid-run: numbers so far in plain words, where the time went first. Done: the check
    its own trial found slower apart, the same memory drawn neutral. Never a backtick,
    "(s)" or an internal word; screenshots in the light and the dark theme."""
    notebook = jupyter_lab.write_notebook(
        "plain-words.ipynb",
        [panel_of_report("plain-1", edit=AT_A_GLANCE + 'report["phase"] = "measuring"\n'), DONE],
    )
    lab.open_notebook(notebook)
    lab.page.set_viewport_size({"width": 1400, "height": 2400})  # the whole panel in view
    panel = lab.run_cell(0, f"{LIVE_PANEL}.ttm-run-plain-1 .ttm-findings")
    panel = lab.cell(0).locator(LIVE_PANEL)
    expect(panel.locator("header > h3 + *")).to_have_class("ttm-time-split")
    anomaly = panel.locator("tr[data-finding='debug-anomaly']")
    expect(anomaly.locator(".ttm-speedup-text")).to_have_text("1.54× so far (still measuring)")
    expect(panel.locator(".ttm-combined .ttm-verdict")).to_have_text("results not compared yet")
    text = panel.evaluate(ALL_TEXT)
    assert not RAW_TEXT.search(text), RAW_TEXT.findall(text)

    lab.run_cell(1)
    expect(anomaly.locator(".ttm-speedup-text")).to_have_text("1.54× faster")
    expect(panel.locator("details.ttm-checked summary")).to_have_text("checked: slower here (1)")
    same = panel.locator(".ttm-chart-group").last.locator(".ttm-chart-row").last
    expect(same.locator(".ttm-chart-label")).to_have_text("debug-anomaly + zero-grad-none")
    assert same.locator("rect").evaluate("r => getComputedStyle(r).fill") != "rgb(211, 47, 47)"
    for theme in ("JupyterLab Light", "JupyterLab Dark"):
        lab.command("apputils:change-theme", {"theme": theme})
        light = "true" if theme == "JupyterLab Light" else "false"
        try:
            expect(lab.page.locator(f"body[data-jp-theme-light='{light}']")).to_have_count(1)
            text = panel.evaluate(ALL_TEXT)
            assert not RAW_TEXT.search(text), RAW_TEXT.findall(text)
            lab.screenshot(f"panel-{theme.split()[-1].lower()}", of=panel)
        finally:
            lab.command("apputils:change-theme", {"theme": "JupyterLab Light"})


MODEL = """\
%load_ext torchtune_magic
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(32, 8), torch.randn(32, 1)"""
# short enough for the probe to be the cell's one complete run: what it prints is shown then
PRINTS = """\
%%perfcheck --budget 1 --checks zero-grad-none
for step in range(5):
    opt.zero_grad(set_to_none=False)
    loss = ((model(X) - Y) ** 2).mean()
    loss.backward()
    opt.step()
print(f"loss {loss.item():.4f}")"""
# The cell's outputs as a user sees them, top to bottom: the panel or the saved report
# ("perfcheck"), else the output's text; hidden and empty outputs left out.
SHOWN_OUTPUTS = """area => Array.from(area.querySelectorAll(':scope > .jp-OutputArea-child'))
  .filter(item => item.offsetParent !== null)
  .map(item => item.querySelector('.ttm-live-panel, .ttm-report') ? 'perfcheck'
                                                                   : item.innerText.trim())
  .filter(Boolean)"""


def test_the_cells_output_keeps_its_place_after_a_save_and_reload(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    """Live, what the cell printed sits below the panel; after a save and a reload, below
    the saved report that stands in for the panel: the same order."""
    notebook = jupyter_lab.write_notebook("order.ipynb", [MODEL, PRINTS])
    lab.open_notebook(notebook)
    lab.run_cell(0)
    panel = lab.run_cell(1, f"{LIVE_PANEL}[class*='ttm-run-']", timeout=120_000)
    expect(panel.locator(".ttm-progress")).to_have_count(0, timeout=120_000)
    area = lab.cell(1).locator(".jp-Cell-outputArea")
    expect(area.locator(".jp-RenderedText")).to_contain_text("loss ")
    live = area.evaluate(SHOWN_OUTPUTS)
    assert live[0] == "perfcheck" and live[1].startswith("loss "), live
    lab.screenshot("live")

    lab.save(notebook)
    jupyter_lab.shutdown_kernels()
    lab.page.reload()
    area = lab.cell(1).locator(".jp-Cell-outputArea")
    expect(area.locator(SAVED_REPORT)).to_be_visible()
    expect(area.locator(".jp-OutputArea-child[data-ttm-hidden]")).to_have_count(1)
    assert area.evaluate(SHOWN_OUTPUTS) == live
