"""Honest timing: warm-up apart, configurations in paired rounds, within a deadline.

Each configuration (baseline, each fix set) is a callable doing one run of the cell and
returning its seconds: the whole run, or per step when runs are sampled (set-up such as
state restore happens outside the timed region). Runs go in rounds A B C, B C A, …, so
machine drift lands on every configuration alike, and each fix's time is paired with the
baseline's of the same round (`verdict`: a speedup per round, an interval over rounds).
Statistics of one configuration's times come from `torch.utils.benchmark.Measurement`.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.utils.benchmark import Measurement as _BenchMeasurement
from torch.utils.benchmark.utils.common import TaskSpec

from ..distributed import lockstep
from ..probe import load
from ..report import is_noisy
from . import verdict
from .verdict import Speedup

Progress = Callable[[float, str], None]  # (fraction done 0..1, message)
RunDone = Callable[[str, "Measurement"], None]  # after each run: (label, its measurement)

MAX_ROUNDS = 60
ONE_TIME_FLOOR_S = 0.005  # a first run slower by less than this is noise, not a one-time cost


@dataclass
class Measurement:
    """Wall times of one configuration, with its statistics as methods."""

    label: str
    times: list[float] = field(default_factory=list)
    warmup_s: float | None = None

    def _stats(self) -> _BenchMeasurement:
        return _BenchMeasurement(1, list(self.times), TaskSpec(stmt=self.label, setup=""))

    @property
    def runs(self) -> int:
        return len(self.times)

    @property
    def median(self) -> float | None:
        return self._stats().median if self.times else None

    @property
    def iqr(self) -> float | None:
        return self._stats().iqr if len(self.times) > 1 else (0.0 if self.times else None)

    @property
    def spread(self) -> float:
        """IQR / median (0 when unknown)."""
        median, iqr = self.median, self.iqr
        return (iqr / median) if median and iqr is not None else 0.0

    @property
    def noisy(self) -> bool:
        return is_noisy(self.median, self.iqr)

    @property
    def one_time_s(self) -> float | None:
        """Extra cost of the first run over a steady run (compile, worker start-up), or None
        when the difference is within noise."""
        return one_time_cost(self.warmup_s, self.median)


def one_time_cost(first_s: float | None, steady_s: float | None) -> float | None:
    """What a first run (or its part before the timed steps) cost beyond a steady one:
    compiling, starting workers, autotuning. None when within noise (under
    ONE_TIME_FLOOR_S or 10% of the steady time)."""
    if first_s is None or steady_s is None:
        return None
    extra = first_s - steady_s
    return extra if extra > max(ONE_TIME_FLOOR_S, 0.1 * steady_s) else None


class OutOfTime(Exception):
    """A measuring run was stopped at a step boundary because the deadline had passed: it
    is no measurement, and nothing more is started."""


@dataclass
class Deadline:
    """The end of a measuring budget, counted from `start` (a perf_counter time): the wait
    the user was promised. Every part of measuring asks it before it starts something."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    @property
    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return max(0.0, self.seconds - self.spent)

    def allows(self, seconds: float) -> bool:
        """Whether something taking `seconds` would end before the deadline; under torchrun,
        on every rank (what starts must start on all of them: `distributed/lockstep.py`)."""
        return not lockstep.any_rank(seconds > self.left())


