"""The lines a script's report opens its tail with: its whole run, and each fix's per-step
gain set against the one-time cost it brings.

A script is run whole by whoever uses it: its setup, each epoch's worker start and a
compile count as much as its steps. The engine measures steps (W warm-up steps, then K
timed ones, per step) and projects the whole run from the first run's time to step W (setup
and one-time costs inside it) plus every later step. A fix that speeds each step but costs
a start-up (workers, compile) can then be a per-step win and a whole-run loss on a short
script: both figures are said, with what would make it pay — the number of steps after
which the per-step saving has paid the start-up, and, for workers, that persistent workers
pay it once instead of every epoch.
"""

from __future__ import annotations

import math

from ..report import Report, Variant
from .script import ScriptWorkload


def _plural(unit: str) -> str:
    return f"{unit}es" if unit == "batch" else f"{unit}s"


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def whole_run(report: Report) -> str | None:
    """The script's whole run as its complete run measured it (where the instrumented
    probe was that run, as the uninstrumented runs project it), and its steady step."""
    run, sampling, base = report.cell_run, report.sampling, report.baseline
    if run is None or run.status not in ("complete", "probe"):
        return None
    if run.seconds is not None:
        text = f"the script's whole run: {_s(run.seconds)}"
    elif base.projected_cell_s:
        text = f"the script's whole run: {_s(base.projected_cell_s)} (projected)"
    else:
        return None
    if run.steps:
        unit = sampling.unit if sampling else "step"
        text += f" ({run.steps} {_plural(unit)}"
        text += "; its setup, one-time costs and what runs after the last step counted)"
        if sampling is not None and base.median_s is not None:
            text += f"; a steady {unit}: {_s(base.median_s)}"
    return text


def _whole_runs(report: Report, variant: Variant) -> tuple[float | None, float | None]:
    """The whole run before and after the fix. The engine projects a run from its steps
    (setup and one-time costs to step W, then every later step); what follows the last
    step (a test pass, saving) is in no projection. Where the script's complete run ran
    without fixes, its time is the whole run before, and the fix's whole run is that less
    what the projections say the fix saves."""
    before, after = report.baseline.projected_cell_s, variant.projected_cell_s
    run = report.cell_run
    if before and after and run and run.seconds and run.status == "complete" and not run.fixes:
        return run.seconds, run.seconds - (before - after)
    return before, after


def fix_line(report: Report, variant: Variant) -> str | None:
    """A measured fix: per step, its one-time cost, the whole run projected, and when the
    per-step gain pays the one-time cost back (None where the fix was not measured)."""
    base, sampling = report.baseline, report.sampling
    if variant.median_s is None or base.median_s is None or sampling is None:
        return None
    unit = sampling.unit
    name = "+".join(variant.fixes)
    settled = "" if variant.verdict else f", {variant.rounds or 1} rounds, not settled"
    ratio = variant.speedup or base.median_s / variant.median_s
    text = (
        f"{name}: {_s(base.median_s)} → {_s(variant.median_s)} per {unit} ({ratio:.2f}×{settled})"
    )
    if variant.one_time_s:
        cause = variant.one_time_cause or "one-time cost"
        text += f"; start-up {_s(variant.one_time_s)} per run ({cause})"
    before, after = _whole_runs(report, variant)
    if before and after:
        text += f"; whole run {_s(before)} → {_s(after)} (projected, start-up counted)"
    saved = base.median_s - variant.median_s
    steps = sampling.steps_per_run
    if variant.one_time_s and saved > 0:
        pays_after = math.ceil(variant.one_time_s / saved)
        of = f" of this run's {steps}" if steps else ""
        if before and after and after >= before:
            has = f" (this run has {steps})" if steps else ""
            text += (
                f": the start-up eats the per-{unit} gain here; it pays with more than "
                f"{pays_after} {_plural(unit)} per run{has}: more per epoch, or more epochs "
                "with persistent workers, which start once per run instead of every epoch"
            )
        else:
            text += f": pays back its start-up after {pays_after} {_plural(unit)}{of}"
    return text


def lines(report: Report, workload: ScriptWorkload) -> tuple[list[str], list[str]]:
    """(The script's whole run and where its files went; each measured fix against it)."""
    whole = [whole_run(report)]
    written = workload.writes.written
    if written:
        whole.append(
            f"files the script writes ({', '.join(written)}) were written by its complete run "
            "only: the other runs wrote to a scratch folder, deleted afterwards"
        )
    fixes = [fix_line(report, variant) for variant in report.latest_variants()]
    return [line for line in whole if line], [line for line in fixes if line]
