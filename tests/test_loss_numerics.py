"""The loss as the judge of "same results": a training cell's loss per step, recorded on
each fix's first run from the restored start, compared with the baseline's over the same
steps, in the report (JSON, text, HTML) and in what `--apply all` carries."""

from __future__ import annotations

import itertools
import math
from typing import Any

import jsonschema
import pytest
import torch
from torch.utils.checkpoint import checkpoint
from workloads import namespace_with

from torchtune_magic.cell.workload import Workload
from torchtune_magic.checks import precision
from torchtune_magic.kernel import applied
from torchtune_magic.measuring import losses, numerics
from torchtune_magic.options import Options
from torchtune_magic.probe import cpu
from torchtune_magic.render import html, summary, text
from torchtune_magic.report import FASTER, Numerics, Report, Variant, load_schema
from torchtune_magic.session import Session

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Flatten(), nn.Linear(16 * 12 * 12, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.005)
X, Y = torch.randn(16, 3, 12, 12), torch.randint(0, 10, (16,))
"""
CHECKED = "amp,channels-last,conv-bias-bn"
CELL = """
for step in range(30):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(X), Y)
    loss.backward()
    opt.step()
"""


@pytest.fixture(scope="module")
def report() -> Report:
    """The CNN cell checked once. amp applies to this small CNN: a CPU with AVX512-BF16
    (this box has it; torch emulates bf16 elsewhere) and no floor on the matmul share or
    size, which decide whether amp pays off on a CPU, not what it does to the loss."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
        patch.setattr(precision, "CPU_MIN_MATH_SHARE", 0.0)
        patch.setattr(precision, "CPU_MIN_CALL_FLOPS", 0.0)
        ns = namespace_with(SETUP)
        session = Session(Workload(CELL, ns), Options.build(checks=CHECKED, budget=6))
        report = session.run()
        # what this file judges is the loss comparison, not the plan: a fix the plan left
        # without a timed round (a loaded 2-core box can leave budget 6 short, or read a
        # bound below the no-change band) is timed as the panel's Re-time of it would
        untimed = [
            [f.id] for f in report.findings if f.fixable and f.id not in _measured_ids(report)
        ]
        return session.measure(untimed, budget_s=6) if untimed else report


def _measured_ids(report: Report) -> set[str]:
    return {"+".join(v.fixes) for v in _measured(report)}


def _measured(report: Report) -> list[Variant]:
    """The variants whose first run from the restored start was compared with the
    baseline's (on a busy machine the budget may leave a fix without a timed round)."""
    return [
        v
        for v in report.latest_variants()
        if v.error is None and v.numerics.verdict != "not-compared"
    ]


# through the API, real torch -------------------------------------------------------------
def test_each_fix_of_a_cnn_training_cell_is_judged_by_its_loss_curve(report: Report) -> None:
    measured = {"+".join(v.fixes): v for v in _measured(report)}
    assert {"amp", "channels-last", "conv-bias-bn"} <= set(measured)
    for label, variant in measured.items():
        n = variant.numerics
        assert n.loss_verdict in (losses.SAME, losses.CHANGED), label
        assert n.loss_steps is not None and n.loss_steps >= 3
        assert n.loss_baseline is not None and n.loss_fix is not None
        assert len(n.loss_baseline) == len(n.loss_fix) == min(n.loss_steps, losses.MAX_POINTS)
        assert 1.0 < n.loss_baseline[0] < 4.0  # cross-entropy over 10 classes, ~ln 10
    # float32 summed in another order: the parameters' last bits move, the loss does not
    for label in ("channels-last", "conv-bias-bn"):
        n = measured[label].numerics
        assert n.loss_verdict == losses.SAME, n
        assert n.loss_tolerance == losses.LOSS_TOLERANCE
    # bfloat16 autocast: judged by amp's own looser tolerance
    assert measured["amp"].numerics.loss_tolerance == precision.AMP_TOLERANCE
    assert measured["amp"].numerics.loss_max_rel_diff > 0


def test_the_loss_comparison_is_in_the_json_text_and_html(report: Report) -> None:
    data = report.to_dict()
    jsonschema.validate(data, load_schema())
    for variant in data["variants"]:
        if variant["error"] is None and variant["numerics"]["verdict"] != "not-compared":
            assert variant["numerics"]["loss_verdict"] in (losses.SAME, losses.CHANGED)
    again = Report.from_dict(data)
    assert [v.numerics for v in again.variants] == [v.numerics for v in report.variants]
    rendered_text, rendered_html = text.render(report), html.render(report)
    for finding in report.findings:
        variant = summary.solo_variant(report, finding)
        if variant not in _measured(report):
            continue
        words = summary.loss(variant)
        assert words.startswith(variant.numerics.loss_verdict)
        assert f"over {variant.numerics.loss_steps} steps" in words
        if not summary.no_gain(report, finding):  # the text's no-gain list: one line each
            assert f"loss:     {words}" in rendered_text
        if variant.speedup is not None:  # the HTML's results column: timed variants
            assert html._e(words) in rendered_html
    drawn = [v for v in _measured(report) if v.speedup is not None]
    curves = rendered_html.count('<svg class="ttm-loss-curves"')
    assert curves == sum(summary.loss_curves_differ(v) for v in drawn if len(v.fixes) == 1)
    assert summary.loss_curves_differ(report.variant_for(["amp"]))  # bfloat16 moves it


