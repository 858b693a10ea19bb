"""The report MIME renderer in a real JupyterLab: content, escaping, and saved outputs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from playwright.sync_api import expect

from torchtune_magic.report import load_schema

from .cells import AT_A_GLANCE, display_report
from .conftest import SAMPLE_REPORT, SAMPLE_REPORT_GPU
from .lab import ALL_TEXT, LIVE_PANEL, RAW_TEXT, SAVED_REPORT, Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser


def test_report_renders_findings_table_and_chart(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook("render.ipynb", [display_report("render-1")])
    lab.open_notebook(notebook)
    report = lab.run_cell(0, SAVED_REPORT)
    expect(report).to_be_visible()

    # Our renderer wins over the bundle's HTML fallback.
    outputs = lab.cell(0).locator(".jp-OutputArea")
    expect(outputs.get_by_text("html fallback of the report")).to_have_count(0)

    summary = report.locator(".ttm-summary")
    expect(summary).to_contain_text("x86_64 CPU (cpu, 2 CPUs, 2 torch threads)")
    expect(summary).to_contain_text("2.13.0+cpu")
    expect(summary).to_contain_text("412 ms ± 11.0 ms")
    expect(summary).to_contain_text("288.0 MiB")
    # A report without the optional utilisation fields renders as it always did.
    expect(summary.locator("dt")).to_have_text(
        ["Device", "PyTorch", "Baseline", "Runs", "Peak memory", "Measured in"]
    )
    expect(report.locator(".ttm-badge-throughput, .ttm-throughput")).to_have_count(0)
    expect(report.locator(".ttm-flops-breakdown")).to_have_count(0)
    expect(report).not_to_contain_text("FLOP")
    expect(report).not_to_contain_text("of peak")
    expect(report).not_to_contain_text("no peak known")

    rows = report.locator(".ttm-findings tbody tr")
    expect(rows).to_have_count(3)
    expect(report.locator(".ttm-summary dd").nth(3)).to_have_text("9 runs")
    anomaly = report.locator("tr[data-finding='debug-anomaly']")
    expect(anomaly.locator(".ttm-speedup")).to_have_text("1.54× faster")
    memory = anomaly.locator(".ttm-badge-memory")
    expect(memory).to_have_text("−1% memory")  # less memory: good, coloured so
    expect(memory).to_have_class(re.compile("ttm-tone-good"))
    expect(memory).to_have_attribute("title", "peak memory 288.0 MiB → 284.0 MiB")
    expect(anomaly.locator(".ttm-verdict-identical")).to_have_text("identical")
    # measured slower: not a finding to act on, collapsed under "checked: no gain here"
    no_gain = report.locator("details.ttm-no-gain")
    expect(no_gain.locator("summary")).to_have_text("checked: no gain here (1)")
    expect(no_gain).not_to_have_attribute("open", "")
    slower = no_gain.locator("tr[data-finding='zero-grad-none'] .ttm-speedup")
    expect(slower).to_have_text(re.compile("measured slower here — not recommended"))
    expect(slower).not_to_contain_text("faster")
    expect(report.locator(".ttm-act h4")).to_have_text("Findings (2)")
    expect(report.locator("tr[data-finding='conv-bias-bn'] .ttm-speedup")).to_have_text(
        "not auto-fixable"
    )

    chart = report.locator("svg.ttm-chart")
    expect(chart).to_be_visible()
    # Time: baseline + 3 variants; memory: baseline + the 2 variants whose peak changed.
    expect(chart.locator("rect.ttm-chart-bar")).to_have_count(7)
    # a report from before paired rounds names no recommended set: the combined bar is named
    # by its fixes
    both = "debug-anomaly + zero-grad-none"
    time_labels = ["baseline", "debug-anomaly", "zero-grad-none", both]
    memory_labels = ["baseline", "debug-anomaly", both]
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

    not_applicable = report.locator("details.ttm-not-applicable")
    expect(not_applicable.locator("summary")).to_have_text("Not applicable here (1)")
    expect(not_applicable).to_contain_text("pin-memory")
    lab.screenshot("report")


def test_report_strings_are_rendered_as_text(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook("escaping.ipynb", [display_report("escaping-1")])
    lab.open_notebook(notebook)
    report = lab.run_cell(0, SAVED_REPORT)
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
    lab.run_cell(0, SAVED_REPORT)
    lab.save(notebook)
    jupyter_lab.shutdown_kernels()

    lab.page.reload()
    report = lab.cell(0).locator(SAVED_REPORT)
    expect(report).to_be_visible()
    expect(report.locator(".ttm-findings tbody tr")).to_have_count(3)
    expect(report.locator("svg.ttm-chart rect.ttm-chart-bar")).to_have_count(7)
    lab.screenshot("reloaded")


UTILISATION_FIELDS = {"flops", "flops_breakdown", "flops_detail", "achieved_tflops", "utilisation"}

# The GPU sample with no peak for the device: what a GPU missing from the peak table gives.
NO_PEAK = """\
report["environment"]["device_name"] = "NVIDIA Example GPU"
report["environment"]["peak_tflops"] = None
report["environment"]["peak_tflops_source"] = (
    "NVIDIA Example GPU is not in the peak table: achieved FLOP/s only"
)
for item in [report["baseline"], *report["variants"]]:
    item["utilisation"] = None
    item["peak_tflops"] = None