@dataclass
class Rounds:
    """Every timed run, round by round: a round is each configuration still being measured
    run once, back to back, so each fix's time sits next to a baseline time taken under the
    same machine conditions (a label absent from a round did not run in it)."""

    baseline: str
    rounds: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0  # wall time the rounds took, runs and what is done between them
    # each run's wall time by label (a sampled run returns its time per step, and every run
    # also restores state first): what foresees whether the next round fits the deadline
    walls: dict[str, list[float]] = field(default_factory=dict)
    # round index -> the baseline run again at the end of that round (while a fix was still
    # undecided): the pair's ratio is the round's A/A ratio (`verdict`'s separation test)
    again: dict[int, float] = field(default_factory=dict)
    # round index -> (its wall seconds, the CPU-seconds other processes ran on this
    # kernel's CPUs meanwhile: `probe.load`; the most any rank saw): a busy machine's rounds
    # are not independent of each other (`verdict.BUSY_CPUS`)
    loads: dict[int, tuple[float, float]] = field(default_factory=dict)
    # label -> what one run's ratio is multiplied by to judge the whole cell: a sampled fix
    # that runs a share of the cell's steps (a DistributedSampler: 1/N of each epoch) does
    # that share of the work, so its per-step ratio over-counts the cell's time by 1/share
    whole_cell: dict[str, float] = field(default_factory=dict)
    # what each round's places are drawn from: drawn anew for every measurement (a fixed
    # draw would give every measurement one pattern of places, and a cell whose first run
    # in a round is slower the same signs every time), rank 0's under torchrun
    seed: int | None = None

    def times(self, label: str) -> list[float]:
        found = [r[label] for r in self.rounds if label in r]
        return found + list(self.again.values()) if label == self.baseline else found

    def noise(self) -> list[float]:
        """Each closed round's A/A ratio: its first baseline run over its last."""
        return [
            self.rounds[i][self.baseline] / again
            for i, again in self.again.items()
            if again > 0 and self.baseline in self.rounds[i]
        ]

    def measurement(self, label: str) -> Measurement:
        return Measurement(label, self.times(label))

    def ratios(self, label: str) -> list[float]:
        """The baseline's time over this configuration's, in each round both ran (the
        round's first baseline run: exchangeable with the fix's and the second baseline
        run's places, as the A/A ratio's are); for a fix judged by the whole cell, scaled
        to it."""
        scale = self.whole_cell.get(label, 1.0)
        return [
            times[self.baseline] / times[label] * scale
            for times in self.rounds
            if label in times and self.baseline in times and times[label] > 0
        ]

    def both(self, label: str) -> list[tuple[float, float]]:
        """For each round that ran this configuration and the baseline twice: both
        baseline runs over this configuration's (scaled as `ratios` are), the rank test's
        evidence (`verdict._ranked`)."""
        scale = self.whole_cell.get(label, 1.0)
        return [
            (times[self.baseline] / times[label] * scale, self.again[i] / times[label] * scale)
            for i, times in enumerate(self.rounds)
            if i in self.again and label in times and self.baseline in times and times[label] > 0
        ]

    def independent(self, label: str) -> bool:
        """Whether the rounds that timed this configuration were quiet enough to count as
        independent: other processes kept fewer than `verdict.BUSY_CPUS` busy over them,
        read over at least `verdict.LOAD_WINDOW_S` (one round of a fast cell is a few clock
        ticks). Where the meter reads nothing (not Linux) the A/A ratios alone judge."""
        seen = [
            self.loads[i]
            for i, times in enumerate(self.rounds)
            if label in times and i in self.loads
        ]
        if not seen:
            return True
        window = sum(w for w, _ in seen)
        return (
            window >= verdict.LOAD_WINDOW_S and sum(o for _, o in seen) / window < verdict.BUSY_CPUS
        )

    def speedup(self, label: str) -> Speedup | None:
        ratios = self.ratios(label)
        if not ratios:
            return None
        return Speedup.of(
            ratios, self.noise(), both=self.both(label), independent=self.independent(label)
        )

    @property
    def labels(self) -> list[str]:
        return list(dict.fromkeys(label for r in self.rounds for label in r))


