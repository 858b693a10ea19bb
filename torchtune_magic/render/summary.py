"""Wording shared by every renderer, so text, HTML and the panel say the same thing."""

from __future__ import annotations

from datetime import datetime

from ..report import Finding, NotApplicable, OwnFailure, Report, Stats, Variant, count

SLOWER = "measured slower here — not recommended"
NO_CLEAR_CHANGE = "no clear change"
PROVISIONAL = "so far (still measuring)"
NOT_COMPARED = "results not compared yet"
FITS = "fits with this fix: it ran past where the cell ran out of memory"
MEASURING = "measuring…"
NO_GAIN = "checked: no gain here"
MEMORY_SAME = 0.01  # peak memory moved by less than this share reads "same memory"
BUSY_CPUS = 0.25  # other processes' busy CPUs worth a line in the report
# ... over a measuring window at least this long (a window of a few ticks, where nothing
# was timed, reads "2.00 of 2 CPUs busy (0.0 CPU-s in 0.0 s)")
LOAD_WINDOW_MIN_S = 0.5


def solo_variant(report: Report, finding: Finding) -> Variant | None:
    return report.variant_for([finding.id])


def no_gain(report: Report, finding: Finding) -> bool:
    """A check that fired and whose fix, measured alone, gained nothing clear — not a win,
    with an interval that settled (more budget would not have told otherwise), no error,
    not a memory fix judged by memory — once measuring is done: shown apart as "checked:
    no gain here", never as a finding to act on (the labextension's isNoGain). While
    numbers still come in, nothing is concluded."""
    if not finding.fixable or report.measuring:
        return False
    variant = solo_variant(report, finding)
    if variant is not None and variant.at_most is not None and variant.speedup is None:
        return True  # too small to matter: not timed
    return (
        variant is not None
        and not variant.error
        and variant.speedup is not None
        and variant.judged_by != "memory"
        and not variant.is_win
        and variant.budget_to_tell_s is None
    )


def clock(iso: str | None) -> str:
    """`14:02` in this machine's time zone, from an ISO 8601 time; '' when there is none."""
    if not iso:
        return ""
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone().strftime("%H:%M")
    except ValueError:
        return ""


def earlier(report: Report, variant: Variant) -> str:
    """Earlier measurements of the same fixes: `earlier: 1.80x at 14:02`, or ''."""
    key = sorted(variant.fixes)
    parts = []
    for old in report.variants:
        if old is variant or sorted(old.fixes) != key or old.speedup is None:
            continue
        measured = "failed" if old.error else factor(old.speedup)
        at = clock(old.measured_at)
        parts.append(f"{measured} at {at}" if at else measured)
    return f"earlier: {', '.join(parts)}" if parts else ""


def measured_before(report: Report, variant: Variant) -> str:
    """`measured at 14:02, before the latest baseline` for a number from an earlier
    round (a Re-time measured other fixes since), or ''."""
    if not variant.measured_at or not report.baseline.measured_at:
        return ""
    if variant.measured_at >= report.baseline.measured_at:
        return ""
    return f"measured at {clock(variant.measured_at)}, before the latest baseline"


def factor(value: float) -> str:
    """`1.54x`; `0.997x` where two decimals would read 1.00x (slower, or faster, by a hair)."""
    two = f"{value:.2f}"
    return f"{value:.3f}x" if two == "1.00" and value != 1.0 else f"{two}x"


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


def code(report: Report) -> str:
    """What the report checked, as its lines name it: a script (`check SCRIPT`, whose
    report carries the program) or a cell."""
    return "script" if report.program else "cell"


def no_findings(report: Report) -> str:
    return f"No findings: nothing in this {code(report)} matches the tuning guide's checks."


def title(report: Report) -> str:
    """`%%perfcheck report`, or `perfcheck report: train.py` for a script."""
    return (
        f"perfcheck report: {report.program['script']}" if report.program else "%%perfcheck report"
    )