"""

# FLOPs not counted: the optional fields are dropped and the reason given.
NOT_COUNTED = """\
for item in [report["baseline"], *report["variants"]]:
    for key in ("flops", "flops_breakdown", "achieved_tflops", "utilisation", "peak_tflops"):
        item.pop(key, None)
report["baseline"]["flops_detail"] = (
    "FLOPs not counted: the cell failed under FlopCounterMode (RuntimeError: boom)"
)
"""


def test_sample_reports_match_the_schema() -> None:
    schema = load_schema()
    old = json.loads(SAMPLE_REPORT.read_text())
    gpu = json.loads(SAMPLE_REPORT_GPU.read_text())
    jsonschema.validate(old, schema)
    jsonschema.validate(gpu, schema)
    # The old fixture stays free of the utilisation fields; the GPU one has them all.
    assert not UTILISATION_FIELDS & set(old["baseline"])
    assert not any({"flops", "achieved_tflops"} & set(v) for v in old["variants"])
    assert "peak_tflops" not in old["environment"]
    assert {"flops", "flops_breakdown", "achieved_tflops", "utilisation", "peak_tflops"} <= set(
        gpu["baseline"]
    )
    assert all(v["utilisation"] for v in gpu["variants"])
    assert gpu["environment"]["peak_tflops"]["bf16"] > 0


def test_report_renders_utilisation(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook(
        "utilisation.ipynb", [display_report("gpu-1", "sample_report_gpu.json")]
    )
    lab.open_notebook(notebook)
    report = lab.run_cell(0, SAVED_REPORT)
    expect(report).to_be_visible()

    summary = report.locator(".ttm-summary")
    expect(summary).to_contain_text("NVIDIA H200 (cuda, 16 CPUs, 16 torch threads)")
    expect(summary.locator("dt")).to_have_text(
        [
            "Device",
            "PyTorch",
            "Baseline",
            "Runs",
            "Peak memory",
            "FLOPs per run",
            "Achieved",
            "Share of peak",
            "Measured in",
        ]
    )
    expect(summary.locator("dd").nth(5)).to_have_text("2.9 TFLOP")
    expect(summary.locator("dd").nth(6)).to_have_text("24.6 TFLOP/s")
    share = summary.locator("dd").nth(7)
    expect(share).to_have_text("36.1% of peak (68.2 TFLOP/s)")
    expect(share).to_have_attribute(
        "title",
        re.compile(r"^H200: NVIDIA datasheet, dense \(no sparsity\), TFLOP/s — bf16 989\.4"),
    )

    breakdown = report.locator("details.ttm-flops-breakdown")
    expect(breakdown.locator("summary")).to_have_text("FLOPs by precision and kind")
    items = breakdown.locator("li")
    expect(items.first).to_be_hidden()
    breakdown.locator("summary").click()
    expect(items).to_have_text(
        ["float32 matmul: 2.9 TFLOP (97.8%)", "float32 conv: 63.3 GFLOP (2.2%)"]
    )

    amp = report.locator("tr[data-finding='amp'] .ttm-speedup")
    expect(amp).to_contain_text("7.49× faster")
    expect(amp.locator(".ttm-badge-throughput")).to_have_text("184 TFLOP/s · 18.6% of peak")
    expect(amp.locator(".ttm-badge-throughput")).to_have_attribute(
        "title", re.compile(r"^18\.6% of peak \(989\.4 TFLOP/s\); H200: ")
    )
    tf32 = report.locator("tr[data-finding='tf32'] .ttm-badge-throughput")
    expect(tf32).to_have_text("98.1 TFLOP/s · 19.8% of peak")
    host_sync = report.locator("tr[data-finding='host-sync'] .ttm-speedup")
    expect(host_sync).to_have_text("not auto-fixable")
    expect(report.locator(".ttm-combined")).to_have_text(
        "fixes together (amp, tf32): 7.59× faster−40% memoryclose187 TFLOP/s · 18.9% of peak"
    )
    # whether the combined run's results stayed the same, on its own line
    expect(report.locator(".ttm-combined .ttm-verdict-close")).to_have_text("close")
    expect(report.locator(".ttm-combined .ttm-badge-throughput")).to_have_text(
        "187 TFLOP/s · 18.9% of peak"
    )
    expect(report).not_to_contain_text("no peak known")
    lab.screenshot("utilisation")


def test_report_without_peak_or_flops(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook(
        "no-peak.ipynb",
        [
            display_report("no-peak-1", "sample_report_gpu.json", NO_PEAK),
            display_report("not-counted-1", "sample_report_gpu.json", NOT_COUNTED),
        ],
    )
    lab.open_notebook(notebook)

    # No peak known: the rates alone, never "0% of peak".
    report = lab.run_cell(0, SAVED_REPORT)
    share = report.locator(".ttm-summary dd").nth(7)
    expect(share).to_have_text("no peak known")
    expect(share).to_have_attribute(
        "title", "NVIDIA Example GPU is not in the peak table: achieved FLOP/s only"
    )
    badges = report.locator(".ttm-badge-throughput")
    expect(badges).to_have_text(
        [
            "184 TFLOP/s · no peak known",
            "98.1 TFLOP/s · no peak known",
            "187 TFLOP/s · no peak known",
        ]
    )
    expect(report).not_to_contain_text("% of peak")

    # FLOPs not counted: the reason, and no rates anywhere.
    report = lab.run_cell(1, SAVED_REPORT)
    summary = report.locator(".ttm-summary")
    expect(summary.locator("dt")).to_have_text(
        ["Device", "PyTorch", "Baseline", "Runs", "Peak memory", "FLOPs per run", "Measured in"]
    )
    expect(summary.locator("dd").nth(5)).to_have_text(
        "FLOPs not counted: the cell failed under FlopCounterMode (RuntimeError: boom)"
    )
    expect(report.locator(".ttm-badge-throughput, .ttm-flops-breakdown")).to_have_count(0)
    expect(report).not_to_contain_text("TFLOP/s")
    lab.screenshot("no-peak")


# A long cell sampled per batch, still measuring: one fix measured twice (the earlier
# measurement at 14:02), one not yet, the cell's complete run under way.
LONG_CELL = """\
report["phase"] = "measuring"
report["sampling"] = {
    "unit": "batch", "steps_per_run": 96, "steps_detail": "8 epochs x 12 batches = 96 steps",
    "warmup_steps": 2, "steps_timed": 4, "probe_steps": 6, "probe_complete": False,
    "steps_per_epoch": 12, "epoch_end_step": 4,
}
report["baseline"].update(runs=1, projected_cell_s=61.2, measured_at="2026-12-03T14:10:00+00:00")
anomaly, pending = report["variants"][0], report["variants"][1]
earlier = dict(anomaly, speedup=1.8, measured_at="2026-12-03T14:02:00+00:00")
anomaly.update(projected_cell_s=27.0, one_time_s=3.2, one_time_cause="compile",
               break_even_runs=1, measured_at="2026-12-03T14:10:00+00:00")
