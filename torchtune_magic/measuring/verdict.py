"""What paired rounds say about a fix: a speedup with an interval, and a verdict that holds.

Each round times the baseline and the fix back to back, so whatever the machine was doing
then (another process, a frequency change, the allocator's mood) weighs on both: the ratio
of the two is the round's speedup. Over the rounds, the median ratio is the speedup and a
distribution-free confidence interval for that median comes from order statistics (the
k-th smallest and k-th largest ratios, k from the binomial distribution): no assumption of
normal noise, and one round stalled by another process moves it by one rank, not by its
size. A busy 2-core machine makes exactly such outliers.

The verdict reads the interval, never the point alone:
- "faster": the whole interval above 1 and the median past the no-change band;
- "slower": the whole interval below 1 and the median past the band on the other side;
- "no clear change": anything else — an interval straddling 1 never reads "slower". It is
  *settled* when the interval lies within SETTLED_BAND of 1 (more rounds would not make it
  a win or a loss worth having); otherwise more rounds could still tell, and when the budget
  ran out first the report says what `--budget` would have (`budget_to_tell`).

The confidence is high (99.9%) because the session looks at the interval after every
round and stops as soon as it is decided, each look a chance for noise to cross 1, and
because the rounds of a busy machine are not independent (a stall spans several).

That interval ignores how large the ratios are: a 3x fix would wait for the interval's
rounds like a 1.01x one. So a second test uses the size of the effect against the noise the
machine shows *now*. While a fix is undecided, the baseline runs twice a round, every run
in a place drawn at random (`timing.paired_rounds`): the ratio of the round's two baseline
runs is an A/A ratio, a fix that changes nothing timed under the same conditions. Were the
fix no change, the round's three runs would be exchangeable, and its ratio (the first
baseline run over the fix's) would be distributed as the A/A ratio is. A fix is called once
every one of its n ratios lies beyond every one of the m A/A ratios on one side of 1
(`separated`): under no change, that happens with probability 2^-n / C(n + m, n), which
must be at most SEPARATED_ALPHA (5 rounds against their 5 A/A ratios), or at most 1/160 (3
rounds) where every ratio is also MARGIN times as far from 1 as the farthest A/A ratio
(heavy-tailed noise falls off at least as fast as 1/x beyond its spread, so tripling the
distance divides the chance by 3 a ratio). It calls nothing on a machine whose A/A ratios
reach QUIET_NOISE: a busy machine's stalls of 10-100x are not seen often enough in a few
rounds to bound. Where the load meter (`probe.load`) saw other processes keep BUSY_CPUS of
the kernel's CPUs busy over the fix's rounds, it waits for BUSY_SEPARATION_ROUNDS: the
chance above holds for rounds independent of each other, and beside a CPU-bound process a
stall regime (two of a round's three runs slowed alike, so its A/A ratio stays near 1)
lasts several rounds; a fix that changes nothing but drew the unslowed place three rounds
running (1/27) cleared the margin. A stall
of the fix's run alone could still make a fix look slower; a stall of a baseline run
widens the A/A ratio it is in, so one rarely makes a fix look faster. On a quiet machine
a 3x fix is called in 3 rounds and a 1.3x one in 3 to 5; beside a CPU-bound process the
order-statistic interval decides, as before.

A third test needs no model of the noise at all, so it holds beside a CPU-bound process
too: the rank test (`_ranked`). Were the fix no change, a round's three runs would be
exchangeable, and the fix the fastest of them with chance 1/3, independently from round to
round. A fix the fastest (or the slowest) of its round in all of 7 rounds, or all but one
of 10, is called: 3^-7 and 21 / 3^10, both under SEPARATED_ALPHA. It compares runs only
within a round, so a fix whose effect is small but larger than one run's jitter (anomaly
mode's 4 % on a quiet machine) is called in 7 rounds where the separation test, which
compares ratios across rounds, waits for the interval; and a stall in one round costs it one
miss, not the whole test. So the baseline runs twice in every round while a fix is
undecided, on a busy machine too.

The rank test counts the rounds the fix was fastest in, not by how much; a fourth test
weighs that too without a model of the noise: Fisher's randomisation test
(`randomisation.py`, `_randomised`). Its statistic is the rounds' summed margin (each
round's mean baseline log-time less the fix's), its distribution the one over every
labelling of the rounds' places, which is exact under no change whatever the machine did. A
fix 5-7 % faster than a run's 3-4 % jitter (anomaly mode in a loader-bound cell) is the
fastest of its three runs in about three rounds of four, which the rank test's 7 of 7
rarely sees, while the margins add up in 10-15 rounds. It is looked at every round from
RANDOMISED_FIRST_LOOK, at RANDOMISED_ALPHA a side each look, and its interval is the
speedups it does not reject.

Measured coverage (`benchmarks/verdicts.py`: 20 recordings per control and load, 300 A/A
rounds of two millisecond cells and 150 of a 22 ms training step, each replayed from every
starting round, up to 40 looks: 12,600 starting points per load;
`benchmarks/results/verdicts-*.json`): quiet, 0.45 % false verdicts (the 99.8 % interval
alone: 0.38 %): the interval's 0.13 %, the rank test's 0.22 %, the separation test's 0.06 %,
the randomisation test's 0.04 %; beside a CPU-bound process 0.57 % (0.69 %): the
interval's 0.32 %, the rank test's 0.15 %, the separation test's 0.08 %, the randomisation
test's 0.02 %. Before it waited for five rounds where the load meter saw other
processes busy, the separation test gave three quarters of 1.08 % there.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist

from ..report import NO_CHANGE_BAND
from . import randomisation

# Two-sided: each side may err with at most 0.05% per look. Measured on a 2-core machine
# with another CPU-bound process beside the kernel, where a fix that changes nothing gave
# per-round ratios from 0.08 to 11 (torch's threads stalled in turns): the procedure below
# (a verdict at the first look that allows one, rounds going on otherwise) called such a
# fix faster or slower in 8 of 240 starting points at 98%, 3 of 235 at 99%, 1 of 230 at
# 99.5%, none of 225 at 99.8%. With the separation test beside it (below), 99.9%: eleven
# rounds at least give an interval.
CONFIDENCE = 0.999
SETTLED_BAND = 0.05  # an interval within 1 ± this is a settled "no clear change"
# The interval is re-read after every round, each reading a chance for noise to cross 1.
# Its rank moves up only at a few looks and is held in between: with the rank k held,
# "fewer than k of the first n ratios below 1" only gets less likely as n grows, so the
# rounds between two looks add no chance of a false verdict beyond the first of them, and
# the whole sequence's is at most the sum over the looks (13 x 0.05 % a side), not over
# every round (50). Looks: the first round with an interval, then 1.15x apart (a stall
# in one round of fifteen still costs the interval only one rank).
LOOK_STEP = 1.15
MAX_LOOK_ROUNDS = 60
# the separation test (above): one-sided chance per look that a fix changing nothing is
# called
SEPARATED_ALPHA = 0.0005
MARGIN = 3.0
# The separation test calls nothing where an A/A ratio is past this: beside a CPU-bound
# process runs stall by 10-100x, more often than a few rounds can show (replayed busy
# rounds: it doubled the false verdicts of the interval alone); the interval decides there
QUIET_NOISE = 1.25
# Other processes keeping this many of the kernel's CPUs busy over the fix's rounds
# (`timing.Rounds.loads`, from `probe.load`), read over LOAD_WINDOW_S at least (/proc/stat
# counts in clock ticks: one round of a fast cell reads a tick too many or too few), make
# the machine a busy one. The separation test's chance holds for rounds independent of each
# other; beside a CPU-bound process a stall regime (two of a round's three runs slowed
# alike) lasts several rounds while the A/A ratio stays near 1, and a fix that changes
# nothing but drew the unslowed place in three rounds running (1/27) passed the margin:
# three quarters of the busy replays' false verdicts. The rank test's chance holds whatever
# the machine does (it needs only the places drawn at random).
BUSY_CPUS = 0.5
LOAD_WINDOW_S = 0.15
# ... so there the separation test waits for this many rounds: a regime handing the fix the
# unslowed place every round is 1/243 for five (replayed busy rounds: 0.08 % false verdicts
# of its own, where three rounds gave 0.8 %), and a loader fix, whose sleeps a busy CPU does
# not stretch, is still called before the rank test's seven
BUSY_SEPARATION_ROUNDS = 5
# The rank test (`_ranked`): most rounds with the fix the fastest (or slowest) of their
# three runs, up to this many rounds other than that
RANK_MISSES = 1
# a fix whose every ratio stays within the settled band, on a machine whose A/A ratios do
# too, is settled "no clear change" after this many rounds (before any interval)
QUIET_SETTLE_ROUNDS = 5
# The randomisation test (`randomisation.py`): each look a chance of this much a side that
# a fix changing nothing is called (replayed A/A rounds: 0.0002 added 0.2 % false verdicts
# on a quiet machine, this 0.04 %), looked at every round from the first whose most extreme
# labelling (3^-n) is that rare: 9 rounds
RANDOMISED_ALPHA = 0.0001
RANDOMISED_FIRST_LOOK = math.ceil(math.log(1 / RANDOMISED_ALPHA, 3))
FASTER, SLOWER, NO_CLEAR_CHANGE = "faster", "slower", "no clear change"
VERDICTS = (FASTER, SLOWER, NO_CLEAR_CHANGE)


def _binomial_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def rank_for(n: int, confidence: float = CONFIDENCE) -> int | None:
    """The rank k (1-based) such that the k-th smallest and k-th largest of n ratios bound
    their median with at least `confidence`; None when n is too small for any."""
    alpha = (1 - confidence) / 2
    k = 0
    while k + 1 <= n // 2 and _binomial_cdf(k, n) <= alpha:
        k += 1
    return k if k >= 1 else None


def looks(confidence: float = CONFIDENCE) -> list[int]:
    """The rounds at which the interval's rank may move up: the first that gives one, then
    each LOOK_STEP times as many, up to MAX_LOOK_ROUNDS."""
    at = [min_rounds(confidence)]
    while (following := max(at[-1] + 1, round(at[-1] * LOOK_STEP))) <= MAX_LOOK_ROUNDS:
        at.append(following)
    return at


def interval_rank(n: int, confidence: float = CONFIDENCE) -> int | None:
    """The rank of n ratios' interval: that of the last look at or before n (see LOOKS).
    Held between looks, the interval is wider than n alone would allow, never narrower,
    and a verdict between two looks costs no more chance than the first of them."""
    held = [look for look in looks(confidence) if look <= n]
    return rank_for(held[-1], confidence) if held else None


def min_rounds(confidence: float = CONFIDENCE) -> int:
    """The fewest rounds that give an interval at all (11 at 99.9%)."""
    n = 1
    while rank_for(n, confidence) is None:
        n += 1
    return n


def _quiet_spread(widest: float) -> bool:
    """The one rule for a quiet machine: no A/A log-ratio reaches log(QUIET_NOISE)."""
    return widest < math.log(QUIET_NOISE)


def rank_chance(n: int, misses: int) -> float:
    """The chance that a fix changing nothing is the fastest of its round's three runs in
    all but `misses` of n rounds (each run's place drawn at random: 1/3 a round)."""
    return sum(math.comb(n, j) * 2**j for j in range(misses + 1)) / 3**n


def rank_looks() -> list[tuple[int, int]]:
    """(rounds, misses allowed) where the rank test's allowance moves up: the fewest rounds
    at which each number of misses up to RANK_MISSES is within SEPARATED_ALPHA (7 rounds
    with none, 10 with one). Held in between, as the interval's rank is (see LOOKS)."""
    looks = []
    for misses in range(RANK_MISSES + 1):
        n = misses + 1
        while rank_chance(n, misses) > SEPARATED_ALPHA:
            n += 1
        looks.append((n, misses))
    return looks


def separation_chance(n: int, m: int) -> float:
    """The chance that n ratios of a fix changing nothing all lie beyond m A/A ratios on
    one given side: 2^-n / C(n + m, n)."""
    return 0.5**n / math.comb(n + m, n)


# 3 rounds against their 3 A/A ratios (1/160), every ratio MARGIN times as far from 1
MARGIN_ALPHA = separation_chance(3, 3)


@dataclass(frozen=True)
class Speedup:
    """A fix's speedup over paired rounds: the median ratio and its interval.

    `by`: what decided the interval — "rounds" (order statistics of the ratios),
    "separation" (the ratios beyond the A/A ratios: the interval is the ratios' range widened
    by the farthest A/A ratio) or "quiet" (every ratio and A/A ratio within the settled
    band: their range)."""

    median: float
    low: float | None  # None: too few rounds for an interval at CONFIDENCE
    high: float | None
    rounds: int
    by: str = "rounds"
    noise: float | None = None  # the farthest A/A ratio from 1 (as a factor >= 1)
    # every round with the baseline twice had the fix at one end of its three runs (the
    # fastest in each, or the slowest in each): the rank test will call it in a few more
    one_end: bool = False
    # no busy round among the fix's (else the separation test waits for
    # BUSY_SEPARATION_ROUNDS)
    independent: bool = True
    # the randomisation test's statistic in standard deviations towards the median's side
    # (`randomisation.z_score`): a steady effect's grows with the square root of the rounds
    margin: float | None = None

    @classmethod
    def of(
        cls,
        ratios: list[float],
        noise: list[float] | None = None,
        confidence: float = CONFIDENCE,
        both: list[tuple[float, float]] | None = None,
        independent: bool = True,
    ) -> Speedup:
        """From the rounds' ratios, the A/A ratios measured beside them (`noise`), and for
        each round that ran the baseline twice, both baseline runs over the fix's (`both`:
        the rank test); `independent`: no other process kept BUSY_CPUS busy in these
        rounds (else the separation test waits for BUSY_SEPARATION_ROUNDS)."""
        ordered = sorted(r for r in ratios if r > 0 and math.isfinite(r))
        n = len(ordered)
        if n == 0:
            raise ValueError("no ratios to summarise")
        median = statistics.median(ordered)
        spread = [abs(math.log(a)) for a in noise or [] if a > 0 and math.isfinite(a)]
        widest = max(spread) if spread else None
        noise_factor = math.exp(widest) if widest is not None else None
        pairs = [(a, b) for a, b in both or [] if a > 0 and b > 0]
        one_end = bool(pairs) and (_misses(pairs, 1.0) == 0 or _misses(pairs, -1.0) == 0)
        # the separation test compares ratios across rounds; where the rounds ran the
        # baseline twice it also needs the fix at the same end of each of them (a stall
        # spanning two of a round's runs leaves the third fastest: a third of the time the
        # fix's, and the fix's ratio then clears that round's A/A ratio by the stall)
        side = 1.0 if median > 1.0 else -1.0
        if (
            (independent or n >= BUSY_SEPARATION_ROUNDS)
            and widest is not None
            and _separated(ordered, widest, len(spread))
            and _misses(pairs, side) == 0
        ):
            low, high = ordered[0] / noise_factor, ordered[-1] * noise_factor
            return cls(median, low, high, n, "separation", noise_factor, one_end)
        margin = (
            randomisation.z_score([(math.log(a), math.log(b)) for a, b in pairs], side)
            if pairs
            else None
        )
        kept = {
            "noise": noise_factor,
            "one_end": one_end,
            "independent": independent,
            "margin": margin,
        }
        ranked = _ranked(pairs)
        if ranked is not None:  # the (misses + 1)-th ratio from each end: past 1 on one side
            first = sorted(a for a, _ in pairs)
            low, high = first[ranked], first[len(first) - 1 - ranked]
            return cls(median, low, high, n, "ranks", **kept)
        randomised = _randomised(pairs)
        if randomised is not None:
            return cls(median, *randomised, n, "randomisation", **kept)
        logs = [math.log(r) for r in ordered]
        rank = interval_rank(n, confidence)
        if rank is not None:
            low, high = ordered[rank - 1], ordered[n - rank]
            return cls(median, low, high, n, "rounds", **kept)
        band = math.log(1.0 + SETTLED_BAND)
        far = max(abs(value) for value in logs)
        quiet = widest is not None and n >= QUIET_SETTLE_ROUNDS and max(far, widest) <= band
        if quiet and not one_end:  # one end in every round: the rank test may call it
            return cls(median, ordered[0], ordered[-1], n, "quiet", noise_factor)
        return cls(median, None, None, n, "rounds", **kept)

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def verdict(self) -> str:
        if not self.has_interval or self.by == "quiet":
            return NO_CLEAR_CHANGE
        assert self.low is not None and self.high is not None
        if self.low > 1.0 and self.median >= 1.0 + NO_CHANGE_BAND:
            return FASTER
        if self.high < 1.0 and self.median <= 1.0 / (1.0 + NO_CHANGE_BAND):
            return SLOWER
        return NO_CLEAR_CHANGE

    @property
    def settled(self) -> bool:
        """Whether more rounds are not needed: a verdict either way, or an interval too
        close to 1 for any change worth having to hide in it."""
        if not self.has_interval:
            return False
        if self.verdict != NO_CLEAR_CHANGE:
            return True
        assert self.low is not None and self.high is not None
        return self.low >= 1.0 / (1.0 + SETTLED_BAND) and self.high <= 1.0 + SETTLED_BAND

    def rounds_to_settle(self) -> int | None:
        """About how many rounds would settle it, from the interval's width now (it
        narrows with the square root of the rounds); None when already settled."""
        if self.settled:
            return None
        n = max(self.rounds, 1)
        if not self.has_interval:
            sooner = []
            if self.one_end:  # the rank test's first look
                sooner.append(max(n + 1, rank_looks()[0][0]))
            if self.noise is not None and abs(math.log(self.median)) > MARGIN * math.log(
                self.noise
            ):  # clear of the noise: the separation test in a few more
                separate = _rounds_to_separate(n)
                sooner.append(
                    separate if self.independent else max(separate, BUSY_SEPARATION_ROUNDS)
                )
            if self.margin is not None and self.margin > 0:  # the randomisation test's
                wanted = NormalDist().inv_cdf(1 - RANDOMISED_ALPHA)
                projected = math.ceil(n * (wanted / self.margin) ** 2)
                if projected <= MAX_LOOK_ROUNDS:  # a steady effect's margin, not noise
                    sooner.append(max(n + 1, RANDOMISED_FIRST_LOOK, projected))
            return min(sooner) if sooner else max(min_rounds(), 2 * n)
        assert self.low is not None and self.high is not None
        half = (math.log(self.high) - math.log(self.low)) / 2
        centre = abs(math.log(self.median))
        # to tell it from 1 the half-width must shrink below the distance to 1; to call it
        # settled, below what is left of the settled band around the median
        target = max(centre, math.log(1.0 + SETTLED_BAND) - centre, 0.005)
        return max(n + 1, math.ceil(n * (half / target) ** 2))


def budget_to_tell(
    speedups: list[Speedup], budget_s: float, spent_on_rounds_s: float, fixed_s: float
) -> float | None:
    """The `--budget` that would most likely settle every unsettled speedup: the rounds it
    needs at the cost per round seen, plus what was spent outside the rounds; rounded up to
    5 s. None when all are settled or nothing was timed."""
    unsettled = [s for s in speedups if not s.settled]
    if not unsettled:
        return None
    taken = max((s.rounds for s in speedups), default=0)
    if taken == 0 or spent_on_rounds_s <= 0:
        return None
    needed = max(s.rounds_to_settle() or taken for s in unsettled)
    per_round = spent_on_rounds_s / taken
    wanted = fixed_s + needed * per_round
    return float(max(budget_s + 5, 5 * math.ceil(wanted / 5)))


def _separated(ordered: list[float], widest: float, m: int) -> bool:
    """Every ratio beyond the farthest of m A/A ratios, on one side of 1, by a margin the
    chance of it under no change allows (see the module's docstring)."""
    n = len(ordered)
    logs = [math.log(r) for r in ordered]
    nearest = min(abs(value) for value in logs)
    one_side = all(value > 0 for value in logs) or all(value < 0 for value in logs)
    if not one_side or nearest <= widest:
        return False
    chance = separation_chance(n, m)
    if not _quiet_spread(widest):  # stalls show in a busy machine's A/A ratios
        return False
    return chance <= SEPARATED_ALPHA or (nearest >= MARGIN * widest and chance <= MARGIN_ALPHA)


def _misses(pairs: list[tuple[float, float]], side: float) -> int:
    """Rounds in which the fix was not the fastest of the three runs (side 1) or not the
    slowest (side -1): both baseline runs over the fix's past 1 on that side, or not."""
    return sum(1 for a, b in pairs if not (side * math.log(a) > 0 and side * math.log(b) > 0))


def _ranked(pairs: list[tuple[float, float]]) -> int | None:
    """The misses allowed where the rank test calls the fix (faster or slower), else None.

    Were the fix no change, a round's three runs (the baseline twice, the fix once, in
    places drawn at random) would be exchangeable: the fix the fastest of them with chance
    1/3, round after round, whatever the machine did (a stall lands on any of the three
    alike). So it needs no model of the noise, holds beside a CPU-bound process, and calls
    a fix whose effect is small but larger than a run's jitter (anomaly mode's 4 % on a
    quiet machine) where the separation test, which compares ratios across rounds, waits
    for the interval. The allowance is held between looks (`rank_looks`): with it held,
    "at most k misses in the first n rounds" only gets less likely as n grows."""
    n = len(pairs)
    allowed = [misses for at, misses in rank_looks() if at <= n]
    if not allowed:
        return None
    misses = allowed[-1]
    if _misses(pairs, 1.0) <= misses or _misses(pairs, -1.0) <= misses:
        return misses
    return None


def _randomised(pairs: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The randomisation test's interval (`randomisation.py`) where it tells the fix from no
    change, looked at every round from RANDOMISED_FIRST_LOOK on; else None."""
    if len(pairs) < RANDOMISED_FIRST_LOOK:
        return None
    logs = [(math.log(a), math.log(b)) for a, b in pairs]
    found = randomisation.interval(logs, RANDOMISED_ALPHA)
    if found is None or (found[0] <= 1.0 <= found[1]):
        return None
    return found


def _rounds_to_separate(n: int) -> int:
    """The rounds at which n ratios clear of the noise by the margin are called (each round
    brings one A/A ratio as well)."""
    rounds = max(n + 1, 3)
    while separation_chance(rounds, rounds) > MARGIN_ALPHA:
        rounds += 1
    return rounds
