"""Verdicts from paired rounds: an interval over the rounds' ratios decides, never a point."""

from __future__ import annotations

import pytest

from torchtune_magic.engine import verdict
from torchtune_magic.engine.verdict import Speedup


def test_the_interval_comes_from_order_statistics_with_at_least_99_8_percent_coverage():
    assert verdict.min_rounds() == 10  # 2 x (1/2)^10 = 0.2%
    assert verdict.rank_for(9) is None
    assert verdict.rank_for(10) == 1  # the smallest and the largest ratio
    assert verdict.rank_for(14) == 2
    assert verdict.rank_for(7, 0.98) == 1  # at 98%, seven rounds would do


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([1.3, 1.25, 1.4, 1.28, 1.31, 1.35, 1.27, 1.3, 1.29, 1.33], "faster"),
        ([0.7, 0.72, 0.69, 0.75, 0.71, 0.7, 0.73, 0.72, 0.7, 0.74], "slower"),
        # one round stalled by another process: one rank, not its size
        ([1.3, 1.25, 1.4, 1.28, 1.31, 1.35, 0.2, 1.29, 1.3, 1.33, 1.3, 1.32, 1.28, 1.3], "faster"),
        ([1.01, 1.02, 1.015, 1.012, 1.018, 1.011, 1.016, 1.013, 1.017, 1.014], "no clear change"),
        ([1.2, 0.8, 1.1, 0.9, 1.3, 0.7, 1.05, 0.95, 1.15, 0.85], "no clear change"),  # straddles
        ([0.5, 0.6, 0.55, 0.52, 0.58, 0.51, 0.56], "no clear change"),  # too few rounds
    ],
)
def test_the_verdict_reads_the_interval(ratios: list[float], expected: str):
    assert Speedup.of(ratios).verdict == expected


def test_an_interval_straddling_one_is_never_slower_and_asks_for_more_rounds():
    wide = Speedup.of([0.6, 1.1, 0.7, 1.05, 0.65, 0.75, 0.8, 0.72, 0.68, 0.74])  # high 1.1
    assert wide.median < 0.8 and wide.verdict == "no clear change"
    assert not wide.settled and wide.rounds_to_settle() > wide.rounds
    tight = Speedup.of([0.99, 1.01, 1.0, 1.02, 0.98, 1.0, 1.01, 0.99, 1.0, 1.01])
    assert tight.verdict == "no clear change" and tight.settled  # nothing worth having hides
    assert tight.rounds_to_settle() is None


def test_the_budget_that_would_tell_grows_with_the_rounds_it_needs():
    wide = Speedup.of([0.8, 1.2, 0.9, 1.15, 0.85, 1.1, 1.0, 0.95, 1.05, 0.9])
    wanted = verdict.budget_to_tell([wide], budget_s=20, spent_on_rounds_s=14, fixed_s=6)
    assert wanted is not None and wanted >= 25 and wanted % 5 == 0
    settled = Speedup.of([2.0] * 10)
    assert verdict.budget_to_tell([settled], 20, 14, 6) is None
