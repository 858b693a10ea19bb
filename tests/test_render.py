"""Renderers: escaping, the chart, the bundle, and how slower fixes are worded."""

from __future__ import annotations

import json
from pathlib import Path

from torchtune_magic.render import bundle, html, text
from torchtune_magic.report import MIME_TYPE, Report

SAMPLE = json.loads((Path(__file__).parent / "data" / "sample_report.json").read_text())


def test_html_escapes_everything_from_user_code():
    out = html.render(Report.from_dict(SAMPLE))
    assert "<img" not in out and "<script" not in out
    assert "&lt;img src=x onerror=alert(1)&gt;" in out
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in out


def test_html_has_a_before_after_chart_with_every_measured_variant():
    out = html.render(Report.from_dict(SAMPLE))
    assert out.count("<rect") == 1 + len(SAMPLE["variants"])
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
    assert "1.01x — no measurable change" in out
