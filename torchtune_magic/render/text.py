"""Plain-text rendering: terminals, logs, the `text/plain` fallback.

Reads like the view (labextension/src/view.ts): findings to act on first, then the checks
that measured no gain and those whose own trial measured their fix slower, then the
not-applicable checks under one heading.
"""

from __future__ import annotations

from ..report import Finding, Report
from . import summary


def _finding(report: Report, index: int, finding: Finding) -> list[str]:
    variant = summary.solo_variant(report, finding)
    applied = " (applied)" if finding.id in report.applied else ""
    lines = [f"{index}. [{finding.id}] {finding.title}{applied}"]
    lines.append(f"   evidence: {finding.evidence}")
    if finding.details:
        lines.append(f"   details:  {finding.details}")
    acts_on = summary.segment(report, finding)
    if acts_on:
        lines.append(f"   acts on:  {acts_on}")
    lines.append(f"   where:    {finding.where}")
    if finding.fixable:
        lines.append(f"   fix:      {summary.speedup(report, variant)}")
        for label, text in (
            ("memory", summary.memory_change(report, variant)),
            ("numerics", summary.numerics(variant)),
            ("loss", summary.loss(variant)),
            ("compute", summary.throughput(variant)),
            ("before", summary.earlier(report, variant) if variant else ""),
        ):
            if text:
                lines.append(f"   {label + ':':9} {text}")
    else:
        lines.append("   fix:      no live fix; make the code change below")
    if finding.caveat:
        lines.append(f"   caveat:   {finding.caveat}")
    change = finding.code_change
    if change and change.cells:
        for cell in change.cells:
            lines.extend("   | " + line for line in cell.diff.splitlines())
    elif change and change.diff:
        lines.extend("   | " + line for line in change.diff.splitlines())
    for item in change.elsewhere if change else []:
        lines.append(f"   also: {item}")
    lines.append(f"   guide:    {finding.guide}")
    return lines


def render(report: Report) -> str:
    lines = [summary.title(report), summary.baseline_line(report)]
    lines += [
        line
        for line in (
            summary.split_line(report),
            summary.oom_line(report),
            summary.phase_line(report),
            summary.sampling_line(report),
            summary.load_line(report),
            summary.distributed_line(report),
            summary.cell_run_line(report),
        )
        if line
    ]
    lines.append("")
    act = [f for f in report.findings if not summary.no_gain(report, f)]
    no_gain = [f for f in report.findings if summary.no_gain(report, f)]
    if not report.findings and report.checked:
        lines.append("No findings to act on: what the checks measured is below.")
    elif not report.findings:
        lines.append(summary.no_findings(report))
    for index, finding in enumerate(act, 1):
        lines.extend(_finding(report, index, finding))
    if no_gain:
        lines.append("")
        lines.append(f"{summary.NO_GAIN} ({len(no_gain)}):")
        for finding in no_gain:
            variant = summary.solo_variant(report, finding)
            lines.append(f"   [{finding.id}] {finding.title}: {summary.speedup(report, variant)}")
    for outcome in dict.fromkeys(c.outcome for c in report.checked):
        checked = [c for c in report.checked if c.outcome == outcome]
        lines.append("")
        lines.append(f"{summary.checked_heading(outcome)} ({len(checked)}):")
        lines.extend(f"   [{c.id}] {c.title}: {c.evidence}" for c in checked)
    for variant in (v for v in report.latest_variants() if len(v.fixes) > 1):
        lines.append("")
        lines.append(
            f"{summary.combined_label(report, variant)}: {summary.speedup(report, variant)}"
        )
        for label, text in (
            ("memory", summary.memory_change(report, variant)),
            ("compute", summary.throughput(variant)),
            ("before", summary.earlier(report, variant)),
        ):
            if text:
                lines.append(f"   {label + ':':9} {text}")
    if report.not_applicable:
        lines.append("")
        lines.append(f"not applicable here ({len(report.not_applicable)}):")
        lines.extend(
            f"   [{', '.join(ids)}] {reason}"
            for ids, reason in summary.by_reason(report.not_applicable)
        )
    if report.failures:
        lines.append("")
        lines.append(f"{summary.OWN_FAILURES}:")
        lines.extend(f"   {summary.own_failure_line(f)}" for f in report.failures)
        lines.append("   (the tracebacks are in the report's JSON, under `failures`)")
    for warning in report.warnings:
        lines.append(f"warning: {warning}")
    if report.applied:
        lines.append(f"left applied: {', '.join(report.applied)}")
    return "\n".join(lines)