def speedup(report: Report, variant: Variant | None) -> str:
    """`1.54x (1.41x–1.66x over 9 rounds)`, `0.87x — measured slower here — not
    recommended`, `1.01x — no clear change`, `1.3x so far (still measuring)` while measuring,
    `measuring…`, or why not measured; sampled runs add the whole cell, projected."""
    if variant is not None and variant.fits:
        return FITS
    if variant is not None and variant.at_most is not None and variant.speedup is None:
        return too_small(variant.at_most)
    if variant is None or (variant.speedup is None and not variant.error):
        if variant is not None and variant.budget_to_tell_s:
            return f"not measured: {not_enough_time(variant)}"
        return MEASURING if report.measuring else "not measured"
    if variant.error:
        return f"failed: {variant.error}"
    assert variant.speedup is not None
    if variant.judged_by == "memory":
        return memory_first(report, variant)
    unit = f" (whole {code(report)})" if variant.judged_by == "whole cell" else per_step(report)
    text = f"{factor(variant.speedup)}{unit}"
    if report.measuring:
        text += f" {PROVISIONAL}"
    else:
        text += interval(variant)
        if variant.is_slower:
            text += f" — {SLOWER}"
        elif not variant.is_win:  # unsettled: no verdict yet, only what would give one
            text += f" — {not_enough_time(variant) or NO_CLEAR_CHANGE}"
    if variant.noisy:
        text += " (noisy)"
    extras = [
        not_enough_time(variant) if not report.measuring and variant.is_slower else "",
        projected(report, variant),
        one_time_cost(variant),
        measured_before(report, variant),
    ]
    return "; ".join([text, *(extra for extra in extras if extra)])


def segment(report: Report, finding: Finding) -> str:
    """The part of the time split the finding's fix acts on: `data wait (63% of the run)`,
    `data wait` where the run was not split, or '' where the finding names none."""
    name = dict(SPLIT_PARTS).get(finding.segment or "")
    if name is None:
        return ""
    shares = dict(split_shares(report))
    return f"{name} ({shares[name]:.0%} of the run)" if name in shares else name


def checked_heading(outcome: str) -> str:
    """`checked: slower here`: the heading of checks whose own trial measured this outcome."""
    return f"checked: {outcome}"


def by_reason(items: list[NotApplicable]) -> list[tuple[list[str], str]]:
    """The not-applicable checks, those with the same reason on one line (a CPU report's
    seven CUDA-only checks and five distributed ones read as two lines, not twelve), in
    the order their reasons first came."""
    grouped: dict[str, list[str]] = {}
    for item in items:
        grouped.setdefault(item.reason, []).append(item.id)
    return [(ids, reason) for reason, ids in grouped.items()]


def too_small(at_most: float) -> str:
    """Why a fix was not timed: its evidence cannot reach the no-change band."""
    return f"too small to matter here: its evidence allows at most {(at_most - 1):.1%} (not timed)"


def interval(variant: Variant) -> str:
    """` (1.41x–1.66x over 9 rounds)`: the speedup's 99.9% interval over paired rounds, or
    `(too few rounds for an interval)`, or '' for a report from before paired rounds."""
    if variant.rounds is None:
        return ""
    rounds = count(variant.rounds, "round")
    if variant.speedup_low is None or variant.speedup_high is None:
        return f" ({rounds}: too few for an interval)"
    return f" ({factor(variant.speedup_low)}–{factor(variant.speedup_high)} over {rounds})"


def not_enough_time(variant: Variant) -> str:
    """`not enough time to tell; --budget 60 would`, or '' when the budget sufficed."""
    if not variant.budget_to_tell_s:
        return ""
    return f"not enough time to tell; `--budget {variant.budget_to_tell_s:.0f}` would"


def combined_label(report: Report, variant: Variant) -> str:
    """What a row of several fixes is: the recommended fixes together, or the fixes named."""
    if report.recommended is not None and sorted(report.recommended) == sorted(variant.fixes):
        return f"recommended fixes together ({', '.join(variant.fixes)})"
    return f"fixes together ({', '.join(variant.fixes)})"


def edits_scope(report: Report) -> str:
    """What the notebook edits carry: the fixes applied, else the recommended ones."""
    if report.applied:
        return f"the fixes applied ({', '.join(report.applied)})"
    return (
        f"the recommended fixes ({', '.join(report.notebook_edits.fixes)})"
        if (report.notebook_edits)
        else "the recommended fixes"
    )


