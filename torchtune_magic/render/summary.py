"""Wording shared by every renderer, so text, HTML and the panel say the same thing."""

from __future__ import annotations

from ..report import Finding, Report, Stats, Variant

SLOWER = "measured slower here — not recommended"
MEASURING = "measuring…"


def solo_variant(report: Report, finding: Finding) -> Variant | None:
    return report.variant_for([finding.id])


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def size(value: int | None) -> str:
    if value is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def plural(unit: str) -> str:
    """`batches`, `optimizer steps`, `forwards`."""
    return f"{unit}es" if unit.endswith(("ch", "sh", "s", "x")) else f"{unit}s"


def per_step(report: Report) -> str:
    """` per batch` when runs were sampled (times are then per step), else ''."""
    return f" per {report.sampling.unit}" if report.sampling else ""


def speedup(report: Report, variant: Variant | None) -> str:
    """`1.54x`, `0.87x — measured slower here — not recommended`, `measuring…`, or why not
    measured; sampled runs add the whole cell, projected."""
    if variant is None or (variant.speedup is None and not variant.error):
        return MEASURING if report.measuring else "not measured"
    if variant.error:
        return f"failed: {variant.error}"
    assert variant.speedup is not None
    if variant.judged_by == "memory":
        return memory_first(report, variant)
    text = f"{variant.speedup:.2f}x{per_step(report)}"
    if variant.is_slower:
        text += f" — {SLOWER}"
    elif not variant.is_win:
        text += " — no measurable change"
    if variant.noisy:
        text += " (noisy)"
    whole = projected(report, variant)
    if whole:
        text += f"; {whole}"
    one_time = one_time_cost(variant)
    return f"{text}; {one_time}" if one_time else text


def memory_first(report: Report, variant: Variant) -> str:
    """A memory fix under --memory: `6.8x less peak memory for 5% more time`."""
    assert variant.speedup is not None
    time_change = 1 / variant.speedup - 1
    cost = f"{abs(time_change):.0%} {'more' if time_change >= 0 else 'less'} time"
    before, after = report.baseline.peak_memory_bytes, variant.peak_memory_bytes
    if not before or not after:
        return f"peak memory not measured; {cost}"
    ratio = before / after
    less = f"{ratio:.1f}x less" if ratio >= 1 else f"{1 / ratio:.1f}x more"
    return f"{less} peak memory for {cost}"


def projected(report: Report, variant: Variant) -> str:
    """`whole cell 61.2 s → 27.0 s (projected)` for a sampled measurement, or ''."""
    before, after = report.baseline.projected_cell_s, variant.projected_cell_s
    if before is None or after is None:
        return ""
    return f"whole cell {seconds(before)} → {seconds(after)} (projected)"


def one_time_cost(variant: Variant) -> str:
    """`13.8 s one-time (compile), pays back after 92 runs`, or ''."""
    if variant.one_time_s is None:
        return ""
    cause = variant.one_time_cause or "compile, worker start"
    text = f"{seconds(variant.one_time_s)} one-time ({cause})"
    if variant.break_even_runs is not None:
        runs = variant.break_even_runs
        text += f", pays back after {runs} run{'s' if runs != 1 else ''}"
    return text


def memory_change(report: Report, variant: Variant | None) -> str:
    if variant is None or variant.peak_memory_bytes is None:
        return ""
    base = report.baseline.peak_memory_bytes
    if not base:
        return size(variant.peak_memory_bytes)
    ratio = variant.peak_memory_bytes / base
    return f"{size(base)} → {size(variant.peak_memory_bytes)} ({ratio:.2f}x)"


def numerics(variant: Variant | None) -> str:
    if variant is None or variant.error:
        return ""
    n = variant.numerics
    if n.verdict == "changed" and n.max_rel_diff is not None:
        return f"changed (max rel diff {n.max_rel_diff:.2e})"
    if n.verdict == "close" and n.max_rel_diff is not None:
        return f"close (max rel diff {n.max_rel_diff:.2e})"
    return n.verdict


def flops(value: int | None) -> str:
    if value is None:
        return "–"
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} FLOP"


