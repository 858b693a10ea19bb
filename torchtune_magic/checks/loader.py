"""DataLoader checks: batches loaded in the main process, pageable host memory.

Guide sections: "Enable asynchronous data loading and augmentation" (num_workers > 0) and
"Use pinned memory buffers" (pin_memory=True with non_blocking copies). Both fixes rebuild
the user's loader with the same dataset, sampler and settings and rebind it wherever the
namespace holds it. They go through one `_LoaderPlan` per loader, which rebinds the loader
built from the union of the applied fixes' settings, so the two compose and undo in any
order and undo always puts back the very object the user built.
"""

from __future__ import annotations

import ast
import contextlib
import io
import pickle
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..engine import codeedit, cpu, fixes, frameworks, history, steps
from ..engine.fixes import Fix, Patcher
from ..engine.state import _RNGState
from ..report import CodeChange
from .base import Check, Detection

if TYPE_CHECKING:
    from ..engine.discovery import Location
    from ..engine.probe import LoaderUse, Observation

WAIT_SHARE = 0.05  # torch-tb-profiler's threshold for "data loading is a bottleneck"
# Handing a batch from a worker to the main process costs on the order of a millisecond
# (pickling through shared memory, a queue round trip): a loader that already delivers a
# batch faster than this cannot gain from workers, whatever its share of the cell.
MIN_BATCH_WAIT_S = 0.001
TRIAL_BUDGET_S = 3.0  # picking the worker count, all candidates together
IN_PROCESS_BUDGET_S = 0.5  # re-timing the loader as it is, without instrumentation
MAX_WORKERS = 8
# Loading that kept the main process busy for less than this share of the time it took
# waits on something other than the CPU (storage, network): workers overlap such waits, so
# more of them than there are cores can still help (then measured, and said). Measured
# here: items sleeping 2 ms (tests' SlowDataset) kept it 3-7% busy, the demo's images (a
# 2 ms read, then numpy decoding) 20%, pure-Python work per item (BusyDataset) 99%.
IO_BOUND_CPU_SHARE = 0.5
POSITIONAL = {"num_workers": 5, "pin_memory": 7}  # DataLoader's positional parameters
WORKERS_CAVEAT = (
    "workers hold a copy of the dataset made when they start: later changes to the dataset "
    "are not seen until the loader is rebuilt; random augmentation inside the dataset draws "
    "from per-worker seeds, so its random numbers differ from the in-process run"
)


TRAINER_WORKERS_CAVEAT = (
    "; with dataloader_persistent_workers=True torch draws the workers' base seed from the "
    "global random stream for the first epoch of each train() only, so from the second "
    "epoch on dropout and shuffling draw numbers one place apart from a run without "
    "workers: results differ as with another seed, not in quality"
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _lines_text(lines: set[int] | list[int]) -> str:
    ordered = sorted(lines)
    return ("line " if len(ordered) == 1 else "lines ") + ", ".join(map(str, ordered))


# rebuilding a loader --------------------------------------------------------------------------


def constructor_kwargs(loader: DataLoader) -> dict[str, Any]:
    """Everything the user set on `loader`, as DataLoader keyword arguments."""
    kwargs: dict[str, Any] = {
        "dataset": loader.dataset,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,
    }
    if isinstance(loader.dataset, IterableDataset):
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is None and loader.batch_sampler is not None:
        kwargs["batch_sampler"] = loader.batch_sampler  # the user's own batch sampler
    else:
        kwargs.update(
            sampler=loader.sampler, batch_size=loader.batch_size, drop_last=loader.drop_last
        )
    return kwargs


_SAME_RNG_CLASSES: dict[type, type] = {}


def _same_rng_class(cls: type) -> type:
    """`cls` whose reused persistent workers consume the RNG like a fresh iterator does.

    torch draws a worker base seed from the RNG for every new iterator but skips the draw
    when persistent workers are reused, which would shift every later random number (the
    shuffle order, dropout) against the original loader. Drawing it anyway keeps the cell's
    random stream, so numerics compare like with like.
    """
    made = _SAME_RNG_CLASSES.get(cls)
    if made is None:
        base_iter = cls.__iter__

        def __iter__(self: DataLoader) -> Any:
            if getattr(self, "_iterator", None) is not None:
                torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            return base_iter(self)

        made = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__})
        made.__qualname__ = cls.__qualname__
        _SAME_RNG_CLASSES[cls] = made
    return made