def current(report: Report, variant: Variant) -> bool:
    """Measured against the latest baseline (a Re-time since measured other fixes)."""
    return not measured_before(report, variant)


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
    if before is None or after is None or measured_before(report, variant):
        return ""  # (a number from an earlier round has no projection of this baseline)
    return f"whole {code(report)} {seconds(before)} → {seconds(after)} (projected)"


def one_time_cost(variant: Variant) -> str:
    """`13.8 s one-time (compile), pays back after 92 runs`, or ''."""
    if variant.one_time_s is None:
        return ""
    cause = variant.one_time_cause or "compile, worker start"
    text = f"{seconds(variant.one_time_s)} one-time ({cause})"
    if variant.break_even_runs is not None:
        text += f", pays back after {count(variant.break_even_runs, 'run')}"
    return text


def memory_delta(report: Report, variant: Variant | None) -> float | None:
    """Peak memory's change from the baseline as a share (-0.76: 76% less), or None."""
    if variant is None or variant.error or variant.peak_memory_bytes is None:
        return None
    base = report.baseline.peak_memory_bytes
    return variant.peak_memory_bytes / base - 1 if base else None


def memory_tone(report: Report, variant: Variant | None) -> str:
    """`good` (less memory), `bad` (more) or `neutral`: the colour of memory_change."""
    delta = memory_delta(report, variant)
    if delta is None or abs(delta) < MEMORY_SAME:
        return "neutral"
    return "good" if delta < 0 else "bad"


def memory_badge(report: Report, variant: Variant | None) -> str:
    """`−76% memory`, `+28% memory`, `same memory`, or '' where not measured."""
    if variant is None or variant.error or variant.peak_memory_bytes is None:
        return ""
    delta = memory_delta(report, variant)
    if delta is None:
        return f"{size(variant.peak_memory_bytes)} peak"
    if abs(delta) < MEMORY_SAME:
        return "same memory"
    return f"{'−' if delta < 0 else '+'}{abs(delta):.0%} memory"


def memory_change(report: Report, variant: Variant | None) -> str:
    """`−76% memory (288.0 MiB → 69.1 MiB)`: the sign says good (−) or bad (+)."""
    badge = memory_badge(report, variant)
    base = report.baseline.peak_memory_bytes
    if not badge or variant is None or not base:
        return badge
    return f"{badge} ({size(base)} → {size(variant.peak_memory_bytes)})"


def numerics(variant: Variant | None) -> str:
    """`identical`, `close (max rel diff 3.27e-07)`, `changed (…)`; where the results were
    not compared, why in words (`results not compared: the cell bound no tensors …`), or
    that they are not yet."""
    if variant is None or variant.error:
        return ""
    n = variant.numerics
    if n.verdict == "changed" and n.max_rel_diff is not None:
        return f"changed (max rel diff {n.max_rel_diff:.2e})"
    if n.verdict == "close" and n.max_rel_diff is not None:
        return f"close (max rel diff {n.max_rel_diff:.2e})"
    if n.verdict == "not-compared":
        why = (n.detail or "").removeprefix("not compared: ")
        return f"results not compared: {why}" if why else NOT_COMPARED
    return n.verdict


def _percent(share: float) -> str:
    """0.001 → `0.1 %`, 0.016 → `1.6 %`, 2.3e-05 → `0.0023 %`."""
    return f"{share * 100:.2g} %"


def loss(variant: Variant | None) -> str:
    """A training cell's loss curve against the baseline's: `same loss: within 0.1 % of
    the baseline's over 28 steps (max rel diff 3.27e-07); final 2.301 → 2.301`, `loss
    changed: up to 4.2 % off the baseline's over 28 steps (tolerance 1.6 %); final 2.301 →
    2.401`, or '' where no loss was compared."""
    if variant is None or variant.error or variant.numerics.loss_verdict is None:
        return ""
    n = variant.numerics
    steps = f"over {n.loss_steps} step{'' if n.loss_steps == 1 else 's'}"
    first, last = _final(n.loss_baseline), _final(n.loss_fix)
    diff, tolerance = n.loss_max_rel_diff, _percent(n.loss_tolerance or 0.0)
    if n.loss_verdict != "same loss":
        # NaN or inf at a step where the other curve is finite: no difference to give
        off = "not finite where the baseline's is, or finite where it is not,"
        if diff is not None:
            off = f"up to {_percent(diff)} off the baseline's"
        return f"{n.loss_verdict}: {off} {steps} (tolerance {tolerance}); final {first} → {last}"
    if not diff:
        return f"{n.loss_verdict}: identical {steps}; final {first}"
    return (
        f"{n.loss_verdict}: within {tolerance} of the baseline's {steps} "
        f"(max rel diff {diff:.2e}); final {first} → {last}"
    )


