"""Fisher's randomisation test on paired rounds: a test that uses the size of the effect and
holds whatever the machine does.

A round that runs the baseline twice times three runs in places drawn at random
(`timing.paired_rounds`). Were the fix no change, which place ran the fix would tell nothing
about how long each place took (a stall lands on a place, not on a label): given the
round's three times, the fix's label sat on each place with chance 1/3, independently from
round to round. That is the test's whole model, so it holds beside a CPU-bound process and
through a stall regime spanning rounds, as the rank test does (`verdict._ranked`); but where
the rank test only counts the rounds in which the fix was the fastest, this one weighs by
how much: a fix 5 % faster than a run's jitter of 3-4 % (anomaly mode in a loader-bound
cell) is the fastest of its three runs in only about three rounds of four, which the rank
test's 7 of 7 rarely sees, while its margins add up in 10-15 rounds here.

The statistic is each round's mean baseline log-time less the fix's, summed over the
rounds; its distribution over the 3^n equally likely labellings of the same times is worked
out exactly (each round adds one of three values: a convolution). Each round's value is
clipped to CLIP_SPREADS times the rounds' median spread (a label-free figure, so the test
stays exact): one round stalled 10x would otherwise swamp the sum, and the fix that wins
by far is the separation test's to call anyway. Values are put on a grid of GRID_STEPS
steps per clip; the test is exact for the gridded statistic.

An interval inverts the test: the speedups θ not rejected when the fix's times are scaled
by θ (`interval`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import numpy as np

CLIP_SPREADS = 2.0
GRID_STEPS = 40
# a spread this small is a round whose three runs took the same time to the clock's grain
MIN_SPREAD = 1e-4
SCREEN_Z = 2.5
BISECTIONS = 30  # the interval's ends to a billionth of the range searched


def _place_values(a: float, b: float, clip: float) -> tuple[float, float, float]:
    """One round's statistic with the fix's label on each of its three places, the fix's
    own place first: log-times relative to the fix's (a and b: the two baseline runs' log
    ratios over the fix's), so the places are at a, b and 0, and with the label on place x
    the value is the mean of the other two less x."""
    places = (0.0, a, b)
    total = sum(places)
    return tuple(max(-clip, min(clip, (total - x) / 2 - x)) for x in places)  # type: ignore[return-value]


def _clip(pairs: list[tuple[float, float]]) -> float:
    spreads = [max(0.0, a, b) - min(0.0, a, b) for a, b in pairs]
    return CLIP_SPREADS * max(statistics.median(spreads), MIN_SPREAD)


def _labelled(
    pairs: list[tuple[float, float]], side: float, shift: float
) -> tuple[list[list[int]], int]:
    """Each round's three gridded values (the fix's own place first) and the sum seen."""
    shifted = [(a - shift, b - shift) for a, b in pairs]
    clip = _clip(shifted)
    step = clip / GRID_STEPS
    rounds = [[round(side * v / step) for v in _place_values(a, b, clip)] for a, b in shifted]
    return rounds, sum(values[0] for values in rounds)


def p_value(pairs: list[tuple[float, float]], side: float, shift: float = 0.0) -> float:
    """The chance, over the random labellings, of a statistic at least as far towards
    `side` (1: the fix faster, -1: slower) as the one seen. `pairs`: each round's two
    baseline log-times less the fix's; `shift`: the log-speedup the null hypothesis grants
    the fix (0: no change)."""
    return _chance(*_labelled(pairs, side, shift)) if pairs else 1.0


def z_score(pairs: list[tuple[float, float]], side: float, shift: float = 0.0) -> float:
    """How many standard deviations of its labellings' distribution the statistic seen lies
    towards `side` from their mean: it grows with the square root of the rounds for a
    steady effect, which says how many more rounds would tell."""
    return _z(*_labelled(pairs, side, shift)) if pairs else 0.0


def rejects(
    pairs: list[tuple[float, float]], side: float, alpha: float, shift: float = 0.0
) -> bool:
    """Whether the test rejects at `alpha` towards `side`. A statistic within SCREEN_Z
    standard deviations of its labellings' mean is not worked out: a sum of rounds' bounded
    values that near its mean has a tail far above any alpha used here (a thousandth and
    more, where alpha is a fraction of that), and the exact chance costs a convolution."""
    if not pairs:
        return False
    rounds, seen = _labelled(pairs, side, shift)
    return _z(rounds, seen) >= SCREEN_Z and _chance(rounds, seen) <= alpha


def _chance(rounds: list[list[int]], seen: int) -> float:
    """P(sum >= seen) when each round adds one of its three values, each with chance 1/3."""
    chances, lowest = np.ones(1), 0  # chances[i]: the chance that the sum is lowest + i
    for values in rounds:
        low, high = min(values), max(values)
        grown = np.zeros(len(chances) + high - low)
        for value in values:
            grown[value - low : value - low + len(chances)] += chances
        chances, lowest = grown / 3.0, lowest + low
    return float(chances[max(0, seen - lowest) :].sum())


def _z(rounds: list[list[int]], seen: int) -> float:
    mean = sum(sum(values) / 3.0 for values in rounds)
    variance = sum(sum(v * v for v in values) / 3.0 - (sum(values) / 3.0) ** 2 for values in rounds)
    return (seen - mean) / math.sqrt(variance) if variance > 0 else 0.0


def interval(pairs: list[tuple[float, float]], alpha: float) -> tuple[float, float] | None:
    """The speedups the test does not reject at `alpha` on either side, as factors, where
    it rejects no change on one side (None otherwise). The chance of a statistic past the
    one seen grows as the null grants the fix more, so each end is found by bisection."""
    if not rejects(pairs, 1.0, alpha) and not rejects(pairs, -1.0, alpha):
        return None
    values = [v for pair in pairs for v in pair]
    lowest, highest = min(0.0, *values), max(0.0, *values)
    low = _edge(lambda s: rejects(pairs, 1.0, alpha, s), lowest, highest)
    high = _edge(lambda s: not rejects(pairs, -1.0, alpha, s), lowest, highest)
    return math.exp(low), math.exp(high)


def _edge(holds: Callable[[float], bool], low: float, high: float) -> float:
    """The point in [low, high] where `holds` turns from true to false (true up to it)."""
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        if holds(middle):
            low = middle
        else:
            high = middle
    return (low + high) / 2
