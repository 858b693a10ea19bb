"""Verdicts from paired rounds: an interval over the rounds' ratios decides, never a point."""

from __future__ import annotations

import time

import pytest
from busy_process import other_busy_process

from torchtune_magic.measuring import timing, verdict
from torchtune_magic.measuring.verdict import Speedup

NO_CHANGE, FAST = "no clear change", "faster"


def test_the_interval_comes_from_order_statistics_with_at_least_99_9_percent_coverage():
    assert verdict.min_rounds() == 11  # 2 x (1/2)^11 = 0.1%
    assert verdict.rank_for(10) is None
    assert verdict.rank_for(11) == 1  # the smallest and the largest ratio
    assert verdict.rank_for(15) == 2
    assert verdict.rank_for(7, 0.98) == 1  # at 98%, seven rounds would do


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([1.3, 1.25, 1.4, 1.28, 1.31, 1.35, 1.27, 1.3, 1.29, 1.33, 1.3], "faster"),
        ([0.7, 0.72, 0.69, 0.75, 0.71, 0.7, 0.73, 0.72, 0.7, 0.74, 0.71], "slower"),
        # one round stalled by another process: one rank, not its size
        ([1.3, 1.25, 1.4, 1.28, 1.31, 1.35, 0.2, 1.29, 1.3, 1.33, 1.3, 1.32, 1.28, 1.3, 1.3], FAST),
        ([1.01, 1.02, 1.015, 1.012, 1.018, 1.011, 1.016, 1.013, 1.017, 1.014, 1.01], NO_CHANGE),
        ([1.2, 0.8, 1.1, 0.9, 1.3, 0.7, 1.05, 0.95, 1.15, 0.85], "no clear change"),  # straddles
        ([0.5, 0.6, 0.55, 0.52, 0.58, 0.51, 0.56], "no clear change"),  # too few rounds
    ],
)
def test_the_verdict_reads_the_interval(ratios: list[float], expected: str):
    assert Speedup.of(ratios).verdict == expected


def test_an_interval_straddling_one_is_never_slower_and_asks_for_more_rounds():
    wide = Speedup.of([0.6, 1.1, 0.7, 1.05, 0.65, 0.75, 0.8, 0.72, 0.68, 0.74, 0.7])  # high 1.1
    assert wide.median < 0.8 and wide.verdict == "no clear change"
    assert not wide.settled and wide.rounds_to_settle() > wide.rounds
    tight = Speedup.of([0.99, 1.01, 1.0, 1.02, 0.98, 1.0, 1.01, 0.99, 1.0, 1.01, 1.0])
    assert tight.verdict == "no clear change" and tight.settled  # nothing worth having hides
    assert tight.rounds_to_settle() is None


def test_the_budget_that_would_tell_grows_with_the_rounds_it_needs():
    wide = Speedup.of([0.8, 1.2, 0.9, 1.15, 0.85, 1.1, 1.0, 0.95, 1.05, 0.9, 1.0])
    wanted = verdict.budget_to_tell([wide], budget_s=20, spent_on_rounds_s=14, fixed_s=6)
    assert wanted is not None and wanted >= 25 and wanted % 5 == 0
    settled = Speedup.of([2.0] * 11)
    assert verdict.budget_to_tell([settled], 20, 14, 6) is None


def test_a_large_effect_against_quiet_noise_is_called_in_three_rounds():
    quiet = [1.01, 0.99, 1.02]  # the rounds' A/A ratios: the baseline against itself
    speedup = Speedup.of([3.0, 3.1, 2.9], quiet)
    assert speedup.verdict == "faster" and speedup.settled and speedup.rounds == 3
    assert speedup.low is not None and 2.5 < speedup.low < 3.0 < speedup.high < 3.5
    slower = Speedup.of([0.33, 0.31, 0.35], quiet)
    assert slower.verdict == "slower" and slower.settled


def test_the_same_ratios_wait_for_more_rounds_where_the_machine_is_noisy():
    noisy = [1.4, 0.6, 2.1]  # another process beside the kernel: A/A ratios spread widely
    speedup = Speedup.of([1.3, 1.28, 1.33], noisy)
    assert speedup.verdict == "no clear change" and not speedup.settled


def test_a_stall_in_one_round_leaves_it_to_the_interval():
    noise = [1.05, 0.95, 1.1, 1.02, 0.97, 1.08, 1.01, 0.99]
    ratios = [2.5, 2.4, 0.9, 2.6, 2.7, 2.3, 2.5, 2.2]  # one round's fix run stalled
    speedup = Speedup.of(ratios, noise)
    assert speedup.by == "rounds" and not speedup.has_interval  # no separation, 8 rounds
    more = [*ratios, 2.4, 2.6, 2.5, 2.4, 2.6, 2.5, 2.3]  # 15 rounds: the interval drops one
    assert Speedup.of(more, [*noise, 1.0, 1.03, 0.98, 1.0, 1.01, 0.99, 1.02]).verdict == "faster"


def test_the_chance_of_a_complete_separation():
    # every fix ratio beyond every A/A ratio on one side: 2^-n / C(n + m, n)
    assert verdict.separation_chance(3, 3) == pytest.approx(1 / 160)
    assert verdict.separation_chance(5, 5) == pytest.approx(1 / 252 / 32)
    assert verdict.separation_chance(5, 5) <= verdict.SEPARATED_ALPHA < (
        verdict.separation_chance(4, 4)
    )


def test_a_fix_within_the_band_on_a_quiet_machine_settles_no_clear_change_early():
    speedup = Speedup.of([1.01, 0.99, 1.02, 1.0, 0.98], [1.01, 0.99, 1.0, 1.02, 0.99])
    assert speedup.by == "quiet" and speedup.settled and speedup.verdict == "no clear change"


