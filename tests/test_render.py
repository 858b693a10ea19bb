"""Renderers: escaping, the chart, the bundle, and the wording every renderer shares."""

from __future__ import annotations

import json
import re
from pathlib import Path

from torchtune_magic.render import bundle, html, summary, text
from torchtune_magic.report import MIME_TYPE, Report

SAMPLE = json.loads((Path(__file__).parent / "data" / "sample_report.json").read_text())


def test_html_escapes_everything_from_user_code():
    out = html.render(Report.from_dict(SAMPLE))
    assert "<img" not in out and "<script" not in out
    assert "&lt;img src=x onerror=alert(1)&gt;" in out
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in out


def test_html_has_a_before_after_chart_with_every_measured_variant():
    out = html.render(Report.from_dict(SAMPLE))
    # time: the baseline and every variant; peak memory: the baseline and the two it changed
    assert out.count("<rect") == 1 + len(SAMPLE["variants"]) + 3
    assert "debug-anomaly+zero-grad-none" in out


def test_slower_fix_is_never_shown_as_a_win():
    report = Report.from_dict(SAMPLE)
    out = text.render(report)
    line = next(line for line in out.splitlines() if "0.98x" in line)
    assert "measured slower here — not recommended" in line
    assert "1.54x" in out and "identical" in out


def test_bundle_carries_report_json_and_fallbacks():
    data = bundle.render(Report.from_dict(SAMPLE))
    assert set(data) == {MIME_TYPE, "text/html", "text/plain"}
    assert data[MIME_TYPE] == SAMPLE


def test_one_time_cost_and_break_even_are_shown_apart_from_the_speedup():
    data = json.loads(json.dumps(SAMPLE))
    data["variants"][0].update(one_time_s=13.8, break_even_runs=92)
    out = text.render(Report.from_dict(data))
    assert "1.54x; 13.80 s one-time (compile, worker start), pays back after 92 runs" in out
    assert "13.80 s one-time" in html.render(Report.from_dict(data))


def test_a_speedup_inside_the_noise_band_is_no_measurable_change():
    data = json.loads(json.dumps(SAMPLE))
    data["variants"][0]["speedup"] = 1.01
    out = text.render(Report.from_dict(data))
    assert "1.01x — no clear change" in out


def test_an_unsettled_speedup_says_what_would_tell_never_no_clear_change():
    """3.67x in three rounds with the budget spent: no verdict either way yet."""
    data = json.loads(json.dumps(SAMPLE))
    variant = data["variants"][0]
    variant.update(speedup=3.67, speedup_low=None, speedup_high=None, rounds=3)
    variant.update(verdict="no clear change", budget_to_tell_s=45.0)
    out = text.render(Report.from_dict(data))
    assert "3.67x (3 rounds: too few for an interval) — not enough time to tell;" in out
    assert "3.67x (3 rounds: too few for an interval) — no clear change" not in out
    assert "no clear change; not enough time" not in html.render(Report.from_dict(data))


def test_not_applicable_checks_with_one_reason_share_a_line():
    data = json.loads(json.dumps(SAMPLE))
    cuda = "not applicable on CPU: this only matters for work on a CUDA device"
    alone = "not a distributed run (torch.distributed is not initialised)"
    data["not_applicable"] = [
        {"id": "pin-memory", "reason": cuda},
        {"id": "ddp-no-sync", "reason": alone},
        {"id": "tf32", "reason": cuda},
        {"id": "rank-imbalance", "reason": alone},
    ]
    out = text.render(Report.from_dict(data))
    assert f"not applicable here (4):\n   [pin-memory, tf32] {cuda}\n" in out
    assert f"   [ddp-no-sync, rank-imbalance] {alone}" in out


def test_a_measuring_window_of_a_few_ticks_says_nothing_of_the_load():
    data = json.loads(json.dumps(SAMPLE))
    data["load"] = {"window_s": 0.04, "other_cpu_s": 0.08, "cpus": 2}
    assert "other processes kept" not in text.render(Report.from_dict(data))
    data["load"] = {"window_s": 12.0, "other_cpu_s": 12.0, "cpus": 2}
    assert "other processes kept 1.00 of this kernel's 2 CPUs busy" in text.render(
        Report.from_dict(data)
    )