def _final(curve: list[float | None] | None) -> str:
    """A curve's last loss, `2.301`."""
    value = curve[-1] if curve else None
    return "not finite" if value is None else f"{value:.4g}"


def loss_curves_differ(variant: Variant | None) -> bool:
    """Whether the two loss curves are worth drawing: compared, and not bit-identical."""
    return bool(
        variant
        and not variant.error
        and variant.numerics.loss_max_rel_diff != 0.0
        and variant.numerics.loss_baseline
        and variant.numerics.loss_fix
    )


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


def distributed_line(report: Report) -> str:
    """`torchrun: 2 ranks (gloo, 1 node), times are the slowest rank's; each rank's own
    baseline: rank 0 (vm) 217 ms (41% in all-reduce), rank 1 (vm) 216 ms (3% in
    all-reduce)`, or '' outside torchrun."""
    job = report.distributed
    if job is None:
        return ""
    nodes = f"{job.nodes} node" + ("" if job.nodes == 1 else "s")
    line = (
        f"torchrun: {job.world_size} ranks ({job.backend}, {nodes}), times are the slowest rank's"
    )
    own = [
        f"rank {r.rank} ({r.host}) {seconds(r.baseline_s)}"
        + (f" ({r.collective_share:.0%} in all-reduce)" if r.collective_share is not None else "")
        for r in job.ranks
        if r.baseline_s is not None
    ]
    return line + (
        f"; each rank's own baseline{per_step(report)}: " + ", ".join(own) if own else ""
    )