def test_a_fix_that_keeps_the_loss_counts_as_same_results(report: Report) -> None:
    variant = report.variant_for(["channels-last"])
    assert variant.numerics.same_results  # whatever its parameters' verdict
    fixable = [f.id for f in report.findings if f.fixable]
    chosen = applied.recommended(fixable, report.variants)
    assert set(chosen) == {
        v.fixes[0] for v in applied.solo_variants(fixable, report.variants) if v.is_win
    }


# what `--apply all` carries -----------------------------------------------------------------
def _won(fix: str, n: Numerics) -> Variant:
    """A variant measured clearly faster (2x, its whole interval above 1)."""
    return Variant(
        fixes=[fix],
        median_s=0.5,
        iqr_s=0.01,
        runs=8,
        speedup=2.0,
        peak_memory_bytes=None,
        numerics=n,
        one_time_s=None,
        speedup_low=1.8,
        speedup_high=2.2,
        verdict=FASTER,
    )


def test_a_fix_that_changes_the_loss_is_never_recommended_however_fast() -> None:
    base = [2.3 - 0.02 * i for i in range(30)]
    off = [v * 1.05 for v in base]  # 5 % above the baseline's at every step
    changed = numerics.with_losses(
        Numerics("close", 1e-6), base, off, fix_tolerance=precision.AMP_TOLERANCE
    )
    assert changed.loss_verdict == losses.CHANGED
    assert changed.loss_max_rel_diff == pytest.approx(0.05 / 1.05)
    kept = numerics.with_losses(Numerics("changed", 0.04), base, base, fix_tolerance=0.0)
    assert kept.loss_verdict == losses.SAME
    variants = [_won("amp", changed), _won("channels-last", kept), _won("tf32", Numerics("close"))]
    fixable = ["amp", "channels-last", "tf32"]
    assert applied.recommended(fixable, variants) == ["channels-last", "tf32"]
    assert applied.requested(["all"], fixable, variants) == ["channels-last", "tf32"]
    assert applied.requested(["amp"], fixable, variants) == ["amp"]  # by name: the user's call
    assert "loss changed: up to 4.8 % off the baseline's over 30 steps" in summary.loss(variants[0])


# the curve comparison -------------------------------------------------------------------
def test_curves_are_compared_step_by_step_with_the_fix_s_looser_tolerance() -> None:
    base = [2.0, 1.5, 1.0]
    assert losses.compare(base, base, 0.0) == losses.Comparison(
        losses.SAME, 0.0, 3, losses.LOSS_TOLERANCE
    )
    near = [2.0, 1.5, 1.0 * (1 + 5e-4)]
    assert losses.compare(base, near, 0.0).verdict == losses.SAME
    far = [2.0, 1.5, 1.0 * (1 + 5e-3)]
    assert losses.compare(base, far, 0.0).verdict == losses.CHANGED
    assert losses.compare(base, far, precision.TF32_TOLERANCE).verdict == losses.SAME
    assert losses.compare(base, far, precision.AMP_TOLERANCE).tolerance == precision.AMP_TOLERANCE


def test_a_nondeterministic_baseline_widens_the_tolerance_to_twice_its_own_drift() -> None:
    base = [2.0, 1.5, 1.0]
    fixed = [2.0, 1.5, 1.01]  # 1 % off
    assert losses.compare(base, fixed, 0.0).verdict == losses.CHANGED
    assert losses.compare(base, fixed, 0.0, noise=0.004).verdict == losses.CHANGED
    calibrated = losses.compare(base, fixed, 0.0, noise=0.006)
    assert calibrated.verdict == losses.SAME and calibrated.tolerance == pytest.approx(0.012)


def test_a_changed_loss_is_judged_again_against_the_baseline_s_own_repeat() -> None:
    base, again = [2.0, 1.5, 1.0], [2.0, 1.5, 1.006]  # the cell differs from itself 0.6 %
    within, beyond = [2.0, 1.5, 1.01], [2.0, 1.5, 1.02]
    for fixed, verdict in ((within, losses.SAME), (beyond, losses.CHANGED)):
        first = numerics.with_losses(Numerics("changed", 0.01), base, fixed, 0.0)
        assert first.loss_verdict == losses.CHANGED
        judged = numerics.rejudged(first, base, fixed, again)
        assert judged.loss_verdict == verdict
        assert judged.loss_tolerance == pytest.approx(2 * 0.006 / 1.006)
        assert "the cell itself is not deterministic" in judged.detail
    steady = numerics.with_losses(Numerics(), base, beyond, 0.0)
    assert numerics.rejudged(steady, base, beyond, base) == steady  # it repeats: as it was


