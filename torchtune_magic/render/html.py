"""Static HTML: the `text/html` fallback GitHub, nbviewer and VS Code show without the
labextension. It lays the report out as the view does (labextension/src/view.ts): where
the time went first, the summary, the findings to act on (one sentence of evidence each,
the rest folded), the checks that measured no gain and those whose own trial found their
fix slower (collapsed), the fixes together, the chart, the code changes as coloured diffs,
the not-applicable checks one line per reason. No script; inline styles only (no
stylesheet travels with an output).

Every string that can come from user code is escaped; `code` spans in the report's prose
become <code>, and options such as --budget 90 never break inside.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from html import escape
from typing import Any

from ..report import Checked, Finding, Report, Variant
from . import summary

_STYLE = (
    "font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;"
    "line-height:1.4;color:var(--jp-content-font-color1,#222)"
)
_TONES = {"good": "#1b5e20", "bad": "#b71c1c", "neutral": "inherit", "pending": "#616161"}
_CELL = "border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top"
_BADGE = (
    "display:inline-block;white-space:nowrap;border:1px solid #bbb;border-left-width:4px;"
    "border-radius:3px;padding:0 6px;margin:1px 4px 1px 0;font-size:12px;background:#f3f3f3;"
    "color:#222"
)
_NOTE = "color:#616161;font-size:12px"
_DIFF_LINE = {
    "+": "color:#1b5e20;background:#e8f5e9",
    "-": "color:#b71c1c;background:#ffebee",
    "@": "color:#006064",
}
_BAR_X = 210  # labels end here, right-aligned; bars start after it
_BAR_W = 320
_LABEL_CHARS = 30
# the chart's bars, as the view colours them: the baseline, and each bar by its verdict
_BAR_BASE, _BAR_GOOD, _BAR_BAD, _BAR_SAME = "#757575", "#388e3c", "#d32f2f", "#64b5f6"
_CODE_SPAN = re.compile(r"`([^`]+)`")
_OPTION = re.compile(r"--[a-z][a-z-]*(?: \d+(?:\.\d+)?)?")
_NOWRAP = "white-space:nowrap"


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _unbroken(text: str) -> str:
    """Escaped plain text, each option kept on one line; a stray backtick dropped."""
    return _OPTION.sub(
        lambda m: f'<span style="{_NOWRAP}">{m.group(0)}</span>', _e(text.replace("`", ""))
    )


def _prose(text: str) -> str:
    """Report prose as HTML: each `code` span a <code> (never a literal backtick), options
    such as --budget 90 never broken inside, everything else escaped."""
    parts, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        parts.append(_unbroken(text[last : match.start()]))
        parts.append(f'<code style="{_NOWRAP}">{_e(match.group(1))}</code>')
        last = match.end()
    parts.append(_unbroken(text[last:]))
    return "".join(parts)


def _badge(text: str, tone: str = "neutral", title: str = "") -> str:
    color = _TONES[tone] if tone != "neutral" else "#222"
    edge = {"good": "#1b5e20", "bad": "#b71c1c"}.get(tone, "#999")
    title_attr = f' title="{_e(title)}"' if title else ""
    return (
        f'<span style="{_BADGE};color:{color};border-left-color:{edge}"{title_attr}>'
        f"{_e(text)}</span>"
    )


def _tone(report: Report, variant: Variant | None) -> str:
    if variant is not None and variant.fits:
        return "good"
    if variant is None or (variant.speedup is None and not variant.error):
        return "pending"
    if variant.error or variant.is_slower:
        return "bad"
    return "good" if variant.is_win or variant.judged_by == "memory" else "neutral"


def _memory_rows(report: Report) -> list[tuple[str, float, str]]:
    """The baseline's peak memory and each fix set's where it differs, coloured by its
    badge's verdict (same memory neutral, less good, more bad)."""
    base = report.baseline.peak_memory_bytes
    changed = [
        v
        for v in report.latest_variants()
        if summary.current(report, v)
        and not v.error
        and v.peak_memory_bytes is not None
        and v.peak_memory_bytes != base
    ]
    if base is None or not changed:
        return []
    colours = {"good": _BAR_GOOD, "bad": _BAR_BAD}
    return [("baseline", base, _BAR_BASE)] + [
        (
            "+".join(v.fixes),
            v.peak_memory_bytes,
            colours.get(summary.memory_tone(report, v), _BAR_SAME),
        )
        for v in changed
        if v.peak_memory_bytes is not None
    ]


