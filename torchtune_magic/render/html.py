"""Static HTML: the `text/html` fallback GitHub, nbviewer and VS Code show.

Every string that can come from user code is escaped. The chart is inline SVG, no script.
"""

from __future__ import annotations

from html import escape

from ..report import Report, Variant
from . import summary

_STYLE = (
    "font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;"
    "color:var(--jp-ui-font-color1,#222)"
)
_BAR_W = 320


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def chart(report: Report) -> str:
    """Before/after bars: baseline and every measured variant, time (ms) to scale."""
    rows: list[tuple[str, float, bool]] = []
    if report.baseline.median_s:
        rows.append(("baseline", report.baseline.median_s, False))
    for variant in report.latest_variants():
        if variant.median_s and not variant.error:
            rows.append(("+".join(variant.fixes), variant.median_s, variant.is_slower))
    if len(rows) < 2:
        return ""
    longest = max(value for _, value, _ in rows)
    height = 22 * len(rows) + 6
    parts = [
        f'<svg role="img" aria-label="before/after time" width="{_BAR_W + 330}" '
        f'height="{height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for index, (label, value, slower) in enumerate(rows):
        y = 4 + 22 * index
        width = max(2, int(_BAR_W * value / longest))
        color = "#9e9e9e" if index == 0 else ("#e57373" if slower else "#43a047")
        parts.append(
            f'<text x="0" y="{y + 14}" font-size="12" fill="currentColor">{_e(label[:40])}</text>'
            f'<rect x="200" y="{y}" width="{width}" height="16" fill="{color}"/>'
            f'<text x="{206 + width}" y="{y + 13}" font-size="11" fill="currentColor">'
            f"{_e(summary.seconds(value))}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _finding_row(report: Report, index: int, variant: Variant | None, finding) -> str:
    fix = summary.speedup(report, variant) if finding.fixable else "no live fix"
    badges = " ".join(
        f'<span style="border:1px solid #999;border-radius:3px;padding:0 3px">{_e(text)}</span>'
        for text in (
            summary.numerics(variant),
            summary.memory_change(report, variant),
            summary.throughput(variant),
        )
        if text
    )
    change = ""
    if finding.code_change and (finding.code_change.diff or finding.code_change.elsewhere):
        items = "".join(f"<li>{_e(item)}</li>" for item in finding.code_change.elsewhere)
        diff = (
            f"<pre style='margin:2px 0'>{_e(finding.code_change.diff)}</pre>"
            if finding.code_change.diff
            else ""
        )
        change = (
            f"<details><summary>code change</summary>{diff}"
            f"{f'<ul>{items}</ul>' if items else ''}</details>"
        )
    caveat = f"<div><i>caveat:</i> {_e(finding.caveat)}</div>" if finding.caveat else ""
    return (
        f"<tr><td>{index}</td><td><code>{_e(finding.id)}</code></td>"
        f"<td><b>{_e(finding.title)}</b><div>{_e(finding.evidence)}</div>"
        f"<div><i>where:</i> {_e(finding.where)} · <i>guide:</i> {_e(finding.guide)}</div>"
        f"{caveat}{change}</td><td>{_e(fix)}<div>{badges}</div></td></tr>"
    )


def render(report: Report) -> str:
    rows = "".join(
        _finding_row(report, i, summary.solo_variant(report, f), f)
        for i, f in enumerate(report.findings, 1)
    )
    table = (
        "<table><thead><tr><th>#</th><th>check</th><th>finding</th><th>measured fix</th>"
        f"</tr></thead><tbody>{rows}</tbody></table>"
        if rows
        else "<p>No findings: nothing in this cell matches the tuning guide's checks.</p>"
    )
    together = "".join(
        f"<p>All fixes together ({_e(', '.join(v.fixes))}): {_e(summary.speedup(report, v))}</p>"
        for v in report.latest_variants()
        if len(v.fixes) > 1
    )
    notes = "".join(
        f"<li><code>{_e(n.id)}</code>: {_e(n.reason)}</li>" for n in report.not_applicable
    ) + "".join(f"<li>warning: {_e(w)}</li>" for w in report.warnings)
    context = "".join(
        f"<div>{_e(line)}</div>"
        for line in (
            summary.oom_line(report),
            summary.phase_line(report),
            summary.sampling_line(report),
            summary.cell_run_line(report),
        )
        if line
    )
    return (
        f'<div class="ttm-report" style="{_STYLE}">'
        f"<b>%%perfcheck</b> · {_e(summary.baseline_line(report))}{context}"
        f"{chart(report)}{table}{together}"
        f"{f'<ul>{notes}</ul>' if notes else ''}</div>"
    )