def rebuild(loader: DataLoader, overrides: dict[str, Any]) -> DataLoader:
    """A loader like `loader` (same class, dataset, sampler, … and the user's own extra
    attributes) with `overrides` applied."""
    kwargs = constructor_kwargs(loader)
    kwargs.update(overrides)
    if not kwargs["num_workers"]:
        kwargs.update(prefetch_factor=None, persistent_workers=False)
    cls = type(loader)
    if kwargs["persistent_workers"]:
        cls = _same_rng_class(cls)
    new = cls.__new__(cls)
    DataLoader.__init__(new, **kwargs)
    for name, value in vars(loader).items():
        if name not in vars(new):
            object.__setattr__(new, name, value)
    return new


def shutdown(loader: DataLoader) -> None:
    """Stop a loader's persistent workers now (torch would only do so when it is freed)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        loader._iterator = None
        shut = getattr(iterator, "_shutdown_workers", None)
        if shut is not None:
            shut()


def _shutdown_all(loaders: dict[Any, DataLoader]) -> None:
    for loader in list(loaders.values()):
        shutdown(loader)
    loaders.clear()


class _LoaderPlan:
    """The rebuilt versions of one user loader and which applied fix wants which settings.

    Rebinding always targets the loader built from the union of the wanted settings (the
    original when none), so fixes compose and undo in any order. Rebuilt loaders are cached;
    their workers are shut down when the plan is closed or garbage-collected (the session
    and its fixes are gone) and at interpreter exit.
    """

    def __init__(self, original: DataLoader, locations: list[Location]):
        self.original = original
        self.locations = locations
        self.variants: dict[tuple[tuple[str, Any], ...], DataLoader] = {}
        self.wanted: dict[int, dict[str, Any]] = {}
        self._finalizer = weakref.finalize(self, _shutdown_all, self.variants)

    def loader_for(self, overrides: dict[str, Any]) -> DataLoader:
        if not overrides:
            return self.original
        key = tuple(sorted(overrides.items()))
        loader = self.variants.get(key)
        if loader is None:
            loader = self.variants[key] = rebuild(self.original, overrides)
        return loader

    def discard(self, overrides: dict[str, Any]) -> None:
        """Shut down and forget one variant (a worker count not chosen)."""
        loader = self.variants.pop(tuple(sorted(overrides.items())), None)
        if loader is not None:
            shutdown(loader)

    def want(self, fix: Fix, overrides: dict[str, Any], namespace: dict[str, Any]) -> None:
        """Rebind to the loader with `fix`'s settings added. Raises `fixes.Rebound`, before
        changing anything, where a place no longer holds the plan's loader (the user bound
        a loader of their own there since the probe ran)."""
        current = self._current()
        for location in self.locations:
            fixes.expect(namespace, location, current)
        self.wanted[id(fix)] = overrides
        self._rebind(namespace, current, [])

    def drop(self, fix: Fix, namespace: dict[str, Any], notes: list[str]) -> None:
        """Rebind to the loader without `fix`'s settings, except where the user has bound
        another object since (left there, with a note in `notes`)."""
        current = self._current()
        self.wanted.pop(id(fix), None)
        self._rebind(namespace, current, notes)

    def _current(self) -> DataLoader:
        """The loader the plan has put in place: built from every wanted setting."""
        merged: dict[str, Any] = {}
        for overrides in self.wanted.values():
            merged.update(overrides)
        return self.loader_for(merged)

    def _rebind(self, namespace: dict[str, Any], current: DataLoader, notes: list[str]) -> None:
        target = self._current()
        for location in self.locations:
            note = fixes.replace_held(namespace, location, current, target)
            if note is not None:
                notes.append(note)

    def close(self) -> None:
        """Stop every rebuilt loader's workers; a later fix gets a fresh plan."""
        if _PLANS.get(id(self.original)) is self:
            del _PLANS[id(self.original)]
        self._finalizer()