def _bars(
    title: str, rows: list[tuple[str, float, str]], fmt: Callable[[Any], str], top: int
) -> tuple[str, int]:
    """One group of the chart: its title, then a bar per row to the longest's scale."""
    longest = max(value for _, value, _ in rows) or 1
    parts = [
        f'<text x="0" y="{top + 14}" font-size="12" font-weight="600" fill="currentColor">'
        f"{_e(title)}</text>"
    ]
    for index, (label, value, color) in enumerate(rows):
        y = top + 24 + 22 * index
        width = max(2, int(_BAR_W * value / longest))
        short = label if len(label) <= _LABEL_CHARS else label[: _LABEL_CHARS - 1] + "…"
        parts.append(
            f"<g><title>{_e(label)}: {_e(fmt(value))}</title>"
            f'<text x="{_BAR_X - 8}" y="{y + 13}" font-size="12" text-anchor="end" '
            f'fill="currentColor">{_e(short)}</text>'
            f'<rect x="{_BAR_X}" y="{y}" width="{width}" height="16" rx="2" fill="{color}"/>'
            f'<text x="{_BAR_X + width + 6}" y="{y + 13}" font-size="11" fill="currentColor">'
            f"{_e(fmt(value))}</text></g>"
        )
    return "".join(parts), 24 + 22 * len(rows)


def chart(report: Report) -> str:
    """Before/after bars: the baseline and every fix set's newest measurement taken against
    it, to scale (a bar from an earlier round stood against another baseline's runs), each
    coloured by its verdict; then peak memory where it changed, coloured by its badge."""
    rows: list[tuple[str, float, str]] = []
    if report.baseline.median_s:
        rows.append(("baseline", report.baseline.median_s, _BAR_BASE))
    for variant in report.latest_variants():
        if variant.median_s and not variant.error and summary.current(report, variant):
            color = _BAR_BAD if variant.is_slower else _BAR_GOOD if variant.is_win else _BAR_SAME
            rows.append(("+".join(variant.fixes), variant.median_s, color))
    if len(rows) < 2:
        return ""
    unit = report.sampling.unit if report.sampling else "run"
    time, height = _bars(f"Median time per {unit} (shorter is faster)", rows, summary.seconds, 0)
    memory = _memory_rows(report)
    if memory:
        group, extra = _bars("Peak memory (where it changed)", memory, summary.size, height + 12)
        time, height = time + group, height + 12 + extra
    return (
        f'<svg role="img" aria-label="before/after time and peak memory" '
        f'width="{_BAR_X + _BAR_W + 90}" height="{height + 4}" '
        f'xmlns="http://www.w3.org/2000/svg">{time}</svg>'
    )


def _diff(diff: str, caption: str) -> str:
    lines = "".join(
        f'<span style="display:block;white-space:pre;{_DIFF_LINE.get(line[:1], "")}">'
        f"{_e(line)}</span>"
        for line in diff.rstrip("\n").splitlines()
    )
    return (
        f'<div style="{_NOTE};margin-top:4px">{_e(caption)}</div>'
        '<pre style="margin:2px 0;padding:4px 8px;border:1px solid #ddd;overflow-x:auto;'
        f'font-size:12px">{lines}</pre>'
    )


