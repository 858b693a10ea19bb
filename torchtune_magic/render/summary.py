"""Wording shared by every renderer, so text, HTML and the panel say the same thing."""

from __future__ import annotations

from ..report import Finding, Report, Stats, Variant

SLOWER = "measured slower here — not recommended"


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
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def speedup(variant: Variant | None) -> str:
    """`1.54x faster`, `0.87x — measured slower here — not recommended`, or why not measured."""
    if variant is None:
        return "not measured"
    if variant.error:
        return f"failed: {variant.error}"
    if variant.speedup is None:
        return "not measured"
    text = f"{variant.speedup:.2f}x"
    if variant.is_slower:
        text += f" — {SLOWER}"
    elif not variant.is_win:
        text += " — no measurable change"
    if variant.noisy:
        text += " (noisy)"
    one_time = one_time_cost(variant)
    return f"{text}; {one_time}" if one_time else text


def one_time_cost(variant: Variant) -> str:
    """`13.8 s one-time (compile, worker start), pays back after 92 runs`, or ''."""
    if variant.one_time_s is None:
        return ""
    text = f"{seconds(variant.one_time_s)} one-time (compile, worker start)"
    if variant.break_even_runs is not None:
        text += f", pays back after {variant.break_even_runs} runs"
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
    noisy = " (noisy)" if b.noisy else ""
    compute = f", {flops(b.flops)}/run at {throughput(b)}" if b.flops else ""
    return (
        f"baseline {seconds(b.median_s)} ± {seconds(b.iqr_s)} IQR over {b.runs} runs{noisy}, "
        f"peak memory {size(b.peak_memory_bytes)}{compute} — {env.get('device_name', '')} "
        f"({env.get('device', '')}), torch {env.get('torch', '')}"
    )