def test_a_loss_falling_to_zero_is_judged_on_the_scale_it_started_on() -> None:
    base = [2.0, 0.1, 1e-9]
    assert losses.compare(base, [2.0, 0.1, 2e-9], 0.0).verdict == losses.SAME
    assert losses.compare(base, [2.0, 0.1, 0.01], 0.0).verdict == losses.CHANGED


def test_curves_of_different_lengths_are_compared_over_the_steps_both_ran() -> None:
    compared = losses.compare([2.0, 1.5, 1.0, 0.9], [2.0, 1.5], 0.0)
    assert compared.steps == 2 and compared.verdict == losses.SAME
    assert "called backward 2 times, the baseline's 4" in compared.note
    n = numerics.with_losses(Numerics("identical", 0.0), [2.0, 1.5, 1.0, 0.9], [2.0, 1.5], 0.0)
    assert n.loss_baseline == [2.0, 1.5] and n.loss_fix == [2.0, 1.5] and n.loss_steps == 2
    assert "called backward" in n.detail
    assert losses.compare([], [2.0], 0.0) is None  # no backward: not a training cell
    assert numerics.with_losses(Numerics("identical", 0.0), [], [], 0.0) == Numerics(
        "identical", 0.0
    )


def test_a_loss_that_is_not_finite_where_the_baseline_s_is_has_changed() -> None:
    nan = float("nan")
    assert losses.compare([2.0, nan], [2.0, nan], 0.0).verdict == losses.SAME
    compared = losses.compare([2.0, 1.0], [2.0, nan], 0.0)
    assert compared.verdict == losses.CHANGED and math.isinf(compared.max_rel_diff)
    n = numerics.with_losses(Numerics(), [2.0, 1.0], [2.0, nan], 0.0)
    assert n.loss_max_rel_diff is None and n.loss_fix == [2.0, None]  # JSON has no NaN
    assert "not finite" in summary.loss(Variant(fixes=["x"], numerics=n))


def test_curves_in_the_report_are_downsampled_evenly_keeping_both_ends() -> None:
    curve = [float(i) for i in range(1000)]
    points = losses.downsampled(curve)
    assert len(points) == losses.MAX_POINTS
    assert points[0] == 0.0 and points[-1] == 999.0
    gaps = {round(b - a) for a, b in itertools.pairwise(points)}
    assert gaps <= {5, 6}  # evenly spread
    assert losses.downsampled([1.0, 2.0]) == [1.0, 2.0]
    assert losses.downsampled([1 / 3]) == [0.3333333]
    n = numerics.with_losses(Numerics(), curve, curve, 0.0)
    assert n.loss_steps == 1000 and len(n.loss_baseline) == losses.MAX_POINTS


# the recording --------------------------------------------------------------------------
def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def test_the_recorder_keeps_each_backward_s_loss_once_and_restores_backward_exactly() -> None:
    tensor_backward, autograd_backward = torch.Tensor.backward, torch.autograd.backward
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    recorder = losses.Recorder()
    with recorder.recording():
        first = _step(model, x)
        torch.autograd.backward(model(x).sum())  # the function form counts too
        inner = x.clone().requires_grad_()
        checkpoint(model, inner, use_reentrant=True).sum().backward()  # not its inner one
        model(x).backward(torch.ones(8, 1))  # not a scalar loss: not a step of the curve
    assert torch.Tensor.backward is tensor_backward
    assert torch.autograd.backward is autograd_backward
    curve = recorder.curve()
    assert len(curve) == 3 and curve[0] == pytest.approx(float(first.detach()))


def test_a_fix_scaling_the_loss_inside_is_recorded_unscaled() -> None:
    """amp's GradScaler patches `Tensor.backward` in the fix's run context: the recorder is
    entered inside it, so the loss kept is the cell's own."""
    original = torch.Tensor.backward

    def scaled(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return original(loss * 65536.0, *args, **kwargs)

    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    recorder = losses.Recorder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "backward", scaled)
        with losses.recorded(torch.autograd.set_grad_enabled(True), recorder):
            loss = _step(model, x)
    assert recorder.curve() == [pytest.approx(float(loss.detach()))]


# old reports ----------------------------------------------------------------------------
def test_a_report_without_loss_fields_still_loads_validates_and_renders(report: Report) -> None:
    data = report.to_dict()
    for variant in data["variants"]:
        for key in list(variant["numerics"]):
            if key.startswith("loss_"):
                del variant["numerics"][key]
    jsonschema.validate(data, load_schema())
    old = Report.from_dict(data)
    assert all(v.numerics.loss_verdict is None for v in old.variants)
    assert "loss:" not in text.render(old)
    assert "ttm-loss-curves" not in html.render(old)
    assert old.to_dict() == data  # None loss fields are dropped as other optional ones
