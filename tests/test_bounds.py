"""Bounds from evidence (issue 30): fixes that only save passes over memory are bounded by
what those passes cost here, so a fix that cannot pass the no-change band is not timed,
while one that can still is; and short epochs are sampled whole."""

from __future__ import annotations

from workloads import detected, namespace_with

from torchtune_magic.checks import bounds
from torchtune_magic.measuring import plan as plans
from torchtune_magic.probe import steps

SMALL_CNN = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 3, 16, 16)
y = torch.randint(0, 10, (32,))
"""
TRAIN = """
for _ in range(6):
    opt.zero_grad(set_to_none=False)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""
# a wide MLP whose step is a few small matmuls: zeroing 8 M grads in place is a real share
WIDE = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 2048)
"""
WIDE_TRAIN = """
for _ in range(6):
    opt.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    opt.step()
"""


def _bound(cell: str, setup: str, check_id: str) -> float | None:
    session = detected(cell, namespace_with(setup), checks=check_id, budget=5)
    [detection] = [d for d in session.detections if d.finding.id == check_id]
    assert detection.fix is not None
    return detection.fix.most_gain


def test_passes_scale_with_their_count_and_size():
    one = bounds.passes_s(1 << 20, 1)
    assert one > 0
    assert bounds.passes_s(1 << 20, 0) == 0.0 and bounds.passes_s(0, 4) == 0.0
    # counted, not re-timed per pass: ten passes are ten times one, within timing noise
    assert 3 * one < bounds.passes_s(1 << 20, 10) < 30 * one


def test_the_share_leans_towards_the_fix():
    # 1 ms saved of a probe run of 1 s: the run taken as 0.25 s, the saving doubled
    assert bounds.share_of_run(0.001, 1.0) == 0.008
    assert bounds.share_of_run(1.0, 1.0) == 1.0
    assert bounds.share_of_run(0.001, 0.0) is None


def test_a_small_cnns_conv_bias_is_bounded_by_its_passes():
    """Six steps of convs alone (no loader to wait for): the bias passes are a few percent
    of the run at most; bounded, and timed where that bound passes the band (the CNN cell
    of test_default_budget, whose loader waits, is not)."""
    bound = _bound(TRAIN, SMALL_CNN, "conv-bias-bn")
    assert bound is not None and 1.0 < bound < 1.25, bound


def test_zeroing_many_grads_around_a_cheap_step_is_still_timed():
    """8 M grads filled and read each step, around two batch-2 matmuls: the bound is far
    past the band (or none: the passes may be the whole run), so the fix is measured."""
    bound = _bound(WIDE_TRAIN, WIDE, "zero-grad-none")
    assert bound is None or bound > 1.2, bound


def test_short_epochs_are_sampled_whole():
    sampled = plans._epoch_sampled(8, 16)
    assert sampled is not None and sampled.whole_epoch
    assert (sampled.warmup, sampled.stop) == (0, 8)
    assert sampled.per_epoch is None  # no restart to split off: the epoch is timed whole
    assert plans._epoch_sampled(16, 16) is None  # one epoch: nothing to cut
    assert plans._epoch_sampled(None, 16) is None
    # the first epoch is the sample: calibrating does not move its stop
    plan = plans.MeasuringPlan(
        configurations=((), ("x",)),
        combine=False,
        too_small=(),
        sampled=sampled,
        calibrated=False,
        deadline_s=10.0,
        deadline_start=0.0,
        profiled_most_s=1.0,
        memory_profiled_most_s=1.0,
    )
    calibrated = plans.calibrated(plan, 16, 0.01, 0.05, 100.0)
    assert calibrated.calibrated and calibrated.sampled == sampled
    assert steps.SamplePlan(None, 0, 8).timed == 8  # type: ignore[arg-type]