_PLANS: weakref.WeakValueDictionary[int, _LoaderPlan] = weakref.WeakValueDictionary()


def plan_for(loader: DataLoader, locations: list[Location]) -> _LoaderPlan:
    """The one plan of this loader (shared by its fixes, so their changes merge)."""
    plan = _PLANS.get(id(loader))
    if plan is None or plan.original is not loader:
        plan = _PLANS[id(loader)] = _LoaderPlan(loader, locations)
    return plan


# worker feasibility and the worker count ---------------------------------------------------------


class _MainFinder(pickle.Pickler):
    """Pickles into nothing, noting objects whose class or function lives in `__main__`."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.main_names: set[str] = set()

    def persistent_id(self, obj: Any) -> None:
        owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        if getattr(owner, "__module__", None) == "__main__":
            self.main_names.add(getattr(owner, "__qualname__", repr(owner)))
        return None


def why_no_workers(loader: DataLoader) -> str | None:
    """Why worker processes cannot load this loader's data, or None when they can.

    Under fork (Linux's default) workers inherit the dataset; under spawn/forkserver it is
    pickled, and a class defined in the notebook (`__main__`) cannot be found by a worker.
    """
    if isinstance(loader.dataset, IterableDataset):
        return (
            "its dataset is an IterableDataset: with workers each one yields the whole stream "
            "unless the dataset splits it with torch.utils.data.get_worker_info(), so the fix "
            "is not applied automatically"
        )
    context = loader.multiprocessing_context or torch.multiprocessing.get_context()
    method = context.get_start_method()
    if method == "fork":
        return None
    finder = _MainFinder()
    try:
        finder.dump((loader.dataset, loader.collate_fn, loader.worker_init_fn))
    except Exception as error:
        return (
            f"workers start with '{method}', which pickles the dataset, and it cannot be "
            f"pickled ({type(error).__name__}: {error})"
        )
    if finder.main_names:
        names = ", ".join(sorted(finder.main_names))
        return (
            f"workers start with '{method}' and re-import classes by module, but {names} "
            "is defined in the notebook (__main__): move it to a .py module and import it"
        )
    return None


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
        return _timed_epoch(loader, batches, IN_PROCESS_BUDGET_S)


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
    plan: _LoaderPlan, use: LoaderUse, loading: Epoch, cores: int, seconds: float
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


# source edits -----------------------------------------------------------------------------


def with_keywords(source: str, line: int, names: set[str], values: dict[str, str]) -> str:
    """The text with the DataLoader call of `names` at `line` given these keyword values
    (replacing a keyword or DataLoader positional argument already there, else appending)."""
    return codeedit.with_keywords(source, line, names, values, POSITIONAL)


def _earlier_edit(
    obs: Observation, target: _Target, values: dict[str, str]
) -> history.CallEdit | None:
    """The loader's constructor call in the earlier cell that built it, given `values`."""
    for location in target.locations:
        path = history.location_path(location)
        if path is None:
            continue
        workload = obs.workload
        edit = history.keyword_edit(workload.notebook, workload.namespace, path, values, POSITIONAL)
        if edit is not None:
            return edit
    return None


def _class_names(loader: DataLoader) -> set[str]:
    return {"DataLoader", type(loader).__name__}


# the checks ---------------------------------------------------------------------------------


@dataclass
class _Target:
    """Where a loader lives and how a fix can reach it."""

    use: LoaderUse
    name: str
    locations: list[Location]
    cell_call: ast.Call | None  # its constructor call in the cell, if built there
    unreachable: str | None  # why a live fix cannot reach it, if it cannot
    # a Hugging Face Trainer from an earlier cell that builds the loader from its arguments
    # on each call (`trainer.train()`): fixes go through those arguments
    trainer: frameworks.HFTrainer | None = None


def _target(obs: Observation, use: LoaderUse) -> _Target:
    loader = use.loader
    locations = obs.lasting_locations(loader)
    name = str(locations[0]) if locations else f"a {type(loader).__name__}"
    cell_call = None
    unreachable = None
    if use.built_in_cell:
        if use.built_line is not None:
            cell_call = codeedit.call_at(obs.tree, use.built_line, _class_names(loader))
        owner = None
        if cell_call is None:
            owner = frameworks.hf_owner(obs.workload.namespace, obs.names_before, loader)
        if owner is not None:
            name = f"the DataLoader {owner.name} builds from {owner.name}.args (Hugging Face)"
            return _Target(use, name, [], None, None, owner)
        if cell_call is None:
            where = f" at cell line {use.built_line}" if use.built_line else ""
            unreachable = (
                f"the loader is built by code the cell calls{where}, so every run makes a "
                "new one: change that constructor"
            )
    elif not locations:
        unreachable = "no notebook name reaches the loader, so it cannot be swapped"
    elif not all(location.rebindable for location in locations):
        unreachable = (
            "the loader is held as a local variable of a running generator, which cannot be "
            "rebound from outside: change its constructor and restart the generator"
        )
    return _Target(use, name, locations, cell_call, unreachable)


class _LoaderFix(Fix):
    """Rebind a loader to its rebuilt version with `overrides`, or, for a loader the cell
    builds itself, edit its constructor call (and copy lines) in the cell."""

    def __init__(
        self,
        overrides: dict[str, Any],
        plan: _LoaderPlan | None,
        cell_edit: Callable[[str], str] | None,
    ):
        super().__init__()
        self.overrides = overrides
        self.plan = plan
        self.cell_edit = cell_edit

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        plan = self.plan
        if plan is not None:
            patcher.call(
                lambda: plan.want(self, self.overrides, namespace),
                lambda: plan.drop(self, namespace, patcher.notes),
            )

    def edit_source(self, source: str) -> str:
        return self.cell_edit(source) if self.cell_edit is not None else source


class WorkersFix(_LoaderFix):
    check_id = "dataloader-workers"
    one_time_cause = "worker start"
    one_time_guess_s = 1.0  # a few worker processes forked, their first batches loaded

    @property
    def warmup_steps(self) -> int:
        original = self.plan.original if self.plan else None
        factor = original.prefetch_factor if original is not None else None
        return steps.prefetch_depth(self.overrides["num_workers"], factor)


class PinMemoryFix(_LoaderFix):
    check_id = "pin-memory"


class _TrainerArgsFix(Fix):
    """Swap a Hugging Face Trainer's arguments for a copy with `overrides` (through the
    trainer's `ArgsPlan`, shared with its other loader fixes): the Trainer reads them each
    time it builds its DataLoader, on every `train()`. Refused when the notebook name no
    longer holds the Trainer the probe saw."""

    def __init__(self, overrides: dict[str, Any], plan: frameworks.ArgsPlan):
        super().__init__()
        self.overrides = overrides
        self.plan = plan
        self.seen = [(plan.owner.location, plan.owner.trainer)]

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        plan = self.plan
        patcher.call(
            lambda: plan.want(self, self.overrides, namespace),
            lambda: plan.drop(self, namespace, patcher.notes),
        )


class TrainerWorkersFix(_TrainerArgsFix):
    check_id = "dataloader-workers"
    one_time_cause = "worker start"
    one_time_guess_s = 1.0  # a few worker processes forked, their first batches loaded

    @property
    def warmup_steps(self) -> int:
        factor = getattr(self.plan.original, "dataloader_prefetch_factor", None)
        return steps.prefetch_depth(self.overrides["dataloader_num_workers"], factor)


class TrainerPinMemoryFix(_TrainerArgsFix):
    check_id = "pin-memory"


def _trials_text(trials: list[Trial]) -> str:
    parts = []
    for trial in trials:
        label = f"{trial.workers} worker{'s' if trial.workers > 1 else ''}"
        if trial.per_batch_s is not None:
            parts.append(f"{label} {_ms(trial.per_batch_s)}/batch")
        else:
            parts.append(f"{label} failed ({trial.error})")
    return "; ".join(parts)


def _cores_text(trials: list[Trial], loading: Epoch, cores: cpu.Cores) -> str:
    """Why the trial went up to the counts it did: the cores this process may use, and
    beyond them only for loading that waits on I/O (with the measurement that says so)."""
    text = f"workers tried up to the {cores.count} cores this process may use ({cores.detail})"
    above = [t.workers for t in trials if t.workers > cores.count]
    if above:
        text += (
            f", and {above[0]} because the loading waits on I/O: it kept the main process "
            f"busy {loading.cpu_share:.0%} of the time, and workers overlap such waits beyond "
            "the core count"
        )
    return text


class WorkersCheck(Check):
    id = "dataloader-workers"
    title = "Batches are loaded in the main process (num_workers=0) while the cell waits"
    guide = "Enable asynchronous data loading and augmentation"
    threshold = (
        f"waiting for batches ≥ {WAIT_SHARE:.0%} of the cell's time (torch-tb-profiler's "
        f"bar) and ≥ {MIN_BATCH_WAIT_S * 1e3:.0f} ms per batch (about a worker's hand-off)"
    )

    def detect(self, obs: Observation) -> list[Detection]:
        detections = []
        for use in obs.loaders.values():
            if use.loader.num_workers != 0 or not use.batches or not obs.wall_s:
                continue
            share = use.wait_s / obs.wall_s
            if share < WAIT_SHARE:
                continue
            loading = in_process(use.loader, use.batches)
            if loading is None or loading.per_batch_s < MIN_BATCH_WAIT_S:
                continue  # cheap loading (in-memory tensors): workers would only add IPC
            detections.append(self._detection(obs, use, share, loading))
        return detections

    def _detection(
        self, obs: Observation, use: LoaderUse, share: float, loading: Epoch
    ) -> Detection:
        loader = use.loader
        target = _target(obs, use)
        evidence = (
            f"batches waited {use.wait_s:.2f} s of {obs.wall_s:.2f} s ({share:.0%}) over "
            f"{use.batches} batches, loaded in the main process ({_ms(loading.per_batch_s)} "
            "per batch timed without instrumentation)"
        )
        blocked = why_no_workers(loader)
        workers = None
        plan = None
        cores = cpu.available_cores()
        if blocked is None:
            plan = plan_for(loader, target.locations)
            seconds = obs.trial_time(TRIAL_BUDGET_S)
            workers, trials = pick_workers(plan, use, loading, cores.count, seconds)
            evidence += (
                f"; quick trial: {_trials_text(trials)}; {_cores_text(trials, loading, cores)}"
            )
            if workers is None:
                blocked = "no worker count could load a batch in the trial"
            else:
                startup = next(t.startup_s for t in trials if t.workers == workers)
                evidence += f"; {workers} chosen (start-up {startup:.2f} s, once)"
        reason = target.unreachable or blocked
        shown_k = workers if workers is not None else min(2, cores.count)
        if target.trainer is not None:
            if plan is not None:
                plan.close()  # the trial's loaders: the Trainer builds its own from its args
            return self._trainer_detection(obs, target, evidence, workers, shown_k, reason)
        values = {"num_workers": str(shown_k), "persistent_workers": "True"}
        source = obs.workload.source
        fixed = None
        elsewhere = []
        cell_edit = None
        if target.cell_call is not None and use.built_line is not None:
            line, names = use.built_line, _class_names(loader)

            def cell_edit(text: str) -> str:
                return with_keywords(text, line, names, values)

            fixed = cell_edit(source)
        earlier = _earlier_edit(obs, target, values) if target.cell_call is None else None
        if target.cell_call is None and earlier is None:
            elsewhere.append(
                f"{target.name}: build it with {type(loader).__name__}(..., "
                f"num_workers={shown_k}, persistent_workers=True)"
            )
        fix = None
        if reason is not None:
            evidence += f"; not applied live: {reason}"
        elif workers is not None:
            overrides = {"num_workers": workers, "persistent_workers": True}
            # a loader the cell builds itself is changed in the cell text, not swapped
            fix = WorkersFix(overrides, None if cell_edit else plan, cell_edit)
        if plan is not None and (fix is None or fix.plan is None):
            plan.close()  # no live swap will use the trial loaders: stop their workers
        where = target.name
        if use.lines:
            where += f", iterated at cell {_lines_text(use.lines)}"
        return Detection(
            self.finding(
                evidence=evidence,
                where=where,
                fixable=fix is not None,
                line=use.built_line or (min(use.lines) if use.lines else None),
                caveat=WORKERS_CAVEAT,
                code_change=CodeChange(
                    codeedit.unified_diff(source, fixed) if fixed else "", elsewhere
                ),
            ),
            fix,
            fixed,
            [earlier] if earlier else [],
        )

    def _trainer_detection(
        self,
        obs: Observation,
        target: _Target,
        evidence: str,
        workers: int | None,
        shown_k: int,
        reason: str | None,
    ) -> Detection:
        """A loader a Hugging Face Trainer builds: found, fixed and changed through its
        `TrainingArguments`."""
        owner = target.trainer
        assert owner is not None
        use = target.use
        values = {"dataloader_num_workers": str(shown_k), "dataloader_persistent_workers": "True"}
        evidence += (
            f"; {owner.name} builds this loader on every call from its arguments, "
            f"{owner.args_class}(dataloader_num_workers={use.loader.num_workers})"
        )
        earlier = frameworks.args_edit(obs.workload, owner, values)
        elsewhere = [] if earlier else [f"{owner.name}'s arguments: {owner.call_text(values)}"]
        fix = None
        if reason is not None:
            evidence += f"; not applied live: {reason}"
        elif workers is not None:
            overrides = {"dataloader_num_workers": workers, "dataloader_persistent_workers": True}
            fix = TrainerWorkersFix(overrides, frameworks.args_plan(owner))
        where = target.name
        if use.lines:
            where += f", iterated at cell {_lines_text(use.lines)}"
        return Detection(
            self.finding(
                evidence=evidence,
                where=where,
                fixable=fix is not None,
                line=min(use.lines) if use.lines else None,
                caveat=WORKERS_CAVEAT + TRAINER_WORKERS_CAVEAT,
                code_change=CodeChange("", elsewhere),
            ),
            fix,
            None,
            [earlier] if earlier else [],
        )


def _non_blocking(source: str, lines: set[int]) -> str:
    """`.to(...)` / `.cuda(...)` calls on these cell lines, given non_blocking=True."""
    for line in sorted(lines):
        tree = ast.parse(source)
        for call in codeedit.calls_named(tree, {"to", "cuda"}):
            if call.lineno == line and not any(k.arg == "non_blocking" for k in call.keywords):
                source = with_keywords(source, line, {"to", "cuda"}, {"non_blocking": "True"})
                break
    return source


class PinMemoryCheck(Check):
    id = "pin-memory"
    title = "Batches are copied to the GPU from pageable memory (pin_memory=False)"
    guide = "Use pinned memory buffers"
    devices = ("cuda",)

    def detect(self, obs: Observation) -> list[Detection]:
        detections = []
        for use in obs.loaders.values():
            if use.loader.pin_memory or not use.device_copies:
                continue
            detections.append(self._detection(obs, use))
        return detections

    def _detection(self, obs: Observation, use: LoaderUse) -> Detection:
        loader = use.loader
        target = _target(obs, use)
        if target.trainer is not None:
            return self._trainer_detection(obs, target)
        source = obs.workload.source
        copy_lines = set(use.copy_lines)

        def cell_edit(text: str) -> str:
            if target.cell_call is not None and use.built_line is not None:
                text = with_keywords(
                    text, use.built_line, _class_names(loader), {"pin_memory": "True"}
                )
            return _non_blocking(text, copy_lines)

        fixed = cell_edit(source)
        elsewhere = []
        earlier = None
        if target.cell_call is None:
            earlier = _earlier_edit(obs, target, {"pin_memory": "True"})
        if target.cell_call is None and earlier is None:
            elsewhere.append(
                f"{target.name}: build it with {type(loader).__name__}(..., pin_memory=True)"
            )
        if not copy_lines:
            elsewhere.append("copy batches with .to(device, non_blocking=True)")
        fix = None
        if target.unreachable is None:
            plan = None if target.cell_call is not None else plan_for(loader, target.locations)
            fix = PinMemoryFix({"pin_memory": True}, plan, cell_edit)
        evidence = (
            f"{use.device_copies} batch tensors from {use.batches} batches were copied to the "
            f"GPU from pageable memory ({use.non_blocking_copies} with non_blocking=True)"
        )
        if target.unreachable is not None:
            evidence += f"; not applied live: {target.unreachable}"
        where = target.name
        if copy_lines:
            where += f", copied at cell {_lines_text(copy_lines)}"
        return Detection(
            self.finding(
                evidence=evidence,
                where=where,
                fixable=fix is not None,
                line=min(copy_lines) if copy_lines else use.built_line,
                caveat="pinned memory is page-locked host RAM: very large pinned batches "
                "reduce the memory left to the rest of the system",
                code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
            ),
            fix,
            fixed,
            [earlier] if earlier else [],
        )

    def _trainer_detection(self, obs: Observation, target: _Target) -> Detection:
        """A Hugging Face Trainer's loader: pinned through `dataloader_pin_memory`, its
        copies made non-blocking through accelerate's `non_blocking` setting."""
        owner = target.trainer
        assert owner is not None
        use = target.use
        values = {"dataloader_pin_memory": "True"}
        earlier = frameworks.args_edit(obs.workload, owner, values)
        elsewhere = [] if earlier else [f"{owner.name}'s arguments: {owner.call_text(values)}"]
        elsewhere.append(
            "the Trainer copies batches itself: "
            f"{owner.args_class}(..., accelerator_config={{'non_blocking': True}}) makes those "
            "copies non-blocking"
        )
        evidence = (
            f"{use.device_copies} batch tensors from {use.batches} batches were copied to the "
            f"GPU from pageable memory ({use.non_blocking_copies} with non_blocking=True); "
            f"{owner.name} builds this loader on every call from "
            f"{owner.args_class}(dataloader_pin_memory=False)"
        )
        return Detection(
            self.finding(
                evidence=evidence,
                where=target.name,
                fixable=True,
                line=min(use.lines) if use.lines else None,
                caveat="pinned memory is page-locked host RAM: very large pinned batches "
                "reduce the memory left to the rest of the system",
                code_change=CodeChange("", elsewhere),
            ),
            TrainerPinMemoryFix({"dataloader_pin_memory": True}, frameworks.args_plan(owner)),
            None,
            [earlier] if earlier else [],
        )
