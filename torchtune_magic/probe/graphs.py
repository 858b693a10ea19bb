"""Which top-level forwards built an autograd graph that no backward pass ever reached.

A training cell often evaluates too (per epoch, through a helper or a lambda), and those
evaluation forwards record a graph, holding every activation a backward would need, for
nothing. The probe watches the graph root (`grad_fn`) of each top-level forward's output
with a pre-hook that fires when a backward pass runs that node. Only the hook is kept, never
the graph: a `Node` cannot be weakly referenced, but our hook object lives exactly as long
as the graph holds it, so a weak reference to the hook says whether the graph is still
alive. What the graphs held is read from their saved tensors (`SavedTensor.data`, which,
unlike unpacking, never runs a saved-tensor hook such as a checkpoint's recomputation).
"""

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..cell.workload import Workload

WALKED_PER_SITE = 2  # forwards per site whose graph is walked for its saved tensors
MAX_NODES = 20_000  # nodes walked per graph, at most
MAX_OUTPUT_TENSORS = 64


@dataclass
class GraphSite:
    """Top-level forwards of one module issued from one place, whose outputs carried an
    autograd graph, and how many of those graphs a backward pass reached."""

    module: torch.nn.Module
    line: int | None  # the cell's own top-level line that issued them
    functions: tuple[types.CodeType, ...]  # user functions on the stack, outermost first
    forwards: int = 0
    backpropagated: int = 0
    left_alive: int = 0  # graphs still alive when the run ended, never backpropagated
    saved_bytes: int | None = None  # most saved activations held by one walked graph
    walked: int = 0

    @property
    def unused(self) -> int:
        """Forwards whose graph no backward reached (freed, or alive at the end)."""
        return self.forwards - self.backpropagated


class _Watch:
    """Pre-hook on one forward's graph root(s): notes the first backward through it."""

    __slots__ = ("__weakref__", "fired", "site")

    def __init__(self, site: GraphSite):
        self.site = site
        self.fired = False

    def __call__(self, grad_outputs: Any) -> None:
        if not self.fired:
            self.fired = True
            self.site.backpropagated += 1


class RootWatcher:
    """Called after each top-level forward; `release()` removes every hook it placed."""

    def __init__(self, workload: Workload, sites: dict[tuple[Any, ...], GraphSite]):
        self.namespace = workload.namespace
        self.cell_files = (workload.filename, workload.fixed_filename)
        self.sites = sites
        self._handles: list[Any] = []
        self._watches: list[weakref.ref[_Watch]] = []

    def forward_done(self, module: torch.nn.Module, args: Any, output: Any, depth: int) -> None:
        if depth or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        if torch._C._current_graph_task_id() != -1:
            return  # run by a backward pass (activation checkpointing's recomputation)
        roots = {id(node): node for node in _roots(output)}
        if not roots or not any(p.requires_grad for p in module.parameters()):
            return  # no graph, or a parameter-free module (a loss) on a graph's tail
        line, functions = self._issuers()
        key = (id(module), line, functions)
        site = self.sites.get(key)
        if site is None:
            site = self.sites[key] = GraphSite(module, line, functions)
        watch = _Watch(site)
        handles = []
        for node in roots.values():
            with contextlib.suppress(RuntimeError):  # a node kind without hooks: no evidence
                handles.append(node.register_prehook(watch))
        if not handles:
            return
        site.forwards += 1
        self._handles.extend(handles)
        self._watches.append(weakref.ref(watch))
        if site.walked < WALKED_PER_SITE:
            site.walked += 1
            with contextlib.suppress(RuntimeError):  # e.g. a graph freed under our feet
                held = _saved_bytes(list(roots.values()), module, args, output)
                site.saved_bytes = max(held, site.saved_bytes or 0)

    def _issuers(self) -> tuple[int | None, tuple[types.CodeType, ...]]:
        """The cell line running now and the user functions between it and the forward
        (frames whose globals are the user namespace; comprehensions are not functions
        one can wrap, lambdas are)."""
        codes: list[types.CodeType] = []
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_filename in self.cell_files and code.co_name == "<module>":
                return frame.f_lineno, tuple(reversed(codes))
            if frame.f_globals is self.namespace and (
                code.co_name == "<lambda>" or not code.co_name.startswith("<")
            ):
                codes.append(code)
            frame = frame.f_back
        return None, tuple(reversed(codes))

    def release(self) -> None:
        """Remove the hooks; graphs still alive and never backpropagated are counted."""
        for ref in self._watches:
            watch = ref()
            if watch is not None and not watch.fired:
                watch.site.left_alive += 1
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watches.clear()


def _roots(output: Any, depth: int = 3) -> Iterator[Any]:
    """grad_fn of the tensors in a forward's output (a tensor, or containers of them)."""
    if isinstance(output, torch.Tensor):
        if output.grad_fn is not None:
            yield output.grad_fn
    elif depth and isinstance(output, (tuple, list)):
        for item in output[:MAX_OUTPUT_TENSORS]:
            yield from _roots(item, depth - 1)
    elif depth and isinstance(output, dict):  # also Hugging Face's ModelOutput
        for item in list(output.values())[:MAX_OUTPUT_TENSORS]:
            yield from _roots(item, depth - 1)


def _tensors(value: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth and isinstance(value, (tuple, list)):
        for item in value[:MAX_OUTPUT_TENSORS]:
            yield from _tensors(item, depth - 1)
    elif depth and isinstance(value, dict):
        for item in list(value.values())[:MAX_OUTPUT_TENSORS]:
            yield from _tensors(item, depth - 1)


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of a tensor's storage; None for tensors without one."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node: Any) -> tuple[str, ...]:
    kind = type(node)
    names = _SAVED_NAMES.get(kind)
    if names is None:
        names = _SAVED_NAMES[kind] = tuple(n for n in dir(kind) if n.startswith("_raw_saved_"))
    return names


def _saved_bytes(roots: list[Any], module: torch.nn.Module, args: Any, output: Any) -> int:
    """Bytes of the distinct storages this forward's graph saved for backward, beyond what
    lives anyway (the module's parameters and buffers, its inputs and outputs): the
    activations a `no_grad` run would not keep. Stops at nodes older than the forward."""
    known = {
        key[0]
        for tensor in [*module.parameters(), *module.buffers(), *_tensors(args), *_tensors(output)]
        if (key := _storage(tensor)) is not None
    }
    older = max(
        (t.grad_fn._sequence_nr() for t in _tensors(args) if t.grad_fn is not None), default=-1
    )
    counted: dict[int, int] = {}
    seen: dict[int, Any] = {}  # keeps each node's wrapper alive so ids are not reused
    stack = list(roots)
    while stack and len(seen) < MAX_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if hasattr(node, "variable") or node._sequence_nr() <= older:
            continue  # AccumulateGrad (a leaf), or built before this forward
        for name in _saved_names(node):
            raw = getattr(node, name, None)
            for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
                data = getattr(saved, "data", None)
                key = _storage(data) if isinstance(data, torch.Tensor) else None
                if key is not None and key[0] not in known:
                    counted[key[0]] = key[1]
        stack.extend(child for child, _ in node.next_functions)
    return sum(counted.values())