pending.update(speedup=None, median_s=None, runs=0)
report["variants"] = [earlier, anomaly, pending]
report["cell_run"] = {"status": "running", "fixes": ["debug-anomaly"]}
"""

INTERRUPTED = """\
report["phase"] = "interrupted"
report["variants"] = []
report["baseline"].update(median_s=None, iqr_s=None, runs=0)
report["cell_run"] = {"status": "complete", "seconds": 12.0, "steps": 1, "fixes": []}
report["sampling"] = {
    "unit": "batch", "steps_per_run": None, "steps_detail": "", "warmup_steps": 2,
    "steps_timed": 1, "probe_steps": 3, "probe_complete": False,
}
"""


def test_report_renders_long_cell_fields_and_every_measurement(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook(
        "long-cell.ipynb",
        [display_report("long-1", edit=LONG_CELL), display_report("long-2", edit=INTERRUPTED)],
    )
    lab.open_notebook(notebook)
    report = lab.run_cell(0, SAVED_REPORT)
    expect(report.locator(".ttm-status")).to_have_text(
        "measuring… numbers fill in as each configuration is measured"
    )
    summary = report.locator(".ttm-summary")
    expect(summary.locator("dt")).to_have_text(
        [
            *("Device", "PyTorch", "Baseline", "Runs", "Peak memory", "Whole cell"),
            *("Sampled", "The cell's run", "Measured in"),
        ]
    )
    # one run: no spread to show, whatever the IQR field holds
    expect(summary.locator("dd").nth(2)).to_have_text("412 ms per batch (one run)")
    expect(summary.locator("dd").nth(3)).to_have_text("1 run")
    expect(summary.locator("dd").nth(5)).to_have_text("61.2 s (projected)")
    expect(summary.locator("dd").nth(6)).to_have_text(
        "every measuring run stopped after batch 6 of 96 (8 epochs x 12 batches = 96 steps), "
        "batches 3–6 timed after 2 warm-up; an epoch restart in the timed batches counts once "
        "per 12 (each run's first epoch ended after batch 4 to hold one); times are per batch, "
        "the whole cell projected"
    )
    expect(summary.locator("dd").nth(7)).to_have_text(
        "finishing the cell: its one complete run, with debug-anomaly…"
    )

    anomaly = report.locator("tr[data-finding='debug-anomaly'] .ttm-speedup")
    # still measuring: a number so far, no verdict drawn from it yet
    expect(anomaly.locator(".ttm-speedup-text")).to_have_text(
        "1.54× per batch so far (still measuring)"
    )
    expect(anomaly.locator(".ttm-projected")).to_have_text("whole cell 61.2 s → 27.0 s (projected)")
    expect(anomaly.locator(".ttm-one-time")).to_have_text(
        "3.20 s one-time (compile), pays back after 1 run"
    )
    expect(anomaly.locator(".ttm-earlier")).to_have_text(
        re.compile(r"^earlier: 1\.80× at \d\d:\d\d$")
    )
    pending = report.locator("tr[data-finding='zero-grad-none'] .ttm-speedup")
    expect(pending).to_have_text("measuring…")  # never "not measured" while measuring
    expect(report).not_to_contain_text("not measured")

    report = lab.run_cell(1, SAVED_REPORT)
    expect(report.locator(".ttm-status")).to_have_text(
        "interrupted (Ctrl-C) before every number was in"
    )
    expect(report.locator(".ttm-summary dd").nth(2)).to_have_text("not measured")
    expect(report.locator(".ttm-summary dd").nth(6)).to_have_text(
        "the cell's complete run: 12.0 s, 1 batch"
    )
    lab.screenshot("long-cell", of=lab.cell(0))


OUT_OF_MEMORY = """\
report["baseline"].update(median_s=None, iqr_s=None, runs=0, peak_memory_bytes=None)
report["findings"][0].update(id="activation-checkpointing", title="Repeated blocks keep all "
                             "their activations for backward", evidence="out of memory")