def _cell_name(execution_count: int | None) -> str:
    return "this cell (%%perfcheck)" if execution_count is None else f"In[{execution_count}]"


def _row(report: Report, finding: Finding) -> str:
    variant = summary.solo_variant(report, finding)
    if finding.fixable:
        notes = [summary.earlier(report, variant)] if variant else []
        fix = f'<span style="color:{_TONES[_tone(report, variant)]}">' + _prose(
            summary.speedup(report, variant)
        )
        fix += "</span>" + "".join(f'<div style="{_NOTE}">{_prose(n)}</div>' for n in notes if n)
    else:
        fix = f'<span style="{_NOTE}">not auto-fixable</span>'
    memory = summary.memory_badge(report, variant)
    memory_html = (
        _badge(memory, summary.memory_tone(report, variant), summary.memory_change(report, variant))
        if memory
        else "–"
    )
    results = _results(variant) + _loss(variant) if variant and variant.speedup is not None else "–"
    compute = summary.throughput(variant)
    applied = _badge("applied", "good") if finding.id in report.applied else ""
    # a caveat is a note to read, not something that went wrong: never red
    caveat = (
        f'<div style="{_NOTE}">Caveat: {_prose(finding.caveat)}</div>' if finding.caveat else ""
    )
    return (
        f'<tr data-finding="{_e(finding.id)}">'
        f'<td style="{_CELL}"><code>{_e(finding.id)}</code> {applied}'
        f"<div><b>{_prose(finding.title)}</b></div>"
        f'<div style="{_NOTE}">Guide: {_prose(finding.guide)}</div>{caveat}</td>'
        f'<td style="{_CELL}">{_evidence(report, finding)}</td>'
        f'<td style="{_CELL}">{_prose(finding.where)}</td>'
        f'<td style="{_CELL}">{fix}{_badge(compute) if compute else ""}</td>'
        f'<td style="{_CELL}">{memory_html}</td>'
        f'<td style="{_CELL}">{results}</td></tr>'
    )


def _results(variant: Variant) -> str:
    """Whether the fix left the results the same, as a badge in the summary's words; why
    they were not compared goes in its title (a badge never wraps)."""
    words = summary.numerics(variant)
    if variant.numerics.verdict != "not-compared":
        return _badge(words)
    head, _, why = words.partition(": ")
    return _badge(head, title=why)


def _evidence(report: Report, finding: Finding) -> str:
    """The part of the time split the fix acts on (a swatch of that part's colour and its
    share), one sentence of evidence, and what else the check saw folded away."""
    chip = ""
    if finding.segment:
        name = dict(summary.SPLIT_PARTS).get(finding.segment, finding.segment)
        split = report.time_split or {}
        total = sum(split.values())
        share = split.get(finding.segment, 0.0) / total if total > 0 else None
        percent = "" if share is None else "<1%" if 0 < share < 0.005 else f"{share:.0%}"
        title = f"this fix acts on the {name}" + (
            f": {percent} of the time in the baseline's first run" if percent else ""
        )
        swatch = (
            "display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;"
            f"background:{_PART_COLOURS.get(finding.segment, _PART_COLOURS['other'])}"
        )
        chip = (
            f'<div class="ttm-segment" title="{_e(title)}" style="{_NOTE};{_NOWRAP}">'
            f'<span style="{swatch}"></span>{_e(f"{name} {percent}".strip())}</div>'
        )
    details = (
        f'<details><summary style="{_NOTE}">details</summary>'
        f'<div style="{_NOTE};white-space:pre-line">{_prose(finding.details)}</div></details>'
        if finding.details
        else ""
    )
    return f"{chip}<div>{_prose(finding.evidence)}</div>{details}"


def _loss(variant: Variant | None) -> str:
    """The loss comparison under the results badge, with the two curves drawn where they
    differ."""
    words = summary.loss(variant)
    if not words or variant is None:
        return ""
    tone = "bad" if variant.numerics.loss_verdict != "same loss" else "neutral"
    curves = _loss_svg(variant) if summary.loss_curves_differ(variant) else ""
    return f'<div style="{_NOTE};color:{_TONES[tone]}">{_e(words)}</div>{curves}'


