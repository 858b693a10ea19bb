"""Run a notebook headless and collect its `%%perfcheck` reports (`python -m torchtune_magic run`).

A notebook is the unit users share, so CI and demos run the notebook itself (nbclient, a
real kernel) rather than a copy of its code. Each `%%perfcheck` cell publishes its report as
a MIME output and updates it in place on re-times; nbclient applies those updates, so the
last report output of a cell is its final report. While a notebook runs, `ReportLog` turns
those outputs into log lines as they arrive: the findings as soon as they are found, each
fix's number as soon as it is measured, the cell's complete run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from .report import MIME_TYPE, OwnFailure, Report

DEFAULT_TIMEOUT_S = 600.0


class RunError(Exception):
    """The notebook could not be run to the end; the message says what to do."""


@contextmanager
def kernel_failures(
    error: type[Exception], *, timeout: float, kernel_name: str, where: str = ""
) -> Iterator[None]:
    """nbclient's failures other than a cell's own error (no such kernel, a cell past its
    timeout, a kernel that died) as `error`, in words that say what to do: `run` and
    `scan` say them alike. `where` ("nb.ipynb: ") goes before the timeout and the death."""
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    try:
        yield
    except NoSuchKernel:
        raise error(
            f"no Jupyter kernel named {kernel_name!r}: install ipykernel in this Python "
            "or pass --kernel NAME (see `jupyter kernelspec list`)"
        ) from None
    except CellTimeoutError:
        raise error(
            f"{where}a cell ran longer than {timeout:g} s (raise it with --timeout)"
        ) from None
    except DeadKernelError as died:
        raise error(f"{where}the kernel died: {died}") from None


@dataclass
class CellReport:
    """The final report of one cell. `cell` is the cell's 1-based position in the notebook
    (markdown cells count), as in the output file names `<stem>-cell<N>.json`."""

    cell: int
    source: str
    data: dict[str, Any]

    @property
    def report(self) -> Report:
        return Report.from_dict(self.data)


class ReportLog:
    """Log lines for a cell's report as it grows (one `seen` call per report output or
    update): findings, then each fix's first number, then the final numbers."""

    def __init__(self, write: Callable[[str], None]):
        self.write = write
        self._seen: dict[str, tuple[str, set[tuple[str, ...]]]] = {}  # run id: phase, fix sets

    def seen(self, cell: int, data: dict[str, Any]) -> None:
        from .render import summary

        report = Report.from_dict(data)
        phase, logged = self._seen.get(report.run_id, ("", set()))
        where = f"cell {cell}"
        if not phase:
            ids = ", ".join(f.id for f in report.findings) or "none"
            self.write(f"{where}: findings: {ids}")
        for variant in report.latest_variants():
            key = tuple(variant.fixes)
            if key not in logged and (variant.speedup is not None or variant.error):
                logged.add(key)
                self.write(f"{where}: {'+'.join(key)}: {summary.speedup(report, variant)}")
        if report.phase != phase:
            line = summary.cell_run_line(report) if report.phase != "measuring" else ""
            if report.phase == "done":
                line = f"done ({line})" if line else "done"
            if line:
                self.write(f"{where}: {line}")
        self._seen[report.run_id] = (report.phase, logged)


def logging_client(client_class: type, log: ReportLog) -> type:
    """`client_class` (nbclient's NotebookClient) that hands every report output or update
    to `log` as the kernel sends it."""

    class LoggingClient(client_class):  # type: ignore[misc, valid-type]
        def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
            data = msg.get("content", {}).get("data") or {}
            if msg.get("msg_type") in ("display_data", "update_display_data") and MIME_TYPE in data:
                try:
                    log.seen(cell_index + 1, data[MIME_TYPE])
                except Exception as error:  # a bug of ours: the notebook runs on
                    from .render.summary import own_failure_line

                    failure = OwnFailure.of("the progress log", error)
                    log.write(f"cell {cell_index + 1}: {own_failure_line(failure)}")
            return super().process_message(msg, cell, cell_index)

    return LoggingClient


@dataclass
class RunResult:
    notebook: Any  # nbformat.NotebookNode, executed in place
    reports: list[CellReport]
    seconds: float


@contextmanager
def inductor_cache() -> Iterator[str]:
    """The caller's TORCHINDUCTOR_CACHE_DIR if set, else a folder of this run's own: torch's
    default (one folder under /tmp for every process of the user) is shared with whatever
    else compiles at the same time, and a fresh cache reports compile time as a user's
    first run pays it."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        yield os.environ["TORCHINDUCTOR_CACHE_DIR"]
        return
    with tempfile.TemporaryDirectory(prefix="torchtune-magic-inductor-") as folder:
        yield folder


def collect_reports(notebook: Any) -> list[CellReport]:
    """The last report output of every code cell that has one, in notebook order."""
    found = []
    for index, cell in enumerate(notebook.cells, 1):
        if cell.cell_type != "code":
            continue
        reports = [
            o.data[MIME_TYPE] for o in cell.get("outputs", []) if MIME_TYPE in o.get("data", {})
        ]
        if reports:
            found.append(CellReport(index, cell.source, reports[-1]))
    return found


def _failed_cell(notebook: Any) -> int | None:
    """The 1-based position of the cell holding an error output, if any."""
    for index, cell in enumerate(notebook.cells, 1):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return index
    return None


def run_notebook(
    path: str | Path,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    kernel_name: str = "python3",
    output: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Execute the notebook in its own folder (so it imports its helper modules) and return
    it with its reports; `log` gets a line as each report's findings and numbers come in.
    Raises RunError for a missing notebook, a failing or timed-out cell, or a kernel that
    cannot start; `output` is written even then, to show where."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = Path(path)
    if not path.is_file():
        raise RunError(f"notebook not found: {path}")
    notebook = nbformat.read(path, as_version=4)
    client_class = NotebookClient if log is None else logging_client(NotebookClient, ReportLog(log))
    client = client_class(
        notebook,
        kernel_name=kernel_name,
        timeout=timeout,
        store_widget_state=True,
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    started = time.perf_counter()
    failures = kernel_failures(
        RunError, timeout=timeout, kernel_name=kernel_name, where=f"{path}: "
    )
    try:
        with failures, inductor_cache() as cache:
            client.execute(env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    except CellExecutionError as error:
        cell = _failed_cell(notebook)
        where = f"cell {cell}" if cell else "a cell"
        raise RunError(
            f"{path}: {where} failed with {error.ename}: {error.evalue}\n{error}"
        ) from None
    finally:
        if output is not None:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, output)
    return RunResult(notebook, collect_reports(notebook), time.perf_counter() - started)


def write_json(reports: list[CellReport], folder: str | Path, stem: str) -> list[Path]:
    """One schema-v1 file per report, `<folder>/<stem>-cell<N>.json`, holding exactly what
    the notebook saved."""
    paths = []
    for item in reports:
        path = Path(folder) / f"{stem}-cell{item.cell}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(item.data, indent=2))
        paths.append(path)
    return paths


def html_page(reports: list[CellReport], title: str) -> str:
    """One standalone page with every report, each under the code of its cell."""
    from .render import bundle

    sections = "".join(
        f"<section><h2>cell {r.cell}</h2><details><summary>cell code</summary>"
        f"<pre>{escape(r.source)}</pre></details>{bundle.render(r.report)['text/html']}"
        "</section>"
        for r in reports
    )
    body = sections or "<p>No %%perfcheck report in this notebook.</p>"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"</head><body><h1>{escape(title)}</h1>{body}</body></html>"
    )