# the parts of a run's time split (`measuring/time_split.py`), in order, as a user reads them
SPLIT_PARTS = (
    ("data_wait", "data wait"),
    ("forward", "forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
    ("host_sync", "host syncs"),
    ("other", "other"),
)


def split_shares(report: Report) -> list[tuple[str, float]]:
    """(part, share of the run) for each part of the time split with a share of at least
    half a percent, in order; [] without a split."""
    split = report.time_split
    if not split:
        return []
    total = sum(split.values())
    if total <= 0:
        return []
    shares = [(name, split.get(key, 0.0) / total) for key, name in SPLIT_PARTS]
    return [(name, share) for name, share in shares if share >= 0.005]


def split_line(report: Report) -> str:
    """`where the time went: data wait 63% · forward 14% · backward 15% · other 8%`."""
    shares = split_shares(report)
    if not shares:
        return ""
    parts = " · ".join(f"{name} {share:.0%}" for name, share in shares)
    return f"where the time went (the baseline's first run): {parts}"


def load_line(report: Report) -> str:
    """`other processes kept 0.97 of this kernel's 2 CPUs busy while it measured`, or ''
    when they were (nearly) idle."""
    load = report.load
    if load is None or load.window_s < LOAD_WINDOW_MIN_S or load.busy_cpus < BUSY_CPUS:
        return ""
    return (
        f"other processes kept {load.busy_cpus:.2f} of this kernel's {load.cpus} CPUs busy "
        f"while it measured ({load.other_cpu_s:.1f} CPU-s in {load.window_s:.1f} s)"
    )


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
        f"; whole {code(report)} {seconds(b.projected_cell_s)} (projected)"
        if b.projected_cell_s is not None
        else ""
    )
    spread = f" ± {seconds(b.iqr_s)} IQR" if b.runs > 1 else ""  # one run has no spread
    return (
        f"baseline {seconds(b.median_s)}{per_step(report)}{spread} over "
        f"{count(b.runs, 'run')}{noisy}, peak memory {size(b.peak_memory_bytes)}{compute}{whole} — "
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
    restart = ""
    if sampled.steps_per_epoch:
        cut = (
            f" (each run's first epoch ended after {unit} {sampled.epoch_end_step} to hold one)"
            if sampled.epoch_end_step
            else ""
        )
        restart = (
            f"; an epoch restart in the timed {plural(unit)} counts once per "
            f"{sampled.steps_per_epoch}{cut}"
        )
    return (
        f"sampled: every measuring run stopped after {unit} {last}{of}{detail}, "
        + (
            f"{plural(unit)} {first}–{last} timed after {sampled.warmup_steps} warm-up"
            if sampled.warmup_steps
            else "the first epoch timed whole"
        )
        + f"{restart}; times are per {unit}, the whole {code(report)} projected"
    )


def oom_line(report: Report) -> str:
    """`ran out of memory at cell line 3: asked for 4.0 TiB with 1.2 GiB in use …`, or ''."""
    oom = report.oom
    if oom is None:
        return ""
    where = f" at {'cell ' if code(report) == 'cell' else ''}line {oom.line}" if oom.line else ""
    asked = f", asking for {size(oom.requested_bytes)}" if oom.requested_bytes else ""
    in_use = (
        f" with {size(oom.in_use_bytes)} in use ({oom.in_use_measure})" if oom.in_use_bytes else ""
    )
    return (
        f"the {code(report)} ran out of memory{where}{asked}{in_use}: {oom.error.rstrip('.')}. "
        "Nothing was timed "
        "against a baseline; the findings below come from the run up to the failure, memory "
        f"fixes first{_fit_outcome(report)}"
    )


def _fit_outcome(report: Report) -> str:
    """What the runs with memory fixes showed after an out-of-memory probe, or ''."""
    tried = [v for v in report.latest_variants() if v.fits is not None]
    fitting = [v for v in tried if v.fits]
    if fitting:
        runs = [
            " + ".join(v.fixes)
            + (f" ({size(v.peak_memory_bytes)} peak)" if v.peak_memory_bytes else "")
            for v in fitting
        ]
        return f"; it fits with {', or with '.join(runs)}"
    return "; with each memory fix tried it ran out of memory again" if tried else ""


def cell_run_line(report: Report) -> str:
    """What became of the cell's one complete run (the kernel contract), or ''."""
    run = report.cell_run
    if run is None or report.oom is not None:
        return ""
    unit = report.sampling.unit if report.sampling else "step"
    with_fixes = f", with {', '.join(run.fixes)}" if run.fixes else ""
    checked = code(report)
    if run.status == "probe":
        after = (
            "its output and files are that run's"
            if report.program
            else "the kernel is as after that run"
        )
        return f"the {checked} ran once, complete, in the probe: {after}"
    if run.status == "running":
        return f"finishing the {checked}: its one complete run{with_fixes}…"
    if run.status == "skipped":
        return "--no-finish: the cell's complete run was skipped; the kernel is as before the cell"
    done = count(run.steps, unit, plural(unit)) if run.steps is not None else ""
    took = ", ".join(part for part in (seconds(run.seconds), done) if part)
    if run.status == "complete":
        return f"the {checked}'s complete run: {took}{with_fixes}"
    if run.status == "interrupted":
        return f"the {checked}'s complete run was interrupted (Ctrl-C) after {took}{with_fixes}"
    return f"the {checked}'s complete run failed after {took}{with_fixes}: {run.detail or ''}"


def phase_line(report: Report) -> str:
    if report.phase == "measuring":
        return "measuring… numbers fill in as each configuration is measured"
    if report.phase == "interrupted":
        return "interrupted (Ctrl-C) before every number was in"
    if report.phase == "finishing":
        return f"every number is in; the {code(report)}'s complete run is under way"
    return ""


OWN_FAILURES = "perfcheck's own failures (your cell ran as it would without perfcheck)"


def own_failure_line(failure: OwnFailure) -> str:
    """One perfcheck failure in a line: which part, and why (the traceback folds away)."""
    return f"{failure.part} failed: {failure.reason}; the rest of this report stands"