def _loss_svg(variant: Variant) -> str:
    """A small inline plot of the baseline's loss per step (grey) and the fix's (blue),
    on one scale; a point that is not finite is left out."""
    n = variant.numerics
    base, fixed = n.loss_baseline or [], n.loss_fix or []
    values = [v for v in (*base, *fixed) if v is not None]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    width, height, last = 180, 48, max(len(base), len(fixed)) - 1 or 1

    def line(curve: list[float | None], color: str) -> str:
        points = " ".join(
            f"{i * width / last:.1f},{height - 2 - (v - low) * (height - 4) / span:.1f}"
            for i, v in enumerate(curve)
            if v is not None
        )
        return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>'

    title = f"loss per step: baseline (grey), {'+'.join(variant.fixes)} (blue)"
    return (
        f'<svg class="ttm-loss-curves" width="{width}" height="{height}" role="img" '
        f'style="display:block;margin-top:2px"><title>{_e(title)}</title>'
        f"{line(base, '#9e9e9e')}{line(fixed, '#1565c0')}</svg>"
    )


def _table(report: Report, findings: list[Finding]) -> str:
    head = "".join(
        f'<th style="{_CELL};color:#616161">{t}</th>'
        for t in ("Finding", "Evidence", "Where", "Fix alone", "Memory", "Results")
    )
    rows = "".join(_row(report, f) for f in findings)
    return (
        f'<table style="border-collapse:collapse;width:100%"><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table>"
    )


def _code_changes(report: Report) -> str:
    blocks = []
    edits = report.notebook_edits
    if edits and edits.cells:
        scope = summary.edits_scope(report)
        names = " and ".join(_cell_name(c.execution_count) for c in edits.cells)
        blocks.append(f"<div>To make {_prose(scope)} permanent, edit {_e(names)}:</div>")
        blocks += [_diff(c.diff, _cell_name(c.execution_count)) for c in edits.cells]
    else:
        for finding in report.findings:
            change = finding.code_change
            if change is None:
                continue
            parts = [_diff(c.diff, _cell_name(c.execution_count)) for c in change.cells]
            if not parts and change.diff:
                parts.append(_diff(change.diff, "In this cell"))
            if change.elsewhere:
                items = "".join(
                    f"<li><code>{_prose(item)}</code></li>" for item in change.elsewhere
                )
                parts.append(f"<div>Where the objects are created:</div><ul>{items}</ul>")
            if parts:
                title = f"<div><code>{_e(finding.id)}</code> {_prose(finding.title)}</div>"
                blocks.append(title + "".join(parts))
    if not blocks:
        return ""
    return f"<details open><summary><b>Code changes</b></summary>{''.join(blocks)}</details>"


# one colour per part of the time split, in SPLIT_PARTS' order (the view's, too)
_SPLIT_COLOURS = ("#d9822b", "#4c78a8", "#72b7b2", "#b279a2", "#eeca3b", "#9d9d9d")
_PART_COLOURS = dict(zip((key for key, _ in summary.SPLIT_PARTS), _SPLIT_COLOURS, strict=True))


def _split_bar(report: Report) -> str:
    """The time split as one stacked bar, each part's width its share, named on hover."""
    shares = summary.split_shares(report)
    if not shares:
        return ""
    colours = dict(zip((name for _, name in summary.SPLIT_PARTS), _SPLIT_COLOURS, strict=True))
    segments = "".join(
        f'<span title="{_e(name)} {share:.0%}" style="display:inline-block;height:12px;'
        f'width:{share * 100:.2f}%;background:{colours[name]}"></span>'
        for name, share in shares
    )
    return (
        '<div class="ttm-time-split" style="display:flex;max-width:660px;margin:4px 0">'
        f"{segments}</div>"
    )


