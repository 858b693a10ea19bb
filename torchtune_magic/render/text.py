"""Plain-text rendering: terminals, logs, the `text/plain` fallback."""

from __future__ import annotations

from ..report import Report
from . import summary


def render(report: Report) -> str:
    lines = ["%%perfcheck report", summary.baseline_line(report)]
    lines += [
        line
        for line in (
            summary.oom_line(report),
            summary.phase_line(report),
            summary.sampling_line(report),
            summary.cell_run_line(report),
        )
        if line
    ]
    lines.append("")
    if not report.findings:
        lines.append("No findings: nothing in this cell matches the tuning guide's checks.")
    for index, finding in enumerate(report.findings, 1):
        variant = summary.solo_variant(report, finding)
        lines.append(f"{index}. [{finding.id}] {finding.title}")
        lines.append(f"   evidence: {finding.evidence}")
        lines.append(f"   where:    {finding.where}")
        if finding.fixable:
            lines.append(f"   fix:      {summary.speedup(report, variant)}")
            for label, text in (
                ("memory", summary.memory_change(report, variant)),
                ("numerics", summary.numerics(variant)),
                ("compute", summary.throughput(variant)),
            ):
                if text:
                    lines.append(f"   {label + ':':9} {text}")
        else:
            lines.append("   fix:      no live fix; make the code change below")
        if finding.caveat:
            lines.append(f"   caveat:   {finding.caveat}")
        if finding.code_change and finding.code_change.diff:
            lines.extend("   | " + line for line in finding.code_change.diff.splitlines())
        for item in finding.code_change.elsewhere if finding.code_change else []:
            lines.append(f"   also: {item}")
        lines.append(f"   guide:    {finding.guide}")
    together = [v for v in report.latest_variants() if len(v.fixes) > 1]
    for variant in together:
        lines.append("")
        lines.append(
            f"all fixes together ({', '.join(variant.fixes)}): {summary.speedup(report, variant)}"
        )
        if variant.achieved_tflops is not None:
            lines.append(f"   compute:  {summary.throughput(variant)}")
    for item in report.not_applicable:
        lines.append(f"[{item.id}] {item.reason}")
    for warning in report.warnings:
        lines.append(f"warning: {warning}")
    if report.applied:
        lines.append(f"left applied: {', '.join(report.applied)}")
    return "\n".join(lines)