def throughput(item: Stats | Variant | None) -> str:
    """`41.2 TFLOP/s, 8.3% of peak (494.7 TFLOP/s)`, or '' where FLOPs were not counted."""
    if item is None or item.achieved_tflops is None:
        return ""
    rate = item.achieved_tflops
    text = f"{rate:.3g} TFLOP/s" if rate >= 1 else f"{rate * 1e3:.3g} GFLOP/s"
    if item.utilisation is not None and item.peak_tflops:
        text += f", {item.utilisation:.1%} of peak ({item.peak_tflops:.1f} TFLOP/s)"
    return text


def baseline_line(report: Report) -> str:
    b = report.baseline
    env = report.environment
    device = f"{env.get('device_name', '')} ({env.get('device', '')}), torch {env.get('torch', '')}"
    if b.median_s is None:
        state = MEASURING if report.measuring else "not measured"
        return f"baseline {state} — {device}"
    noisy = " (noisy)" if b.noisy else ""
    unit = report.sampling.unit if report.sampling else "run"
    compute = f", {flops(b.flops)}/{unit} at {throughput(b)}" if b.flops else ""
    whole = (
        f"; whole cell {seconds(b.projected_cell_s)} (projected)"
        if b.projected_cell_s is not None
        else ""
    )
    return (
        f"baseline {seconds(b.median_s)}{per_step(report)} ± {seconds(b.iqr_s)} IQR over "
        f"{b.runs} runs{noisy}, peak memory {size(b.peak_memory_bytes)}{compute}{whole} — "
        f"{device}"
    )


def sampling_line(report: Report) -> str:
    """How a long cell was sampled, or '' when every run was the whole cell."""
    sampled = report.sampling
    if sampled is None:
        return ""
    unit = sampled.unit
    total = sampled.steps_per_run
    of = f" of {total}" if total else ""
    detail = f" ({sampled.steps_detail})" if sampled.steps_detail else ""
    first, last = sampled.warmup_steps + 1, sampled.stop_step
    return (
        f"sampled: every measuring run stopped after {unit} {last}{of}{detail}, "
        f"{plural(unit)} {first}–{last} timed after {sampled.warmup_steps} warm-up; "
        f"times are per {unit}, the whole cell projected"
    )


def oom_line(report: Report) -> str:
    """`ran out of memory at cell line 3: asked for 4.0 TiB with 1.2 GiB in use …`, or ''."""
    oom = report.oom
    if oom is None:
        return ""
    where = f" at cell line {oom.line}" if oom.line else ""
    asked = f", asking for {size(oom.requested_bytes)}" if oom.requested_bytes else ""
    in_use = (
        f" with {size(oom.in_use_bytes)} in use ({oom.in_use_measure})" if oom.in_use_bytes else ""
    )
    return (
        f"the cell ran out of memory{where}{asked}{in_use}: {oom.error}. Nothing was timed; "
        "the findings below come from the run up to the failure, memory fixes first"
    )


def cell_run_line(report: Report) -> str:
    """What became of the cell's one complete run (the kernel contract), or ''."""
    run = report.cell_run
    if run is None or report.oom is not None:
        return ""
    unit = report.sampling.unit if report.sampling else "step"
    with_fixes = f", with {', '.join(run.fixes)}" if run.fixes else ""
    if run.status == "probe":
        return "the cell ran once, complete, in the probe: the kernel is as after that run"
    if run.status == "running":
        return f"finishing the cell: its one complete run{with_fixes}…"
    if run.status == "skipped":
        return "--no-finish: the cell's complete run was skipped; the kernel is as before the cell"
    done = f"{run.steps} {plural(unit)}" if run.steps is not None else ""
    took = ", ".join(part for part in (seconds(run.seconds), done) if part)
    if run.status == "complete":
        return f"the cell's complete run: {took}{with_fixes}"
    if run.status == "interrupted":
        return f"the cell's complete run was interrupted (Ctrl-C) after {took}{with_fixes}"
    return f"the cell's complete run failed after {took}{with_fixes}: {run.detail or ''}"


def phase_line(report: Report) -> str:
    if report.phase == "measuring":
        return "measuring… numbers fill in as each configuration is measured"
    if report.phase == "interrupted":
        return "interrupted (Ctrl-C) before every number was in"
    return ""
