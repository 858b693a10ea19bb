"""Rebuilding a user's DataLoader with other settings, and the one plan per loader that
rebinds it.

A rebuilt loader keeps the user's dataset, sampler, settings and extra attributes; the plan
rebinds the loader built from the union of the applied fixes' settings, so fixes compose
and undo in any order and undo puts back the very object the user built.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ...kernel import fixes
from ...kernel.fixes import Fix

if TYPE_CHECKING:
    from ...kernel.discovery import Location


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


class LoaderPlan:
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


_PLANS: weakref.WeakValueDictionary[int, LoaderPlan] = weakref.WeakValueDictionary()


def plan_for(loader: DataLoader, locations: list[Location]) -> LoaderPlan:
    """The one plan of this loader (shared by its fixes, so their changes merge)."""
    plan = _PLANS.get(id(loader))
    if plan is None or plan.original is not loader:
        plan = _PLANS[id(loader)] = LoaderPlan(loader, locations)
    return plan
