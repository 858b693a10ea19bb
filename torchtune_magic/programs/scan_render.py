"""The scan's summary as text (the CLI's output) and as one HTML page (`--html`): the
checked cells with why, time, time split, findings and measured fixes; the longest cells
passed over with why; where the scan stopped; the optimized copy; the verify's line,
per-cell times, masked lines and differences. Every string from the notebook is escaped
in the page; each checked cell's report is `render/html.py`'s own view."""

from __future__ import annotations

from html import escape

from ..render import html as report_html
from ..render import summary
from ..report import Report
from .scan_result import ScannedCell, ScanResult, Verification

PASSED_OVER_SHOWN = 5
CELL_SHOWN_S = 0.1  # the verify's per-cell times in text: cells at least this long


def verify_line(verify: Verification) -> str:
    """`63.8 s → 31.0 s (2.06×); outputs identical in 24 of 24 cells`."""
    speed = f" ({verify.speedup:.2f}×)" if verify.speedup else ""
    runs = "" if verify.runs == 1 else f", median of {verify.runs} runs each"
    same = (
        f"outputs identical in {verify.cells_same} of {verify.cells_compared} cells"
        if not verify.differences
        else f"outputs differ in {len(verify.differences)} of {verify.cells_compared} cells"
    )
    return f"{verify.original_s:.1f} s → {verify.optimized_s:.1f} s{speed}{runs}; {same}"


def _fix_lines(report: Report) -> list[str]:
    lines = []
    for finding in report.findings:
        if finding.fixable:
            variant = summary.solo_variant(report, finding)
            lines.append(f"{finding.id} ({finding.where}): {summary.speedup(report, variant)}")
        else:
            lines.append(f"{finding.id} ({finding.where}): no live fix; a code change")
    return lines


def _checked_text(cell: ScannedCell) -> list[str]:
    lines = [f"  cell {cell.index}: {cell.why}"]
    report = cell.parsed_report
    if report is None:
        return [*lines, "    no report (see the notes)"]
    for line in (summary.split_line(report), summary.cell_run_line(report)):
        if line:
            lines.append(f"    {line}")
    fixes = _fix_lines(report)
    ids = list(dict.fromkeys(f.id for f in report.findings))  # one id per check, in order
    lines.append(f"    findings: {', '.join(ids) or 'none'}")
    lines += [f"      {line}" for line in fixes]
    return lines


def passed_over(result: ScanResult) -> list[ScannedCell]:
    """The cells not checked, longest first, at most PASSED_OVER_SHOWN."""
    cells = [c for c in result.cells if not c.checked]
    return sorted(cells, key=lambda c: -(c.seconds or 0.0))[:PASSED_OVER_SHOWN]


def text(result: ScanResult) -> str:
    plain = f", plain run {result.plain_s:.1f} s" if result.plain_s is not None else ""
    lines = [f"scan of {result.notebook}: {len(result.cells)} code cells ran{plain}"]
    checked = result.checked
    lines.append(f"checked ({len(checked)}):" if checked else "checked: none")
    for cell in checked:
        lines += _checked_text(cell)
    over = passed_over(result)
    if over:
        lines.append("passed over (longest first):")
        lines += [f"  cell {c.index} ({c.seconds or 0:.2f} s): {c.why}" for c in over]
    if result.failure:
        went_on = "" if not result.stopped else "; the scan stopped there (--allow-errors goes on)"
        lines.append(f"cell {result.failure.index} raised {result.failure.error}{went_on}")
    if result.optimized is not None:
        where = result.optimized.path or "(not written)"
        edits = "; ".join(f"cell {e.index}: {', '.join(e.fixes)}" for e in result.optimized.edits)
        lines.append(f"optimized copy: {where} ({edits or 'no cell changed'})")
    verify = result.verification
    if verify is not None:
        lines.append(f"verify: {verify_line(verify)}")
        timed = {i: t for i, t in verify.cell_seconds.items() if max(t) >= CELL_SHOWN_S}
        for index, (before, after) in sorted(timed.items()):
            lines.append(f"  cell {index}: {before:.2f} s → {after:.2f} s")
        if len(timed) < len(verify.cell_seconds):
            lines.append(f"  (cells under {CELL_SHOWN_S:g} s in both left out)")
        lines += [f"  masked as wall-clock time: {line}" for line in verify.masked]
        lines += [f"  DIFFERENCE in cell {d.index}: {d.line}" for d in verify.differences]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def _verify_html(verify: Verification) -> str:
    rows = "".join(
        f"<tr><td>cell {index}</td><td>{before:.2f} s</td><td>{after:.2f} s</td>"
        f"<td>{_outputs_cell(verify, index)}</td></tr>"
        for index, (before, after) in sorted(verify.cell_seconds.items())
    )
    masked = "".join(f"<li><code>{escape(line)}</code></li>" for line in verify.masked)
    return (
        f"<h2>Verify</h2><p>{escape(verify_line(verify))}</p>"
        "<table><tr><th>cell</th><th>original</th><th>optimized</th><th>outputs</th></tr>"
        f"{rows}</table>"
        + (f"<p>Masked as wall-clock time:</p><ul>{masked}</ul>" if masked else "")
    )


def _outputs_cell(verify: Verification, index: int) -> str:
    found = next((d for d in verify.differences if d.index == index), None)
    return f"differs: {escape(found.line)}" if found else "identical"


def html(result: ScanResult) -> str:
    """One standalone page with all of it."""
    cells = "".join(
        f"<tr><td>{c.index}</td><td>{'checked' if c.checked else 'passed over'}</td>"
        f"<td>{'' if c.seconds is None else f'{c.seconds:.2f} s'}</td><td>{escape(c.why)}</td></tr>"
        for c in result.cells
    )
    reports = "".join(
        f"<section><h2>cell {c.index}</h2><p>{escape(c.why)}</p><details><summary>cell code"
        f"</summary><pre>{escape(c.source)}</pre></details>"
        f"{report_html.render(r) if (r := c.parsed_report) else '<p>no report</p>'}</section>"
        for c in result.checked
    )
    body = [
        f"<pre>{escape(text(result))}</pre>",
        "<h2>Cells</h2><table><tr><th>cell</th>"
        f"<th>checked</th><th>time</th><th>why</th></tr>{cells}</table>",
        reports,
    ]
    if result.verification is not None:
        body.append(_verify_html(result.verification))
    title = escape(f"torchtune-magic scan: {result.notebook}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
        f"<body><h1>{title}</h1>{''.join(body)}</body></html>"
    )
