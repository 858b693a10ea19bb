"""The report contract (schema v1): it grows by optional fields only, so a report saved
before a field existed still loads and renders; the fields a finding gained for a report
read at a glance (its segment of the time split, its folded details, the checks measured
slower here) round-trip and show in the text view; the words shown are plain."""

from __future__ import annotations

import html as html_text
import json
import re
from pathlib import Path

import jsonschema

from torchtune_magic.render import html, summary, text
from torchtune_magic.report import Checked, Numerics, Report, Variant, load_schema

SAMPLE = json.loads((Path(__file__).parent / "data" / "sample_report.json").read_text())


def _copy(data: dict) -> dict:
    return json.loads(json.dumps(data))


def test_a_report_saved_before_segments_details_and_checked_loads_and_renders():
    old = _copy(SAMPLE)  # as saved before these fields: none of them in it
    assert "checked" not in old
    assert not any("segment" in f or "details" in f for f in old["findings"])
    jsonschema.validate(old, load_schema())
    report = Report.from_dict(old)
    assert report.checked == []
    assert all(f.segment is None and f.details is None for f in report.findings)
    shown = text.render(report)
    page = html.render(report)
    act = [f for f in report.findings if not summary.no_gain(report, f)]
    assert act
    for finding in act:
        assert f"evidence: {finding.evidence}" in shown
        escaped = {html_text.escape(finding.evidence, quote=q) for q in (False, True)}
        assert any(e in page for e in escaped)
    assert "details:" not in shown and "acts on:" not in shown
    assert "checked: slower here" not in shown
    assert report.to_dict() == old  # saved again, it reads as it did


def _with_new_fields(data: dict) -> None:
    workers = data["findings"][0]
    workers.update(
        evidence="batches waited 63% of the run (2.10 s of 3.33 s)",
        details="over 12 batches, loaded in the main process (175.0 ms per batch)",
        segment="data_wait",
    )
    data["time_split"] = {
        "data_wait": 2.1,
        "forward": 0.5,
        "backward": 0.5,
        "optimizer": 0.1,
        "other": 0.13,
    }
    data["checked"] = [
        {
            "id": "channels-last",
            "title": "A conv model runs on NCHW (channels-first) inputs",
            "outcome": "slower here",
            "evidence": "per-conv forward timing (no grad) of 2 convs: 0.66 ms NCHW → 10.39 ms "
            "channels_last (15.75x the time)",
        }
    ]


def test_segment_details_and_checked_round_trip_and_show_in_the_text_view():
    data = _copy(SAMPLE)
    _with_new_fields(data)
    jsonschema.validate(data, load_schema())
    report = Report.from_dict(data)
    assert report.to_dict() == data
    (checked,) = report.checked
    assert checked == Checked(**data["checked"][0])
    first = report.findings[0]
    assert summary.segment(report, first) == "data wait (63% of the run)"
    lines = text.render(report).splitlines()
    at = lines.index(f"   evidence: {first.evidence}")
    assert lines[at + 1] == f"   details:  {first.details}"
    assert lines[at + 2] == "   acts on:  data wait (63% of the run)"
    heading = lines.index("checked: slower here (1):")
    assert lines[heading + 1] == f"   [channels-last] {checked.title}: {checked.evidence}"
    # a finding that names no segment says nothing of one
    assert summary.segment(report, report.findings[1]) == ""


def test_the_text_view_shows_no_internal_words_and_no_count_with_s_in_brackets():
    """Mid-run: no "(provisional)", no "not-compared"; counts are words ("1 run")."""

    def mid_run(data: dict) -> None:
        data["phase"] = "measuring"
        data["baseline"]["runs"] = 1
        for variant in data["variants"]:
            variant["numerics"] = {"verdict": "not-compared", "max_rel_diff": None}

    data = _copy(SAMPLE)
    mid_run(data)
    report = Report.from_dict(data)
    shown = text.render(report)
    assert "provisional" not in shown and "not-compared" not in shown and "(s)" not in shown
    assert "so far (still measuring)" in shown
    assert "numerics: results not compared yet" in shown
    assert re.search(r"over 1 run\b", shown)
    why = Numerics("not-compared", None, "the cell bound no tensors or models to compare")
    assert summary.numerics(Variant(["x"], numerics=why)) == (
        "results not compared: the cell bound no tensors or models to compare"
    )