def test_the_intervals_rank_moves_up_only_at_its_looks():
    """Between two looks the rank is held (a wider interval than the rounds alone allow),
    so a sequence read after every round risks a false verdict only once per look."""
    assert verdict.looks()[:5] == [11, 13, 15, 17, 20]
    assert verdict.rank_for(19) == 3 and verdict.interval_rank(19) == verdict.rank_for(17) == 2
    ratios = [0.9, 0.95, *[1.3] * 17]  # two rounds below 1: the third smallest is above
    assert Speedup.of(ratios).verdict == NO_CHANGE  # 19 rounds: held at rank 2
    assert Speedup.of([*ratios, 1.3]).verdict == FAST  # 20, a look: rank 3


def test_the_rank_test_calls_a_small_steady_effect_that_the_noise_across_rounds_hides():
    """Anomaly mode's few percent: the fix is the fastest of its round's three runs every
    time, but the two baseline runs of a round differ by more than that, so its ratios do
    not clear every A/A ratio. Exchangeable runs would put it first with chance 1/3 a
    round: seven rounds in a row is under 0.05 %; with one round other than first, ten."""
    assert verdict.rank_looks() == [(7, 0), (10, 1)]
    assert verdict.rank_chance(7, 0) <= verdict.SEPARATED_ALPHA < verdict.rank_chance(6, 0)
    rounds = [(1.0 + 0.06 * (i % 2), 0.975, 1.0 + 0.06 * ((i + 1) % 2)) for i in range(10)]

    def of(taken: list[tuple[float, float, float]]) -> Speedup:
        ratios = [b1 / f for b1, f, _ in taken]
        noise = [b1 / b2 for b1, _, b2 in taken]
        return Speedup.of(ratios, noise, both=[(b1 / f, b2 / f) for b1, f, b2 in taken])

    assert of(rounds[:6]).verdict == NO_CHANGE and of(rounds[:6]).one_end
    called = of(rounds[:7])
    assert called.verdict == FAST and called.by == "ranks" and called.low > 1.0
    # a round where a baseline run came in under the fix: one miss, called at ten rounds
    rounds[2] = (1.0, 1.01, 1.06)
    assert of(rounds[:9]).verdict == NO_CHANGE
    assert of(rounds).verdict == FAST and of(rounds).low > 1.0


def test_a_steady_small_effect_is_not_settled_as_no_change_on_a_quiet_machine():
    """Every ratio within 5 % of 1 on a quiet machine settles "no clear change" after five
    rounds, unless the fix was at one end of every round: then the rank test gets its
    seven."""
    ratios, noise = [1.03, 1.05, 1.035, 1.045, 1.03], [1.01, 0.96, 1.0, 1.04, 0.99]
    both = [(r, r / a) for r, a in zip(ratios, noise, strict=True)]
    steady = Speedup.of(ratios, noise, both=both)
    assert not steady.settled and steady.one_end and steady.rounds_to_settle() == 7
    assert Speedup.of(ratios, noise).settled  # no baseline run twice: the quiet rule


def test_on_a_busy_machine_a_large_effect_waits_for_five_rounds():
    """Beside a CPU-bound process a stall regime can slow two of a round's three runs
    alike for several rounds running, the A/A ratio near 1 all along: a fix that changes
    nothing but drew the unslowed place three times looks 3x faster against quiet A/A
    ratios. Where the load meter saw other processes busy, the separation test waits for
    five rounds (1/243 that a regime hands the fix that place in all of them)."""
    taken = [(3.0, 1.0, 3.05)] * 5  # baseline, fix, baseline again: a clear 3x every round

    def of(rounds: list[tuple[float, float, float]], independent: bool) -> Speedup:
        return Speedup.of(
            [b1 / f for b1, f, _ in rounds],
            [b1 / b2 for b1, _, b2 in rounds],
            both=[(b1 / f, b2 / f) for b1, f, b2 in rounds],
            independent=independent,
        )

    assert of(taken[:3], independent=True).verdict == FAST
    busy = of(taken[:3], independent=False)
    assert busy.verdict == NO_CHANGE and not busy.settled and busy.rounds_to_settle() == 5
    assert not of(taken[:4], independent=False).settled
    called = of(taken, independent=False)
    assert called.verdict == FAST and called.by == "separation" and called.low > 2.5


def test_the_rounds_count_as_independent_only_where_the_load_meter_saw_a_quiet_machine():
    rounds = timing.Rounds("base", rounds=[{"base": 3.0, "fix": 1.0}] * 3)
    assert rounds.independent("fix")  # no reading (not Linux): the A/A ratios alone judge
    rounds.loads = {i: (0.03, 0.0) for i in range(3)}
    assert not rounds.independent("fix")  # 0.09 s: a few clock ticks, too short to tell
    rounds.loads = {i: (0.2, 0.0) for i in range(3)}
    assert rounds.independent("fix")
    rounds.loads = {i: (0.2, 0.2) for i in range(3)}  # another process on a whole CPU
    assert not rounds.independent("fix")
    assert rounds.speedup("fix") is not None and not rounds.speedup("fix").independent


def test_paired_rounds_beside_a_cpu_bound_process_read_the_machine_as_busy():
    """The real meter over real rounds: another process spinning on this process's CPUs
    (not one of our descendants, as a user's other work is not) makes the rounds count as
    dependent."""

    def work() -> float:
        started = time.perf_counter()
        while time.perf_counter() - started < 0.04:
            pass
        return time.perf_counter() - started

    with other_busy_process():
        taken = timing.paired_rounds(
            {"base": work, "fix": work}, "base", timing.Deadline(1.5), min_rounds=12
        )
    assert sum(w for w, _ in taken.loads.values()) >= verdict.LOAD_WINDOW_S
    assert not taken.independent("fix")
