"""Where a run's time goes: waiting for batches, forward, backward, the optimizer, the rest.

The first thing a user wants to know of a slow cell, before any finding: a loader the loop
waits on most of the time calls for other fixes than a backward that dominates. The split
is taken in each configuration's first measuring run from the restored start (the probe's
instrumented run would inflate the forward with its hooks), by timing the outermost call
of each part:

- data wait: `next()` on a DataLoader iterator;
- forward: the outermost module call (a module called inside another is that one's time);
- backward: `Tensor.backward` / `torch.autograd.backward`;
- optimizer: `Optimizer.step` (from its pre-hook to its post-hook);
- host syncs, where a CUDA device is in use: the host waiting for the device in a read
  of a device tensor (`.item()`, `.tolist()`, `.cpu()`) or a `synchronize()` (of the
  device, a stream or an event) called outside the other parts;
- other: the rest of the run (the cell's own Python, metrics, logging, zero_grad).

A part entered inside another (a checkpoint's forward recomputed in the backward, a
module called by the optimizer) counts as the outer part. The times are the host's: on a
CUDA device, kernels queued by the forward may run during a later part: the host sync
that waits for them holds that time (in its own part where the cell calls it between
the others, in the part that calls it otherwise); nothing here synchronizes, since the
first run of a sampled measurement is also timed in its first round.

Recording is patches through a `Patcher` and global hooks, active only during the run and
undone exactly after: per call, two clock reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..kernel.fixes import Patcher
from ..report import BACKWARD, DATA_WAIT, FORWARD, HOST_SYNC, OPTIMIZER, OTHER
from ..report import TIME_SPLIT_PARTS as PARTS

# what makes the host wait for a CUDA device: a read of a device tensor's values ...
SYNCING_READS = ("item", "tolist", "cpu")


class SplitRecorder:
    """Seconds spent in each part of one run (`split` once it ended)."""

    def __init__(self) -> None:
        # host syncs are a part only where a CUDA device is in use (`recording`)
        self._seconds = dict.fromkeys((p for p in PARTS if p not in (HOST_SYNC, OTHER)), 0.0)
        self._inside: str | None = None  # the outermost part being timed
        self._entered = 0.0
        self._depth = 0  # nested entries of that part
        self._total: float | None = None

    def _enter(self, part: str) -> None:
        if self._inside is None:
            self._inside, self._entered, self._depth = part, time.perf_counter(), 1
        elif self._inside == part:
            self._depth += 1

    def _exit(self, part: str) -> None:
        if self._inside != part:
            return
        self._depth -= 1
        if self._depth == 0:
            self._seconds[part] += time.perf_counter() - self._entered
            self._inside = None

    def _timed(self, part: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._enter(part)
            try:
                return original(*args, **kwargs)
            finally:
                self._exit(part)

        return timed

    def _timed_read(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A tensor method timed as a host sync when its tensor is on a device (a CPU
        tensor's values are the host's already)."""
        timed = self._timed(HOST_SYNC, original)

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.device.type == "cpu":
                return original(tensor, *args, **kwargs)
            return timed(tensor, *args, **kwargs)

        return read

    def _time_host_syncs(self, patcher: Patcher) -> None:
        """Where a CUDA device is in use: its reads and synchronize calls as host syncs."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        self._seconds[HOST_SYNC] = 0.0
        for name in SYNCING_READS:
            patcher.setattr(torch.Tensor, name, self._timed_read(getattr(torch.Tensor, name)))
        patcher.setattr(torch.cuda, "synchronize", self._timed(HOST_SYNC, torch.cuda.synchronize))
        for kind in (torch.cuda.Stream, torch.cuda.Event):
            patcher.setattr(kind, "synchronize", self._timed(HOST_SYNC, kind.synchronize))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Time the parts while inside (entered innermost, like the loss recorder)."""
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        patcher = Patcher()
        handles = []
        started = time.perf_counter()
        try:
            patcher.setattr(
                _BaseDataLoaderIter,
                "__next__",
                self._timed(DATA_WAIT, _BaseDataLoaderIter.__next__),
            )
            patcher.setattr(torch.Tensor, "backward", self._timed(BACKWARD, torch.Tensor.backward))
            patcher.setattr(
                torch.autograd, "backward", self._timed(BACKWARD, torch.autograd.backward)
            )
            self._time_host_syncs(patcher)
            handles = [
                register_module_forward_pre_hook(lambda *_: self._enter(FORWARD)),
                register_module_forward_hook(lambda *_: self._exit(FORWARD), always_call=True),
                register_optimizer_step_pre_hook(lambda *_: self._enter(OPTIMIZER)),
                register_optimizer_step_post_hook(lambda *_: self._exit(OPTIMIZER)),
            ]
            yield
        finally:
            for handle in handles:
                handle.remove()
            patcher.undo()
            self._total = time.perf_counter() - started

    def split(self) -> dict[str, float] | None:
        """Each part's seconds, `other` the rest of the run; None before the run ended or
        for a run too short to split."""
        if self._total is None or self._total <= 0:
            return None
        parts = dict(self._seconds)
        parts[OTHER] = max(0.0, self._total - sum(parts.values()))
        return parts


@contextlib.contextmanager
def recorded(
    inner: contextlib.AbstractContextManager[Any], recorder: SplitRecorder
) -> Iterator[None]:
    """`inner` (the fixes' in-cell contexts, the loss recorder), timed part by part."""
    with inner, recorder.recording():
        yield
