"""The most a fix that saves passes over memory can win, timed on this machine.

Some fixes take away elementwise work only: a conv bias that BatchNorm cancels (its add in
the forward, its reduction in the backward), gradients zeroed in place (a fill and the
first accumulation's read). What they save is at most that many passes over tensors of
known sizes, so the plan can bound their gain (`Fix.bounded_by`) and skip timing one that
cannot pass the no-change band, leaving the budget to fixes that can.

The bound leans towards the fix on both sides: each pass is timed as an `add_` (two reads
and a write, at least what a fill, an add of a broadcast bias or a reduction costs), and
doubled; the run it is a share of is the probe's instrumented run made PROBE_SLOWDOWN_MOST
times shorter than it was (the probe runs about 2x slower than the plain cell:
`measuring/plan.PROBE_SLOWDOWN`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch

PASS_SAFETY = 2.0  # what the timed passes are multiplied by
PROBE_SLOWDOWN_MOST = 4.0  # the probe's run is taken to be at most this much slower
TIMED_ELEMENTS_MOST = 1 << 22  # passes over more are timed on this many, then scaled
REPEATS = 3  # the fastest of this many timings


def passes_s(elements: int, passes: int, dtype: torch.dtype = torch.float32) -> float:
    """Seconds for `passes` elementwise passes over `elements` values of `dtype` here."""
    if elements <= 0 or passes <= 0:
        return 0.0
    timed = min(elements, TIMED_ELEMENTS_MOST)
    with torch.no_grad():
        target = torch.zeros(timed, dtype=dtype)
        other = torch.ones(timed, dtype=dtype)
        target.add_(other)  # first touch of the pages: not what a warm pass costs
        best = math.inf
        for _ in range(REPEATS):
            started = time.perf_counter()
            target.add_(other)
            best = min(best, time.perf_counter() - started)
    return best * passes * elements / timed


def share_of_run(saved_s: float, probe_wall_s: float) -> float | None:
    """The largest share of a plain run `saved_s` can be (None: no run to compare)."""
    if probe_wall_s <= 0:
        return None
    return min(1.0, PASS_SAFETY * saved_s / (probe_wall_s / PROBE_SLOWDOWN_MOST))


def elements_of(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)
