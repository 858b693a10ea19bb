"""The static HTML view reads as the labextension's view does: where the time went first,
one sentence of evidence per finding with its part of the time split and the details
folded, caveats as notes, the check its own trial found slower apart, memory bars by
their badge's verdict, the not-applicable checks one line per reason, and no markdown or
internal word in what it shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

from torchtune_magic.render import html
from torchtune_magic.report import Report

SAMPLE = json.loads((Path(__file__).parent / "data" / "sample_report.json").read_text())
RED = "#b71c1c"  # what went wrong: an error, a slower verdict, more memory
BAR_RED = "#d32f2f"
CUDA = "not applicable on CPU: this only matters for work on a CUDA device"
ALONE = "not a distributed run (torch.distributed is not initialised)"


def _at_a_glance(measuring: bool = False) -> Report:
    """The sample with the issue-31 fields, prose with `code` and an option, a fix with
    more memory and one with the same, and a CPU run's not-applicable checks."""
    data = json.loads(json.dumps(SAMPLE))
    data["time_split"] = {"data_wait": 2.1, "forward": 0.47, "backward": 0.5, "optimizer": 0.1}
    data["time_split"]["other"] = 0.16
    anomaly, zero_grad, _ = data["findings"]
    anomaly.update(
        segment="backward",
        evidence="anomaly mode checked 40 of 40 backward passes (`set_detect_anomaly(True)`)",
        details="a trial without it took 0.27 s\nper batch: 6.8 ms → 4.4 ms",
    )
    zero_grad["segment"] = "data_wait"
    base = data["baseline"]["peak_memory_bytes"]
    data["variants"][1].update(
        speedup=1.01, verdict="no clear change", budget_to_tell_s=90.0, peak_memory_bytes=base * 2
    )
    data["variants"][2].update(
        peak_memory_bytes=base + 1000,
        numerics={"verdict": "not-compared", "max_rel_diff": None},
    )
    data["checked"] = [
        {
            "id": "channels-last",
            "title": "Convolutions run in the default memory format",
            "outcome": "slower here",
            "evidence": "slower in channels_last here: model.2.0 (0.66 ms → 10.39 ms)",
        }
    ]
    data["not_applicable"] = [
        *({"id": i, "reason": CUDA} for i in ("pin-memory", "tf32", "cudnn-benchmark")),
        *({"id": i, "reason": ALONE} for i in ("ddp-no-sync", "rank-imbalance")),
    ]
    if measuring:
        data["phase"] = "measuring"
    return Report.from_dict(data)


def _shown(page: str) -> str:
    """What a reader sees: the page's text, without its tags and attributes."""
    return re.sub(r"<[^>]+>", "", page)


def test_the_time_split_comes_first_and_each_finding_points_at_its_part():
    page = html.render(_at_a_glance())
    title = page.index("%%perfcheck report")
    assert title < page.index('class="ttm-time-split"') < page.index("baseline 412.0 ms")
    row = page[page.index('data-finding="debug-anomaly"') :]
    # the chip in the colour of its part of the bar, with its share
    assert re.search(r'background:#72b7b2"></span>backward 15%</div>', row)
    assert 'title="backward 15%" style="display:inline-block;height:12px;' in page
    assert "background:#72b7b2" in page[: page.index("baseline 412.0 ms")]
    assert "data wait 63%</div>" in page
    # one sentence first; the details folded
    lead = row.index("anomaly mode checked 40 of 40 backward passes")
    assert lead < row.index("<details><summary") < row.index("a trial without it took 0.27 s")


def test_prose_has_no_markdown_and_options_never_break():
    page = html.render(_at_a_glance())
    assert '(<code style="white-space:nowrap">set_detect_anomaly(True)</code>)' in page
    assert '<code style="white-space:nowrap">--budget 90</code> would' in page
    shown = _shown(page)
    assert "`" not in shown and "(s)" not in shown and "not-compared" not in shown
    assert "results not compared yet" in shown
    assert "so far (still measuring)" in _shown(html.render(_at_a_glance(measuring=True)))


def test_caveats_are_notes_and_red_is_for_what_went_wrong():
    page = html.render(_at_a_glance())
    caveat = re.search(r'<div style="([^"]*)">Caveat: ', page)
    assert caveat and RED not in caveat.group(1)
    badge = re.search(r'<span style="([^"]*)"[^>]*>\+100% memory</span>', page)
    assert badge and f"color:{RED}" in badge.group(1)


def test_memory_bars_are_coloured_by_their_badge():
    page = html.render(_at_a_glance())
    memory = page[page.index("Peak memory (where it changed)") :]
    bars = dict(re.findall(r"<title>([^:<]+): [^<]*</title>.*?fill=\"(#[0-9a-f]+)\"", memory))
    assert bars["zero-grad-none"] == BAR_RED  # more memory
    assert bars["debug-anomaly+zero-grad-none"] not in (BAR_RED, bars["debug-anomaly"])  # same


def test_the_check_its_trial_found_slower_is_apart_with_its_figure():
    page = html.render(_at_a_glance())
    checked = page[page.index('<details class="ttm-checked">') :]
    assert checked.startswith(
        '<details class="ttm-checked"><summary>checked: slower here (1)</summary>'
    )
    assert "model.2.0 (0.66 ms → 10.39 ms)" in checked
    assert 'data-finding="channels-last"' not in page


def test_not_applicable_checks_are_one_line_per_reason():
    page = html.render(_at_a_glance())
    section = page[page.index("Not applicable here (5)") :]
    lines = re.findall(r"<li>(.*?)</li>", section)
    assert [_shown(line) for line in lines] == [
        f"pin-memory, tf32, cudnn-benchmark — {CUDA}",
        f"ddp-no-sync, rank-imbalance — {ALONE}",
    ]


def test_a_report_without_the_new_fields_renders_as_before():
    page = html.render(Report.from_dict(SAMPLE))
    assert "ttm-segment" not in page and "ttm-checked" not in page and "<details><summary" in page
    assert "anomaly mode was enabled for 40 of 40 backward passes" in page
