"""The worker trial: the user's loader timed as it is, and the worker count picked by
timing each candidate on a fresh epoch, with every RNG put back afterwards. Under torchrun
both timings are the ranks' mean (`lockstep.mean_of`), so every rank decides alike.

The trial's loaders keep their workers between the warm-up and the timed epoch
(`persistent_workers`) so the timed epoch is the steady state; the fix itself never does
(see `WORKER_OVERRIDES`), and the measured runs count each epoch's worker start."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from ...distributed import lockstep
from ...kernel.state import _RNGState

if TYPE_CHECKING:
    from ...probe.observation import LoaderUse
    from .rebuild import LoaderPlan

TRIAL_BUDGET_S = 3.0  # picking the worker count, all candidates together
IN_PROCESS_BUDGET_S = 0.5  # re-timing the loader as it is, without instrumentation
MAX_WORKERS = 8


@dataclass
class Trial:
    """How one worker count did in the quick trial (or why it failed)."""

    workers: int
    startup_s: float = 0.0
    per_batch_s: float | None = None
    error: str | None = None


def trial_overrides(workers: int) -> dict[str, Any]:
    """The settings of a trial loader with `workers`: its workers kept from the warm-up
    epoch to the timed one."""
    return {"num_workers": workers, "persistent_workers": True}


@contextlib.contextmanager
def _rng_kept(loader: DataLoader) -> Iterator[None]:
    """Trial iterations draw shuffle orders and seeds: put every RNG back afterwards."""
    owners = [loader, loader.sampler, getattr(loader.batch_sampler, "sampler", None)]
    generators = [
        g for g in (getattr(o, "generator", None) for o in owners) if isinstance(g, torch.Generator)
    ]
    saved = _RNGState.capture(generators)
    try:
        yield
    finally:
        saved.restore()


def _timed_epoch(loader: DataLoader, batches: int, budget_s: float) -> float | None:
    """Seconds per batch over (up to) `batches` of a fresh epoch, stopping at the budget.

    The epoch is started before the clock: with persistent workers, starting it first
    waits for the batches the previous (cut-short) epoch still had in flight, prefetch
    factor x workers of them. Timed, that drain made a worker count read about as slow as
    loading in the main process (2 workers 34.3 ms/batch against 34.4 ms in-process, where
    a fresh epoch's batches came every 17 ms)."""
    iterator = iter(loader)
    start, done = time.perf_counter(), 0
    for _ in iterator:
        done += 1
        if done >= batches or time.perf_counter() - start > budget_s:
            break
    if not done:
        return None
    return (time.perf_counter() - start) / done


def _time_loader(loader: DataLoader, batches: int, budget_s: float) -> Trial:
    """Start-up (to the first batch), the rest of that warm-up epoch, then a timed epoch on
    the warm workers as the cell will see them; each epoch stops at half the budget."""
    trial = Trial(loader.num_workers)
    start = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    trial.startup_s = time.perf_counter() - start
    for done, _ in enumerate(iterator, 2):
        if done >= batches or time.perf_counter() - start > budget_s / 2:
            break
    trial.per_batch_s = _timed_epoch(loader, batches, budget_s / 2)
    return trial


def in_process(loader: DataLoader, batches: int) -> float | None:
    """Seconds per batch of the user's own loader, timed without the probe's
    instrumentation (which inflates cheap loaders: every indexing op is recorded), RNG put
    back afterwards."""
    with _rng_kept(loader):
        per_batch_s = _timed_epoch(loader, batches, IN_PROCESS_BUDGET_S)
    return lockstep.mean_of([per_batch_s])[0]


def worker_candidates(batches: int, cores: int) -> list[int]:
    """Worker counts worth a trial: 1, 2 and the cores this process may use, never more.
    Each worker is a process keeping a core busy, and torch warns in the user's cell above
    the CPUs the process may use (the cores counted here are never more): a fix handed
    back must not make it warn, even where loading waits on I/O and more workers would
    overlap more of the waits. Never more workers than the batches there are to load."""
    within = max(1, min(cores, MAX_WORKERS, batches))
    return sorted({k for k in (1, 2, cores) if k <= within})


def pick_workers(
    plan: LoaderPlan, use: LoaderUse, cores: int, seconds: float
) -> tuple[int | None, list[Trial]]:
    """Time each candidate worker count on a fresh epoch, within `seconds` in all; keep the
    fastest and stop every trial loader's workers (the fix builds its own loader, without
    persistent workers).

    Ties within 5% go to fewer workers (less memory, fewer processes).
    """
    candidates = worker_candidates(use.batches, cores)
    budget = seconds / len(candidates)
    trials = []
    with _rng_kept(plan.original):
        for k in candidates:
            try:
                trials.append(
                    _time_loader(plan.loader_for(trial_overrides(k)), use.batches, budget)
                )
            except Exception as error:
                trials.append(Trial(k, error=f"{type(error).__name__}: {error}"))
            plan.discard(trial_overrides(k))
    for each, agreed in zip(trials, lockstep.mean_of([t.per_batch_s for t in trials]), strict=True):
        each.per_batch_s = agreed
    timed = [t for t in trials if t.per_batch_s is not None]
    if not timed:
        return None, trials
    fastest = min(t.per_batch_s for t in timed if t.per_batch_s is not None)
    best = min(
        (t for t in timed if t.per_batch_s is not None and t.per_batch_s <= 1.05 * fastest),
        key=lambda t: t.workers,
    )
    return best.workers, trials
