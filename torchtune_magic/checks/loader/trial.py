"""The worker trial: the user's loader timed as it is, and the worker count picked by
timing each candidate on a fresh epoch, with every RNG put back afterwards. Under torchrun
both timings are the ranks' mean (`lockstep.mean_of`), so every rank decides alike."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
# Loading that kept the main process busy for less than this share of the time it took
# waits on something other than the CPU (storage, network): workers overlap such waits, so
# more of them than there are cores can still help (then measured, and said). Measured
# here: items sleeping 2 ms (tests' SlowDataset) kept it 3-7% busy, the demo's images (a
# 2 ms read, then numpy decoding) 20%, pure-Python work per item (BusyDataset) 99%.
IO_BOUND_CPU_SHARE = 0.5


@dataclass
class Trial:
    """How one worker count did in the quick trial (or why it failed)."""

    workers: int
    startup_s: float = 0.0
    per_batch_s: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Epoch:
    """Batches drawn from a fresh epoch: seconds per batch, and the share of that time the
    drawing process was busy (well under 1: it waited on I/O)."""

    per_batch_s: float
    cpu_share: float

    @property
    def io_bound(self) -> bool:
        return self.cpu_share < IO_BOUND_CPU_SHARE


SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _busy_s() -> tuple[float, float | None]:
    """CPU seconds of the whole process (every thread: a dataset's torch ops may run on
    the intra-op pool), and seconds this thread ran or waited for a CPU (Linux schedstat;
    None elsewhere). On a machine other processes keep busy, CPU-bound loading spends
    much of its time waiting for a core: that is no I/O, and the second clock counts it."""
    try:
        running_ns, waiting_ns = SCHEDSTAT.read_text().split()[:2]
        thread = (int(running_ns) + int(waiting_ns)) / 1e9
    except (OSError, ValueError):
        thread = None
    return time.process_time(), thread


def _busy_share(before: tuple[float, float | None], wall_s: float) -> float:
    """The share of `wall_s` since `before` (a `_busy_s()`) the loading kept busy."""
    process, thread = _busy_s()
    busy = process - before[0]
    if thread is not None and before[1] is not None:
        busy = max(busy, thread - before[1])
    return busy / wall_s if wall_s > 0 else 1.0


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


def _timed_epoch(loader: DataLoader, batches: int, budget_s: float) -> Epoch | None:
    """Seconds per batch over (up to) `batches` of a fresh epoch, stopping at the budget.

    The epoch is started before the clock: with persistent workers, starting it first
    waits for the batches the previous (cut-short) epoch still had in flight, prefetch
    factor x workers of them. Timed, that drain made a worker count read about as slow as
    loading in the main process (2 workers 34.3 ms/batch against 34.4 ms in-process, where
    a fresh epoch's batches came every 17 ms)."""
    iterator = iter(loader)
    busy, start, done = _busy_s(), time.perf_counter(), 0
    for _ in iterator:
        done += 1
        if done >= batches or time.perf_counter() - start > budget_s:
            break
    if not done:
        return None
    wall = time.perf_counter() - start
    return Epoch(wall / done, _busy_share(busy, wall))


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
    epoch = _timed_epoch(loader, batches, budget_s / 2)
    trial.per_batch_s = epoch.per_batch_s if epoch is not None else None
    return trial


def in_process(loader: DataLoader, batches: int) -> Epoch | None:
    """The user's own loader timed without the probe's instrumentation (which inflates
    cheap loaders: every indexing op is recorded), RNG put back afterwards."""
    with _rng_kept(loader):
        epoch = _timed_epoch(loader, batches, IN_PROCESS_BUDGET_S)
    figures = [None, None] if epoch is None else [epoch.per_batch_s, epoch.cpu_share]
    per_batch_s, cpu_share = lockstep.mean_of(figures)
    if per_batch_s is None or cpu_share is None:
        return None
    return Epoch(per_batch_s, cpu_share)


def worker_candidates(batches: int, cores: int, io_bound: bool) -> list[int]:
    """Worker counts worth a trial: 1, 2 and the cores this process may use (each worker
    is a process keeping a core busy, and torch warns above the CPUs it may use); for
    loading that waits on I/O also twice that, since such waits overlap beyond the core
    count. Never more workers than the batches there are to load."""
    within = max(1, min(cores, MAX_WORKERS, batches))
    counts = {k for k in (1, 2, cores) if k <= within}
    if io_bound:
        counts.add(max(1, min(2 * cores, MAX_WORKERS, batches)))
    return sorted(counts)


def pick_workers(
    plan: LoaderPlan, use: LoaderUse, loading: Epoch, cores: int, seconds: float
) -> tuple[int | None, list[Trial]]:
    """Time each candidate worker count on a fresh epoch, within `seconds` in all; keep the
    fastest, stop the rest.

    Ties within 5% go to fewer workers (less memory, fewer processes), so a count above
    the cores is kept only when the trial measured it clearly faster.
    """
    candidates = worker_candidates(use.batches, cores, loading.io_bound)
    budget = seconds / len(candidates)
    trials = []
    with _rng_kept(plan.original), warnings.catch_warnings():
        # torch warns above one worker per CPU; the trial tries more only for loading that
        # waits on I/O, measures whether they help, and the evidence says so
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for k in candidates:
            overrides = {"num_workers": k, "persistent_workers": True}
            try:
                trials.append(_time_loader(plan.loader_for(overrides), use.batches, budget))
            except Exception as error:
                trials.append(Trial(k, error=f"{type(error).__name__}: {error}"))
                plan.discard(overrides)
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
    for trial in trials:
        if trial.workers != best.workers:
            plan.discard({"num_workers": trial.workers, "persistent_workers": True})
    return best.workers, trials