report["findings"][1].update(id="amp")
report["oom"] = {
    "error": "OutOfMemoryError: CUDA out of memory.", "line": 3,
    "requested_bytes": 2 * 2**30, "in_use_bytes": 78 * 2**30,
    "in_use_measure": "CUDA tensor memory allocated when the allocation failed",
}
measured = {"median_s": None, "iqr_s": None, "speedup": None, "noisy": False,
            "numerics": {"verdict": "not-compared", "max_rel_diff": None},
            "one_time_s": None, "break_even_runs": None}
report["variants"] = [
    dict(measured, fixes=["activation-checkpointing"], fits=True, median_s=0.84, runs=1,
         peak_memory_bytes=310 * 2**20, error=None),
    dict(measured, fixes=["amp"], fits=False, runs=0, peak_memory_bytes=None,
         error="still out of memory with this fix: OutOfMemoryError: CUDA out of memory."),
]
report["cell_run"] = {"status": "failed", "detail": "OutOfMemoryError: CUDA out of memory."}
"""


def test_an_out_of_memory_report_says_which_memory_fix_makes_it_fit(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook(
        "oom.ipynb", [display_report("oom-1", edit=OUT_OF_MEMORY)]
    )
    lab.open_notebook(notebook)
    report = lab.run_cell(0, SAVED_REPORT)
    expect(report.locator(".ttm-status")).to_have_text(
        "the cell ran out of memory at cell line 3, asking for 2.0 GiB with 78.0 GiB in use "
        "(CUDA tensor memory allocated when the allocation failed): OutOfMemoryError: CUDA out "
        "of memory. Nothing was timed against a baseline; the findings below come from the run "
        "up to the failure, memory fixes first; it fits with activation-checkpointing "
        "(310.0 MiB peak)"
    )
    fits = report.locator("tr[data-finding='activation-checkpointing']")
    expect(fits.locator(".ttm-speedup-text")).to_have_text(
        "fits with this fix: it ran past where the cell ran out of memory"
    )
    expect(fits.locator(".ttm-speedup-text")).to_have_class(re.compile("ttm-tone-good"))
    expect(fits.locator(".ttm-memory")).to_have_text("310.0 MiB peak")
    again = report.locator("tr[data-finding='amp'] .ttm-speedup-text")
    expect(again).to_have_text(
        "failed: still out of memory with this fix: OutOfMemoryError: CUDA out of memory."
    )
    lab.screenshot("out-of-memory", of=lab.cell(0))


SPLIT_EDIT = (
    'report["time_split"] = {"data_wait": 0.63, "forward": 0.14, "backward": 0.15, '
    '"optimizer": 0.03, "other": 0.05}\n'
)


def test_the_report_opens_with_where_the_time_went(lab: Lab, jupyter_lab: JupyterLab) -> None:
    """The time split first, above the summary: one stacked bar, a part a segment as wide
    as its share, and the same line the text report opens with."""
    notebook = jupyter_lab.write_notebook(
        "split.ipynb", [display_report("split-1", edit=SPLIT_EDIT)]
    )
    lab.open_notebook(notebook)
    report = lab.run_cell(0, SAVED_REPORT)
    split = report.locator(".ttm-time-split")
    expect(split.locator(".ttm-time-split-line")).to_have_text(
        "where the time went (the baseline's first run): data wait 63% · forward 14% · "
        "backward 15% · optimizer 3% · other 5%"
    )
    parts = split.locator(".ttm-split-part")
    expect(parts).to_have_count(5)
    expect(parts.first).to_have_attribute("title", "data wait 63%")
    widths = parts.evaluate_all("ps => ps.map(p => p.getBoundingClientRect().width)")
    assert widths[0] > 3 * widths[1] and widths[0] > 10 * widths[3], widths
    # the parts make up the whole run: together as wide as the bar
    whole = split.locator(".ttm-time-split-bar").evaluate("b => b.getBoundingClientRect().width")
    assert abs(sum(widths) - whole) < 1, (widths, whole)
    # first: the first thing under the report's title, above the summary and the findings
    expect(report.locator("header > h3 + *")).to_have_class("ttm-time-split")
    lab.screenshot("time-split", of=report)


# The computed colours of a caveat, of a note, and of a figure that went wrong.
CAVEAT_NOTE_BAD = """r => {
  const probe = document.createElement('span');
  probe.className = 'ttm-tone-bad';
  r.appendChild(probe);
  const colours = [r.querySelector('.ttm-caveat'), r.querySelector('.ttm-note'), probe].map(
    n => getComputedStyle(n).color);
  probe.remove();
  return colours;
}"""
# The memory group's bars: each one's label and computed fill.
MEMORY_FILLS = """svg => Array.from(
  [...svg.querySelectorAll('.ttm-chart-group')].pop().querySelectorAll('.ttm-chart-row'),
  row => [row.querySelector('.ttm-chart-label').textContent,
          getComputedStyle(row.querySelector('rect')).fill])"""
RED = "rgb(211, 47, 47)"  # --ttm-bar-bad in the light theme (less memory: --ttm-bar-good)


def test_each_finding_reads_at_a_glance_and_nothing_reads_raw(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    """One sentence of evidence with its part of the time split as a chip of that part's
    colour, the details folded; caveats in the note colour; the check its own trial found
    slower under "checked: slower here"; memory bars coloured by their badge; the
    not-applicable checks one line per reason; no backtick, "(s)" or internal word."""
    notebook = jupyter_lab.write_notebook(
        "at-a-glance.ipynb", [display_report("glance-1", edit=AT_A_GLANCE)]
    )
    lab.open_notebook(notebook)
    report = lab.run_cell(0, SAVED_REPORT)
    anomaly = report.locator("tr[data-finding='debug-anomaly']")

    evidence = anomaly.locator(".ttm-evidence")
    expect(evidence.locator(".ttm-evidence-lead")).to_have_text(
        "anomaly mode checked 40 of 40 backward passes (set_detect_anomaly(True) at line 1)"
    )
    expect(evidence.locator(".ttm-evidence-lead code")).to_have_text("set_detect_anomaly(True)")
    chip = evidence.locator(".ttm-segment")
    expect(chip).to_have_text("backward 15%")
    expect(chip).to_have_attribute(
        "title", "this fix acts on the backward: 15% of the time in the baseline's first run"
    )
    swatch = chip.locator(".ttm-segment-swatch").evaluate("n => getComputedStyle(n).background")
    part = report.locator(".ttm-split-part.ttm-split-backward")
    assert part.evaluate("n => getComputedStyle(n).background") == swatch
    details = evidence.locator("details.ttm-details")
    expect(details).not_to_have_attribute("open", "")
    expect(details.locator(".ttm-details-text")).to_be_hidden()
    details.locator("summary").click()
    expect(details.locator(".ttm-details-text")).to_have_text(
        "a trial without it took 0.27 s\nper batch: 6.8 ms → 4.4 ms"
    )
    expect(report.locator("tr[data-finding='zero-grad-none'] .ttm-segment")).to_have_text(
        "optimizer 3%"
    )

    # a caveat is a note (the note colour), never the red of what went wrong
    caveat, note, bad = report.evaluate(CAVEAT_NOTE_BAD)
    assert caveat == note and caveat != bad, (caveat, note, bad)

    # an option never breaks inside: it is code, on one line, even in a narrow column
    budget = report.locator("tr[data-finding='zero-grad-none'] .ttm-speedup-text code")
    expect(budget).to_have_text("--budget 90")
    assert budget.evaluate("n => getComputedStyle(n).whiteSpace") == "nowrap"
    assert len(budget.evaluate("n => [...n.getClientRects()]")) == 1

    # results not compared: in words
    together = report.locator(".ttm-combined .ttm-verdict")
    expect(together).to_have_text("results not compared yet")

    # the check its own trial found slower: apart, with its figure
    checked = report.locator("details.ttm-checked")
    expect(checked.locator("summary")).to_have_text("checked: slower here (1)")
    checked.locator("summary").click()
    expect(checked.locator("li[data-check='channels-last']")).to_contain_text(
        "Convolutions run in the default memory format"
        "slower in channels_last here: model.2.0 (0.66 ms → 10.39 ms, 15.75x the time)"
    )
    expect(report.locator("tr[data-finding='channels-last']")).to_have_count(0)

    # memory bars by the badge's verdict: the same memory neutral, more memory red
    fills = dict(report.locator("svg.ttm-chart").evaluate(MEMORY_FILLS))
    both = "debug-anomaly + zero-grad-none"
    assert list(fills) == ["baseline", "debug-anomaly", "zero-grad-none", both], fills
    assert fills["zero-grad-none"] == RED, fills  # +30% memory
    assert fills[both] not in (RED, fills["debug-anomaly"]), fills  # same memory: neither
    more = report.locator("tr[data-finding='zero-grad-none'] .ttm-badge-memory")
    expect(more).to_have_text("+30% memory")

    # not applicable: one line per reason, with its ids
    not_applicable = report.locator("details.ttm-not-applicable")
    expect(not_applicable.locator("summary")).to_have_text("Not applicable here (5)")
    not_applicable.locator("summary").click()
    expect(not_applicable.locator("li")).to_have_text(
        [
            "pin-memory, tf32, cudnn-benchmark — not applicable on CPU: this only matters for "
            "work on a CUDA device",
            "ddp-no-sync, rank-imbalance — not a distributed run (torch.distributed is not "
            "initialised)",
        ]
    )
    heights = not_applicable.locator("li").evaluate_all(
        "items => items.map(li => li.getClientRects().length)"
    )
    assert heights == [1, 1]

    text = report.evaluate(ALL_TEXT)
    assert not RAW_TEXT.search(text), RAW_TEXT.findall(text)
    lab.page.set_viewport_size({"width": 1400, "height": 2400})  # the whole report in view
    lab.screenshot("at-a-glance", of=report)


SLOWER_CONVS = """\
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(
    nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.ReLU(),
    nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.ReLU(),
).double()
images = torch.randn(8, 32, 64, 64, dtype=torch.float64)"""


def test_a_fix_its_own_trial_measured_slower_is_checked_not_offered(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    """float64 depthwise convs, several times slower in channels_last on a CPU: the
    check's own per-conv trial says so, and the panel lists it under "checked: slower
    here" with that figure, never as a finding that its own caveat contradicts."""
    notebook = jupyter_lab.write_notebook(
        "slower.ipynb",
        [
            "%load_ext torchtune_magic",
            SLOWER_CONVS,
            "%%perfcheck --checks channels-last --budget 1\nwith torch.no_grad():\n"
            "    out = net(images)",
        ],
    )
    lab.open_notebook(notebook)
    lab.run_cell(0)
    lab.run_cell(1)
    # until the check has run (about 2 s, a few beside a CPU-bound process), then what it
    # decided: a trial that read the fix faster fails here at once, not after a long wait
    # for a section that will never come
    lab.run_cell(2, timeout=60_000)
    panel = lab.cell(2).locator(LIVE_PANEL)
    checked = panel.locator("details.ttm-checked")
    expect(checked.locator("summary")).to_have_text("checked: slower here (1)")
    checked.locator("summary").click()
    expect(checked.locator("li[data-check='channels-last']")).to_contain_text(
        re.compile(r"ms NCHW → [\d.]+ ms channels_last \([\d.]+x the time\)")
    )
    expect(panel.locator("tr[data-finding='channels-last']")).to_have_count(0)
