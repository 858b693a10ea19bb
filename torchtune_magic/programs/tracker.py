"""Counts the torch work each notebook cell repeats, inside the kernel of the scan's first
run, so the scan can choose the cells worth checking (`choose.py`).

This file is loaded into the kernel by path, never as `torchtune_magic.programs.tracker`:
importing the package would import torch before the notebook does, and the first cell's
time (which the verify compares) would lose its import. So it imports only the standard
library, and hooks torch when the notebook itself imports it (a finder on `sys.meta_path`
wraps torch's loader). The hooks are what a plain run cannot notice: a counter on each
DataLoader batch (`_BaseDataLoaderIter.__next__`), a global optimizer-step post hook, a
counter around `torch.autograd.backward` (what `Tensor.backward` calls). Nothing touches
module calls. Per cell (IPython's pre/post_run_cell events) one JSON line is appended to a
file: the execution count, the counts, and a torch module the cell calls in a loop.
"""

from __future__ import annotations

import ast
import functools
import importlib.abc
import importlib.machinery
import json
import sys
from pathlib import Path
from typing import Any

COUNTERS = ("batches", "optimizer_steps", "backward_calls")


class _Counts:
    def __init__(self) -> None:
        self.values = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str) -> None:
        self.values[name] += 1


def _hook_torch(counts: _Counts) -> None:
    """Count batches, optimizer steps and backward calls from now on (torch is imported)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import dataloader

    register_optimizer_step_post_hook(lambda *_: counts.add("optimizer_steps"))
    next_batch = dataloader._BaseDataLoaderIter.__next__

    @functools.wraps(next_batch)
    def counted_next(self: Any) -> Any:
        item = next_batch(self)
        counts.add("batches")
        return item

    dataloader._BaseDataLoaderIter.__next__ = counted_next
    backward = torch.autograd.backward

    @functools.wraps(backward)
    def counted_backward(*args: Any, **kwargs: Any) -> Any:
        counts.add("backward_calls")
        return backward(*args, **kwargs)

    torch.autograd.backward = counted_backward


class _HookedLoader(importlib.abc.Loader):
    """torch's own loader, then the hooks."""

    def __init__(self, loader: Any, counts: _Counts):
        self.loader = loader
        self.counts = counts

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _hook_torch(self.counts)


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Finds torch with the usual finders, once, and hands it a loader that hooks it."""

    def __init__(self, counts: _Counts):
        self.counts = counts

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookedLoader(spec.loader, self.counts)
        return spec


def _top_level_loops(tree: ast.AST) -> list[ast.For | ast.While]:
    """The loops the cell itself runs (not those inside the functions it defines)."""
    loops: list[ast.For | ast.While] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.For, ast.While)):
            loops.append(node)
        else:
            loops += _top_level_loops(node)
    return loops


def _module_called_in_loop(source: str, names: dict[str, Any]) -> str | None:
    """The name of a torch module the cell calls inside a for/while loop (an evaluation or
    serving loop without a DataLoader: `for x in queue: model(x)`), read after the cell ran
    from its code and the names it left, so no module call is slowed; None if none."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython syntax (magics): no loop read
        return None
    for loop in _top_level_loops(tree):
        for node in ast.walk(loop):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.value if isinstance(node.func, ast.Attribute) else node.func
            name = func.id if isinstance(func, ast.Name) else None
            if name and isinstance(names.get(name), torch.nn.Module):
                return name
    return None


def install(shell: Any, records: str) -> None:
    """Count from the next cell on; one JSON line per cell goes to `records`."""
    counts = _Counts()
    if "torch" in sys.modules:
        _hook_torch(counts)
    else:
        sys.meta_path.insert(0, _TorchFinder(counts))
    start: dict[str, int] = {}
    out = Path(records)

    def before(*_: Any) -> None:
        start.update(counts.values)

    def after(result: Any) -> None:
        if not result.info.store_history:  # the scan's own setup
            return
        line = {name: counts.values[name] - start.get(name, 0) for name in COUNTERS}
        line["execution_count"] = result.execution_count
        line["module_loop"] = _module_called_in_loop(result.info.raw_cell, shell.user_ns)
        with out.open("a") as file:
            file.write(json.dumps(line) + "\n")

    shell.events.register("pre_run_cell", before)
    shell.events.register("post_run_cell", after)


def setup_code(records: str | Path) -> str:
    """The code the scan runs (unrecorded in the kernel's history) before the notebook."""
    here = str(Path(__file__).resolve())
    return (
        "def _torchtune_magic_track():\n"
        "    import importlib.util\n"
        f"    spec = importlib.util.spec_from_file_location('_torchtune_magic_tracker', {here!r})\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        f"    module.install(get_ipython(), {str(records)!r})\n"
        "_torchtune_magic_track()\n"
        "del _torchtune_magic_track\n"
    )
