"""Cells whose training runs in child processes a notebook launcher starts: accelerate's
`notebook_launcher`, Lightning's `ddp_notebook` / `ddp_spawn` / `ddp_fork` strategies,
`torch.multiprocessing.spawn`. perfcheck sees only the parent, which waits for them: its
times would be that wait, and its findings about the parent's idle objects. The session
says so in one line, with the torchrun command that measures the training itself, and
times nothing.
"""

from __future__ import annotations

import ast
from typing import Any

from .frameworks import lightning_trainers

SPAWNING_STRATEGIES = ("ddp_notebook", "ddp_spawn", "ddp_fork")


def child_process_launcher(tree: ast.AST, namespace: dict[str, Any]) -> str | None:
    """How the cell starts child processes for its training, or None: a launcher call in
    the cell, a Lightning Trainer built with a spawning strategy in the cell, or one from an
    earlier cell whose strategy launches processes."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _called_name(node.func)
        if name == "notebook_launcher":
            return "accelerate's `notebook_launcher`"
        if name in ("spawn", "start_processes") and _from_multiprocessing(node.func, namespace):
            return f"`{ast.unparse(node.func)}`"
        for keyword in node.keywords:
            value = keyword.value
            if (
                keyword.arg == "strategy"
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
                and value.value.startswith(SPAWNING_STRATEGIES)
            ):
                return f'Lightning\'s `strategy="{value.value}"`'
    for trainer in lightning_trainers(namespace):
        launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
        if type(launcher).__name__ == "_MultiProcessingLauncher":
            method = getattr(launcher, "_start_method", "spawn")
            return f"a Lightning Trainer whose strategy starts its ranks by {method}"
    return None


def _from_multiprocessing(func: ast.expr, namespace: dict[str, Any]) -> bool:
    """`torch.multiprocessing.spawn`, or `mp.spawn` with `mp` bound to a multiprocessing
    module (the cell has run: its imports are bound)."""
    if "multiprocessing" in ast.unparse(func):
        return True
    if isinstance(func, ast.Name):  # `from torch.multiprocessing import spawn`
        return "multiprocessing" in getattr(namespace.get(func.id), "__module__", "")
    owner: Any = None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = namespace.get(func.value.id)
    return "multiprocessing" in getattr(owner, "__name__", "")


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def not_measured_line(launcher: str) -> str:
    """The report's line for such a cell."""
    return (
        f"not measured: the cell's training runs in child processes that {launcher} "
        "starts, which perfcheck does not see (its times here would be the notebook "
        "waiting for them); to measure the training, put the cell in a script with "
        "`perfcheck(cell, globals())` and run `torchrun --nproc-per-node N script.py` "
        "(or run this notebook, without the launcher, under `torchrun --nproc-per-node N "
        "-m torchtune_magic run`)"
    )
