"""Honest timing: warm-up apart, configurations interleaved, median and IQR.

Each configuration (baseline, each fix set) is a callable doing one complete run of the
cell and returning its wall seconds (set-up such as state restore happens outside the timed
region). Runs go round-robin A B C A B C …, rotating the start, so machine drift lands on
every configuration alike; statistics come from `torch.utils.benchmark.Measurement`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.utils.benchmark import Measurement as _BenchMeasurement
from torch.utils.benchmark.utils.common import TaskSpec

from ..report import NOISE_THRESHOLD

Progress = Callable[[float, str], None]  # (fraction done 0..1, message)

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
        return self.spread > NOISE_THRESHOLD

    @property
    def one_time_s(self) -> float | None:
        """Extra cost of the first run over a steady run (compile, worker start-up), or None
        when the difference is within noise."""
        if self.warmup_s is None or self.median is None:
            return None
        extra = self.warmup_s - self.median
        return extra if extra > max(ONE_TIME_FLOOR_S, 0.1 * self.median) else None


def interleaved(
    runners: dict[str, Callable[[], float]],
    budget_s: float,
    progress: Progress | None = None,
    min_rounds: int = MIN_ROUNDS,
) -> dict[str, Measurement]:
    """Time every runner round-robin until the spread settles or the budget is spent.

    At least two rounds always run, so a median exists even on a tiny budget.
    """
    labels = list(runners)
    results = {label: Measurement(label) for label in labels}
    deadline = time.perf_counter() + budget_s
    started = time.perf_counter()
    for round_index in range(MAX_ROUNDS):
        offset = round_index % len(labels)
        for label in labels[offset:] + labels[:offset]:
            results[label].times.append(runners[label]())
        done_rounds = round_index + 1
        now = time.perf_counter()
        per_round = (now - started) / done_rounds
        if progress is not None:
            expected = max(min_rounds, min(MAX_ROUNDS, int(budget_s / max(per_round, 1e-9))))
            progress(min(1.0, done_rounds / expected), f"round {done_rounds}")
        if done_rounds < 2:
            continue
        settled = all(m.spread <= SETTLED_SPREAD for m in results.values())
        if done_rounds >= min_rounds and settled:
            break
        if now + per_round > deadline:
            break
    return results
