"""Honest timing: warm-up apart, configurations interleaved, median and IQR.

Each configuration (baseline, each fix set) is a callable doing one run of the cell and
returning its seconds: the whole run, or per step when runs are sampled (set-up such as
state restore happens outside the timed region). Runs go round-robin A B C A B C …, rotating
the start, so machine drift lands on every configuration alike; statistics come from
`torch.utils.benchmark.Measurement`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.utils.benchmark import Measurement as _BenchMeasurement
from torch.utils.benchmark.utils.common import TaskSpec

from ..report import is_noisy

Progress = Callable[[float, str], None]  # (fraction done 0..1, message)
RunDone = Callable[[str, "Measurement"], None]  # after each run: (label, its measurement)

MIN_ROUNDS = 5
MAX_ROUNDS = 60
SETTLED_SPREAD = 0.03  # stop early once every IQR/median is below this
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


def interleaved(
    runners: dict[str, Callable[[], float]],
    budget_s: float,
    progress: Progress | None = None,
    min_rounds: int = MIN_ROUNDS,
    on_run: RunDone | None = None,
    round_s: float | None = None,
    begun: dict[str, Measurement] | None = None,
) -> dict[str, Measurement]:
    """Time every runner round-robin until the spread settles or the budget is spent;
    `on_run` sees each measurement grow, so numbers can be shown as they come in, and
    `round_s` (a guess at one round's seconds) lets progress say "round 1 of n" from the start.
    `begun` holds measurements with rounds already taken (one run each per round).

    At least two rounds always run, so a median exists even on a tiny budget.
    """
    labels = list(runners)
    results = {label: (begun or {}).get(label) or Measurement(label) for label in labels}
    first_round = min((m.runs for m in results.values()), default=0)
    deadline = time.perf_counter() + budget_s
    started = time.perf_counter()
    expected = min_rounds
    if round_s:
        expected = max(2, min(MAX_ROUNDS, first_round + int(budget_s / round_s)))
    for round_index in range(first_round, MAX_ROUNDS):
        offset = round_index % len(labels)
        for position, label in enumerate(labels[offset:] + labels[:offset]):
            if progress is not None:
                done = round_index + position / len(labels)
                progress(
                    min(1.0, done / expected),
                    f"round {round_index + 1} of {expected}: {label}",
                )
            results[label].times.append(runners[label]())
            if on_run is not None:
                on_run(label, results[label])
        done_rounds = round_index + 1
        now = time.perf_counter()
        per_round = (now - started) / (done_rounds - first_round)
        left = int(max(0.0, deadline - now) / max(per_round, 1e-9))
        expected = max(2, min(MAX_ROUNDS, done_rounds + left))
        if done_rounds < 2:
            continue
        settled = all(m.spread <= SETTLED_SPREAD for m in results.values())
        if done_rounds >= min_rounds and settled:
            break
        if now + per_round > deadline:
            break
    return results
