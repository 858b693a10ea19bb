"""`perfcheck(cell, namespace, **options)`: the engine without IPython."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .measuring.timing import Progress
from .options import Options
from .report import Report


def perfcheck(
    cell: str,
    namespace: dict[str, Any] | None = None,
    *,
    checks: str | list[str] | None = None,
    skip: str | list[str] | None = None,
    budget: float | None = None,
    quick: bool = False,
    apply: str | list[str] | None = None,
    json: str | Path | None = None,
    no_restore: bool = False,
    device: str | None = None,
    memory: bool = False,
    no_finish: bool = False,
    progress: Progress | None = None,
    on_report: Callable[[Report], None] | None = None,
) -> Report:
    """Run `cell` once, find what the tuning guide would change, measure each fix.

    `namespace=None` uses the running IPython's user namespace (so `perfcheck(code)` in a
    notebook sees your model). Display options (`quiet`, `no_widget`) belong to the magic.
    `on_report` receives the report as it grows: findings first, then numbers as they are
    measured, then the cell's complete run.
    """
    from .cell.workload import Workload
    from .kernel import allocator
    from .session import Session

    if namespace is None:
        namespace = _ipython_namespace()
    options = Options.build(
        checks=checks,
        skip=skip,
        budget=budget,
        quick=quick,
        apply=apply,
        json=json,
        no_restore=no_restore,
        device=device,
        memory=memory,
        no_finish=no_finish,
    )
    try:
        return Session(Workload(cell, namespace), options, progress, on_report).run()
    finally:
        allocator.give_back_freed()  # the profiled runs' freed buffers (see its docstring)


def _ipython_namespace() -> dict[str, Any]:
    import sys

    if "IPython" in sys.modules:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.user_ns
    raise ValueError(
        "namespace=None means the running IPython's namespace, but no IPython is running: "
        "pass a dict, e.g. perfcheck(code, globals())"
    )
