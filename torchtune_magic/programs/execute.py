"""Execute a notebook cell by cell with nbclient, in its own folder, for the scan and the
verify: every run the scan makes goes through `execute`.

`runner.run_notebook` runs a marked notebook to its end and raises at a failing cell; a
scan needs more: code run before the notebook without a trace in its history (the tracker,
the magic's registration: `store_history=False`, so the notebook's cells keep the execution
counts of a plain run), a run that stops at the first failing cell and keeps what ran
(or, with `allow_errors`, records the error as that cell's output and goes on, as
`jupyter nbconvert --allow-errors` does), and each cell's time from the kernel's own
timestamps (nbclient's `record_timing`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..runner import ReportLog, inductor_cache, kernel_failures, logging_client

CHECKED_TIMEOUT = 3


class ExecuteError(Exception):
    """The notebook could not be executed at all (kernel missing, died, a timeout)."""


@dataclass
class CellError:
    """The first cell that raised: its 1-based position (markdown included) and what."""

    index: int
    ename: str
    evalue: str


@dataclass
class Execution:
    """One executed copy of the notebook: its cells with outputs (cells after a stop keep
    none), seconds per executed code cell by position, and the first error if any."""

    notebook: Any  # nbformat.NotebookNode
    seconds: dict[int, float] = field(default_factory=dict)
    error: CellError | None = None
    wall_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The notebook's time: its cells' times added (kernel start-up left out)."""
        return sum(self.seconds.values())


def check_kernel(kernel_name: str) -> None:
    """Raise ExecuteError, saying what to do, when no Jupyter kernel has this name."""
    from jupyter_client.kernelspec import KernelSpecManager

    with kernel_failures(ExecuteError, timeout=0, kernel_name=kernel_name):
        KernelSpecManager().get_kernel_spec(kernel_name)


def _cell_seconds(cell: Any) -> float | None:
    stamps = cell.get("metadata", {}).get("execution", {})
    start, end = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
    if not start or not end:
        return None
    parse = datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def _error_of(cell: Any) -> tuple[str, str] | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            return output.get("ename", ""), output.get("evalue", "")
    return None


def execute(
    notebook: Any,
    folder: Path,
    *,
    kernel_name: str,
    timeout: float,
    allow_errors: bool = False,
    setup: str = "",
    cells: int | None = None,
    report_log: Callable[[str], None] | None = None,
) -> Execution:
    """Execute a copy of `notebook` in `folder`: `setup` first (unrecorded), then its code
    cells in order, the first `cells` cells only when given. Stops after the first cell that
    raises unless `allow_errors`;
    `report_log` gets a line as each `%%perfcheck` report's findings and numbers come in.
    A `%%perfcheck` cell may take CHECKED_TIMEOUT times `timeout` (it runs a probe, the
    measuring and its complete run)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    from nbclient.util import ensure_async, run_sync

    check_kernel(kernel_name)
    executed = copy.deepcopy(notebook)
    client_class = (
        NotebookClient
        if report_log is None
        else logging_client(NotebookClient, ReportLog(report_log))
    )
    client = client_class(
        executed,
        kernel_name=kernel_name,
        timeout=timeout,
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(folder)}},
        timeout_func=lambda cell: (
            timeout * CHECKED_TIMEOUT if cell.source.startswith("%%perfcheck") else timeout
        ),
    )
    result = Execution(executed)

    async def run_all(env: dict[str, str]) -> None:
        async with client.async_setup_kernel(env=env):
            if setup:
                # straight to the kernel: nbclient would write the cell into the notebook
                msg_id = await ensure_async(client.kc.execute(setup, store_history=False))
                reply = await client.async_wait_for_reply(msg_id)
                if reply is None or reply["content"]["status"] != "ok":
                    raise ExecuteError(f"torchtune-magic's own setup failed: {reply}")
            for index, cell in enumerate(executed.cells[:cells]):
                if cell.cell_type != "code":
                    continue
                # an error is read below from the cell's error output
                with contextlib.suppress(CellExecutionError):
                    await client.async_execute_cell(
                        cell, index, execution_count=client.code_cells_executed + 1
                    )
                position = index + 1
                result.seconds[position] = _cell_seconds(cell) or 0.0
                error = _error_of(cell)
                if error and result.error is None:
                    result.error = CellError(position, *error)
                if error and not allow_errors:
                    return

    started = time.perf_counter()
    failures = kernel_failures(ExecuteError, timeout=timeout, kernel_name=kernel_name)
    with failures, inductor_cache() as cache:
        run_sync(run_all)({**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    result.wall_s = time.perf_counter() - started
    return result