def _checked(report: Report) -> str:
    """Checks whose own trial settled them here ("checked: slower here"), collapsed, one
    group per outcome, each with the figure it rests on."""
    groups: dict[str, list[Checked]] = {}
    for item in report.checked:
        groups.setdefault(item.outcome, []).append(item)
    return "".join(
        f'<details class="ttm-checked"><summary>{_e(summary.checked_heading(outcome))} '
        f"({len(items)})</summary>"
        "<ul>"
        + "".join(
            f'<li data-check="{_e(c.id)}"><code>{_e(c.id)}</code> <b>{_prose(c.title)}</b>'
            f'<div style="{_NOTE}">{_prose(c.evidence)}</div></li>'
            for c in items
        )
        + "</ul></details>"
        for outcome, items in groups.items()
    )


def _not_applicable(report: Report) -> str:
    """The checks that do not apply here, one line per reason with their ids."""
    if not report.not_applicable:
        return ""
    lines = "".join(
        "<li>" + ", ".join(f"<code>{_e(i)}</code>" for i in ids) + f" — {_prose(reason)}</li>"
        for ids, reason in summary.by_reason(report.not_applicable)
    )
    return (
        f"<details><summary>Not applicable here ({len(report.not_applicable)})</summary>"
        f"<ul>{lines}</ul></details>"
    )


def render(report: Report) -> str:
    act = [f for f in report.findings if not summary.no_gain(report, f)]
    no_gain = [f for f in report.findings if summary.no_gain(report, f)]
    if not report.findings:
        findings = f"<p>{_e(summary.no_findings(report))}</p>"
    else:
        findings = f"<h4>Findings ({len(act)})</h4>" + (_table(report, act) if act else "")
    if no_gain:
        findings += (
            f"<details><summary>{_e(summary.NO_GAIN)} ({len(no_gain)})</summary>"
            f"{_table(report, no_gain)}</details>"
        )
    findings += _checked(report)
    together = "".join(
        f"<p>{_e(summary.combined_label(report, v))}: "
        f'<span style="color:{_TONES[_tone(report, v)]}">'
        f"{_prose(summary.speedup(report, v))}</span>"
        + (
            " " + _badge(summary.memory_badge(report, v), summary.memory_tone(report, v))
            if summary.memory_badge(report, v)
            else ""
        )
        + (" " + _results(v) if v.speedup is not None and not v.error else "")
        + "</p>"
        for v in report.latest_variants()
        if len(v.fixes) > 1
    )
    # where the time went, first under the title; then what the run was
    split = _split_bar(report) + (
        f"<div>{_e(summary.split_line(report))}</div>" if summary.split_line(report) else ""
    )
    context = "".join(
        f"<div>{_prose(line)}</div>"
        for line in (
            summary.baseline_line(report),
            summary.oom_line(report),
            summary.phase_line(report),
            summary.sampling_line(report),
            summary.load_line(report),
            summary.distributed_line(report),
            summary.cell_run_line(report),
        )
        if line
    )
    warnings = "".join(f"<li>{_prose(w)}</li>" for w in report.warnings)
    failures = "".join(
        f"<li><details><summary>{_prose(summary.own_failure_line(f))}</summary>"
        f"<pre>{_e(f.traceback)}</pre></details></li>"
        for f in report.failures
    )
    return (
        f'<div class="ttm-report" style="{_STYLE}">'
        f"<b>{_e(summary.title(report))}</b>{split}{context}"
        f"{findings}{together}{chart(report)}{_code_changes(report)}{_not_applicable(report)}"
        f"{f'<h4>{_e(summary.OWN_FAILURES)}</h4><ul>{failures}</ul>' if failures else ''}"
        f"{f'<h4>Warnings</h4><ul>{warnings}</ul>' if warnings else ''}</div>"
    )