def paired_rounds(
    runners: dict[str, Callable[[], float]],
    baseline: str,
    deadline: Deadline,
    *,
    progress: Progress | None = None,
    on_run: RunDone | None = None,
    begun: Rounds | None = None,
    min_rounds: int | None = None,
    meter: Callable[[], load.Reading | None] | None = None,
) -> Rounds:
    """Time the configurations in rounds (the order rotating from round to round) until
    every fix's speedup is settled (`verdict.Speedup.settled`) or the next round would end
    past the deadline; with no fix, `min_rounds` rounds of the baseline (a cell with
    nothing to compare waits no longer than its figures need). A fix whose speedup
    settled drops out of later rounds, so the budget goes to those still undecided, and
    one clear of the noise runs alone until it settles (`_focus`); the baseline runs in
    every round. `begun` holds rounds already taken (a sampled
    measurement's first runs) and the runs' wall times so far. No round starts that its
    predicted length (each configuration's median wall time so far, the baseline's for one
    not yet seen) does not leave room for. `meter` reads the load over each round (runners
    whose times do not come from this machine, as in tests, pass one that reads nothing);
    by default `probe.load`'s, except under torchrun, where the rounds are taken as
    independent: agreeing each round's reading across ranks lines the ranks up at every
    round's start, which narrowed the A/A ratios below what the fixes' runs see."""
    if meter is None and lockstep.current() is None:
        meter = load.reading
    wanted = min_rounds if min_rounds is not None else verdict.min_rounds()
    result = begun if begun is not None else Rounds(baseline)
    if result.seed is None:
        result.seed = lockstep.from_first(random.SystemRandom().getrandbits(32))
    variants = [label for label in runners if label != baseline]
    started = time.perf_counter()
    at_most: int | None = None
    for index in range(len(result.rounds), MAX_ROUNDS):
        active = [label for label in variants if not _settled(result.speedup(label))]
        if not active and (variants or index >= wanted):  # no fix: `wanted` rounds
            break
        active = _focus(result, active)
        # while a fix is undecided the baseline runs twice a round; every run takes a place
        # drawn at random (the same draw on every rank: `Rounds.seed`), so no fix keeps a
        # place that something periodic on the machine favours over the baseline's
        base_wall = _typical(result.walls.get(baseline, []))
        predicted = sum(_typical(result.walls.get(label, [])) or base_wall for label in active)
        predicted += base_wall
        if not deadline.allows(predicted):
            break
        # ... where the deadline leaves room for it (a round without is still a pairing)
        again = [AGAIN] if active and deadline.allows(predicted + base_wall) else []
        predicted += base_wall if again else 0.0
        order = [baseline, *active, *again]
        random.Random(result.seed + index).shuffle(order)
        this_round: dict[str, float] = {}
        result.rounds.append(this_round)
        round_began = meter() if meter is not None else None
        # the rounds a progress line promises at most: the cheapest round there could be
        # (the baseline and one fix) filling what is left; it only ever comes down
        cheapest = min(
            (2 * base_wall + (_typical(result.walls.get(label, [])) or base_wall))
            for label in active or [baseline]
        )
        fits = index + int(deadline.left() / cheapest) if cheapest > 0 else MAX_ROUNDS
        at_most = min(at_most or MAX_ROUNDS, fits, MAX_ROUNDS)
        for label in order:
            runs_as = baseline if label == AGAIN else label
            if progress is not None:
                share = deadline.spent / deadline.seconds if deadline.seconds else 1.0
                of = f" of at most {at_most}" if at_most > index else ""
                progress(min(1.0, share), f"round {index + 1}{of}: {runs_as}")
            begun_at = time.perf_counter()
            try:
                value = runners[runs_as]()
            except OutOfTime:  # a run that overran the deadline: its round is no pairing
                result.rounds.pop()
                result.again.pop(index, None)
                result.seconds += time.perf_counter() - started
                return result
            if label == AGAIN:
                result.again[index] = value
            else:
                this_round[label] = value
            wall = lockstep.slowest(time.perf_counter() - begun_at)
            result.walls.setdefault(runs_as, []).append(wall)
            if on_run is not None:
                on_run(runs_as, result.measurement(runs_as))
        round_ended = meter() if meter is not None and round_began is not None else None
        seen = (  # read unclamped: summed over rounds (`Rounds.independent`)
            load.between(round_began, round_ended, clamped=False) if round_ended else None
        )
        # every rank agrees on it, where a meter reads at all (an agreement more a round
        # would also line the ranks up at each round's start, which no run did before)
        if meter is not None and lockstep.any_rank(seen is not None):
            window, other = lockstep.slowest_of(
                [seen.window_s, seen.other_cpu_s] if seen is not None else [None, None]
            )
            result.loads[index] = (window or 0.0, other or 0.0)
    result.seconds += time.perf_counter() - started
    return result


# the baseline's run that closes a round (a label of no configuration)
AGAIN = "\x00baseline again"
# a fix whose every ratio so far is at least this far from 1, and farther than every A/A
# ratio, is clear of the noise: its rounds time it alone until it settles
CLEAR_EFFECT = 1.5


def _focus(result: Rounds, active: list[str]) -> list[str]:
    """The undecided fixes the next round times: the one farthest clear of the noise, alone,
    where one is (a 3x loader fix settles in three rounds of the baseline and itself, not
    of every fix: the budget buys the answer that is nearly in first); else all of them,
    sharing the round's baseline runs. Choosing which fix runs from the ratios so far
    leaves each round's own pairing, in places drawn at random, as it was."""
    widest = max((abs(math.log(a)) for a in result.noise() if a > 0), default=0.0)
    clear: dict[str, float] = {}
    for label in active:
        logs = [math.log(r) for r in result.ratios(label) if r > 0]
        if not logs or not (all(x > 0 for x in logs) or all(x < 0 for x in logs)):
            continue
        nearest = min(abs(x) for x in logs)
        if nearest >= math.log(CLEAR_EFFECT) and nearest > widest:
            clear[label] = nearest
    return [max(clear, key=lambda label: clear[label])] if clear else active


def _settled(speedup: Speedup | None) -> bool:
    return speedup is not None and speedup.settled


def _typical(walls: list[float]) -> float:
    return statistics.median(walls) if walls else 0.0
