"""The randomisation test (`measuring/randomisation.py`): exact, valid whatever the machine
does to the runs' places, and quicker than the rank test to call a small steady effect."""

from __future__ import annotations

import itertools
import math
import random

from torchtune_magic.measuring import randomisation, verdict
from torchtune_magic.measuring.verdict import Speedup

JITTER = 0.035  # a run's log-time jitter on a quiet machine, about what the demo's loader shows


def _rounds(
    rng: random.Random, n: int, effect: float, stalls: bool = False
) -> list[tuple[float, float, float]]:
    """n rounds of (baseline, fix, baseline) times: each place's time is the machine's
    (a stall regime slows two of a round's places alike for several rounds running, the
    pattern that fooled the separation test), the fix `effect` times faster; the fix's place
    drawn at random each round, as `timing.paired_rounds` draws it."""
    rounds, regime = [], 0
    for _ in range(n):
        if stalls and regime == 0 and rng.random() < 0.2:
            regime = rng.randint(2, 6)
        slow = rng.sample(range(3), 2) if regime else []
        regime = max(0, regime - 1)
        places = [
            math.exp(rng.gauss(0.0, JITTER)) * (rng.uniform(3, 30) if p in slow else 1.0)
            for p in range(3)
        ]
        fix_place = rng.randrange(3)
        places[fix_place] /= effect
        base = [t for p, t in enumerate(places) if p != fix_place]
        rounds.append((base[0], places[fix_place], base[1]))
    return rounds


def _pairs(rounds: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    return [(math.log(b1 / f), math.log(b2 / f)) for b1, f, b2 in rounds]


def test_the_chance_is_worked_out_exactly_over_every_labelling():
    rng = random.Random(3)
    pairs = _pairs(_rounds(rng, 5, 1.03))
    clip = randomisation._clip(pairs)
    step = clip / randomisation.GRID_STEPS
    per_round = [
        [round(v / step) for v in randomisation._place_values(a, b, clip)] for a, b in pairs
    ]
    seen = sum(values[0] for values in per_round)
    sums = [sum(choice) for choice in itertools.product(*per_round)]
    expected = sum(total >= seen for total in sums) / len(sums)
    assert math.isclose(randomisation.p_value(pairs, 1.0), expected, rel_tol=1e-9)


def test_a_fix_that_changes_nothing_is_called_no_more_often_than_its_chance_allows():
    """With stall regimes of 3-30x on two places at a time lasting several rounds: the
    rounds are far from independent, the places' labels still are."""
    rng, alpha, trials = random.Random(11), 0.01, 3000
    for stalls in (False, True):
        called = sum(
            randomisation.p_value(_pairs(_rounds(rng, 10, 1.0, stalls)), side) <= alpha
            for _ in range(trials)
            for side in (1.0, -1.0)
        )
        assert called / (2 * trials) <= alpha * 1.3, (stalls, called)


def test_a_small_steady_effect_that_the_rank_test_misses_is_called():
    """A fix 6 % faster than a run's 3.5 % jitter (anomaly mode in a loader-bound cell) is
    the fastest of its three runs in about three rounds of four: the rank test, allowed one
    round other than that, rarely calls it after 14 rounds, while its margin adds up; and
    the interval holds the effect."""
    rng = random.Random(5)
    by_randomisation = by_ranks = 0
    for _ in range(40):
        rounds = _rounds(rng, 14, 1.06)
        both = [(b1 / f, b2 / f) for b1, f, b2 in rounds]
        by_ranks += verdict._ranked(both) is not None
        found = verdict._randomised(both)
        if found is not None:
            low, high = found
            assert 1.0 < low < 1.06 < high, found  # never "slower", and the effect inside
            by_randomisation += 1
        speedup = Speedup.of(
            [b1 / f for b1, f, _ in rounds], [b1 / b2 for b1, _, b2 in rounds], both=both
        )
        assert speedup.verdict != verdict.SLOWER
    assert by_randomisation >= 25 and by_randomisation > 2 * by_ranks, (by_randomisation, by_ranks)


def test_the_interval_inverts_the_test():
    rng = random.Random(8)
    pairs = _pairs(_rounds(rng, 20, 1.10))
    low, high = randomisation.interval(pairs, verdict.RANDOMISED_ALPHA)
    assert 1.0 < low < 1.10 < high
    # just inside each end the test no longer rejects; just outside it does
    assert randomisation.p_value(pairs, 1.0, math.log(low) - 0.005) <= verdict.RANDOMISED_ALPHA
    assert randomisation.p_value(pairs, 1.0, math.log(low) + 0.005) > verdict.RANDOMISED_ALPHA
    assert randomisation.p_value(pairs, -1.0, math.log(high) + 0.005) <= verdict.RANDOMISED_ALPHA
    assert randomisation.interval(_pairs(_rounds(rng, 20, 1.0)), verdict.RANDOMISED_ALPHA) is None


def test_the_screen_skips_only_statistics_whose_chance_is_far_above_alpha():
    """`rejects` works the exact chance out only past SCREEN_Z standard deviations: every
    statistic nearer than that, over rounds of every length the procedure looks at, with
    and without stalls and effects, has a chance several times the alpha used."""
    rng, nearest = random.Random(4), 1.0
    for _ in range(1500):
        effect = rng.choice([1.0, 1.02, 1.05, 1.1])
        pairs = _pairs(_rounds(rng, rng.randint(5, 40), effect, stalls=rng.random() < 0.5))
        for side in (1.0, -1.0):
            if randomisation.z_score(pairs, side) < randomisation.SCREEN_Z:
                nearest = min(nearest, randomisation.p_value(pairs, side))
                assert not randomisation.rejects(pairs, side, verdict.RANDOMISED_ALPHA)
    assert nearest > 3 * verdict.RANDOMISED_ALPHA, nearest