def _report(edit=None) -> Report:
    data = json.loads(json.dumps(SAMPLE))
    if edit:
        edit(data)
    return Report.from_dict(data)


def test_memory_reads_as_a_signed_share_good_or_bad():
    def more_memory(data):
        data["variants"][1]["peak_memory_bytes"] = int(
            SAMPLE["baseline"]["peak_memory_bytes"] * 1.28
        )
        data["variants"][1]["speedup"] = 1.2

    report = _report(more_memory)
    anomaly, zero_grad = (
        report.variant_for(["debug-anomaly"]),
        report.variant_for(["zero-grad-none"]),
    )
    assert summary.memory_change(report, anomaly) == "−1% memory (288.0 MiB → 284.0 MiB)"
    assert summary.memory_tone(report, anomaly) == "good"
    assert summary.memory_badge(report, zero_grad) == "+28% memory"
    assert summary.memory_tone(report, zero_grad) == "bad"
    out = text.render(report)
    assert "memory:   +28% memory (288.0 MiB → 368.6 MiB)" in out
    assert "color:#b71c1c" in html.render(report)  # a bad memory change is coloured so


def test_a_fix_with_no_clear_gain_and_the_not_applicable_checks_are_set_apart():
    report = _report()
    assert summary.no_gain(report, report.finding("zero-grad-none"))  # 0.98x
    assert not summary.no_gain(report, report.finding("debug-anomaly"))  # 1.54x
    assert not summary.no_gain(report, report.finding("conv-bias-bn"))  # advice: act on it
    out = text.render(report)
    assert "checked: no gain here (1):\n   [zero-grad-none]" in out
    assert "not applicable here (1):\n   [pin-memory] not applicable on CPU" in out
    assert not any(line.startswith("2. [zero-grad-none]") for line in out.splitlines())
    page = html.render(report)
    assert "<details><summary>checked: no gain here (1)</summary>" in page
    assert "<details><summary>Not applicable here (1)</summary>" in page


def test_every_earlier_measurement_is_shown_as_such_never_not_measured():
    def retimed(data):
        first = data["variants"][0]
        first["measured_at"] = "2026-12-03T14:02:00+00:00"
        again = dict(first, speedup=1.62, measured_at="2026-12-03T14:10:00+00:00")
        data["variants"].append(again)
        data["baseline"]["measured_at"] = "2026-12-03T14:10:00+00:00"
        data["variants"][1]["measured_at"] = "2026-12-03T14:02:00+00:00"

    report = _report(retimed)
    anomaly = report.variant_for(["debug-anomaly"])
    assert anomaly.speedup == 1.62
    assert re.fullmatch(r"earlier: 1\.54x at \d\d:\d\d", summary.earlier(report, anomaly))
    older = summary.speedup(report, report.variant_for(["zero-grad-none"]))
    assert re.search(r"measured at \d\d:\d\d, before the latest baseline$", older)
    out = text.render(report)
    assert "not measured" not in out and "before:   earlier: 1.54x at " in out


def test_one_time_cost_names_its_cause_and_counts_runs_in_words():
    def costs(data):
        data["variants"][0].update(one_time_s=3.2, one_time_cause="compile", break_even_runs=1)
        data["baseline"]["runs"] = 1

    report = _report(costs)
    out = text.render(report)
    assert "1.54x; 3.20 s one-time (compile), pays back after 1 run" in out
    assert "over 1 run," in out and "1 runs" not in out


def test_html_escapes_notebook_edits_from_user_code():
    def edits(data):
        data["notebook_edits"] = {
            "fixes": ["debug-anomaly"],
            "cells": [
                {
                    "execution_count": 3,
                    "before": "x = '<script>'",
                    "after": "x = '<b>'",
                    "diff": "--- In[3]\n+++ In[3] (optimized)\n-x = '<script>'\n+x = '<b>'\n",
                }
            ],
        }

    page = html.render(_report(edits))
    assert "<script>" not in page and "&lt;script&gt;" in page and "In[3]" in page
