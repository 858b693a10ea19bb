"""`python -m torchtune_magic scan NOTEBOOK`: check an unmarked notebook end to end.

Which cells deserve a `%%perfcheck` (torch work that repeats, at least half a second) is
only known after they ran, and each must be checked in place: with the kernel state a
plain top-to-bottom run gives it. So the scan executes the notebook twice:

1. plainly, with a counter of batches, optimizer steps and backward calls in the kernel
   (`tracker.py`, nothing on module calls): each cell's time and torch work, from which
   `choose.py` picks the cells (`--cells` picks them instead). This run is also the
   verify's first run of the original.
2. with `%%perfcheck` (and the options) on top of the chosen cells and the magic
   registered before the first cell (unrecorded, so execution counts and outputs stay a
   plain run's): the reports. perfcheck leaves the kernel as if each checked cell ran
   once, so every other cell runs as in the plain run; the scan checks that their outputs
   match the first run's and says where they do not.

Then `notebook_write.py` builds the optimized copy and `notebook_verify.py` runs the copy
(and the original again from the second `--verify-runs`) in alternation. The wait is
about 3 plain runs + (budget + the probe and the cell's complete run) per checked cell.

A cell that raises stops the scan there (named, with what it has) unless `allow_errors`;
then its error is that cell's output and the scan goes on. Nothing here renders: the CLI
prints the result (`scan_render.py`).
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import runner
from ..report import Report
from . import choose, notebook_verify, notebook_write, tracker
from .execute import ExecuteError, Execution, check_kernel, execute
from .outputs import compare_outputs
from .scan_result import CellFailure, Optimized, ScannedCell, ScanResult

REGISTER_MAGIC = "__import__('torchtune_magic').load_ipython_extension(get_ipython())\n"


class ScanInputError(Exception):
    """The path is no notebook the scan can run; the message says what to do instead."""


@dataclass
class ScanOptions:
    cells: str | None = None  # "7,12": check these, choose none
    budget: float | None = None
    checks: str | None = None
    skip: str | None = None
    quick: bool = False
    memory: bool = False
    write: str | None = None  # where the optimized copy goes
    verify: bool = False
    verify_runs: int = 1
    allow_errors: bool = False
    timeout: float = runner.DEFAULT_TIMEOUT_S
    kernel: str | None = None  # None: the notebook's own kernel (python3 if it names none)

    def magic_line(self) -> str:
        parts = ["%%perfcheck", "--no-widget"]
        if self.budget is not None:
            parts.append(f"--budget {self.budget:g}")
        for flag, value in (("--checks", self.checks), ("--skip", self.skip)):
            if value:
                parts.append(f"{flag} {value}")
        parts += [flag for flag, on in (("--quick", self.quick), ("--memory", self.memory)) if on]
        return " ".join(parts)


def load_notebook(path: Path) -> Any:
    """The notebook at `path`, or ScanInputError saying what is wrong."""
    import nbformat

    if path.suffix == ".py":
        raise ScanInputError(
            f"{path} is a Python script: `python -m torchtune_magic check {path}` checks scripts"
        )
    if not path.is_file():
        raise ScanInputError(f"notebook not found: {path}")
    try:
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
    except Exception as error:
        raise ScanInputError(
            f"{path} is not a Jupyter notebook ({type(error).__name__}: {error})"
        ) from None
    return notebook


def kernel_of(notebook: Any, wanted: str | None) -> str:
    return wanted or notebook.metadata.get("kernelspec", {}).get("name") or "python3"


def _facts(notebook: Any, run: Execution, records: Path) -> list[choose.CellFacts]:
    lines = [json.loads(x) for x in records.read_text().splitlines()] if records.exists() else []
    by_count = {line["execution_count"]: line for line in lines}
    facts = []
    for index in sorted(run.seconds):
        cell = run.notebook.cells[index - 1]
        seen = by_count.get(cell.execution_count, {})
        error = next((o for o in cell.outputs if o.get("output_type") == "error"), None)
        facts.append(
            choose.CellFacts(
                index=index,
                source=notebook.cells[index - 1].source,
                seconds=run.seconds[index],
                counts={k: seen.get(k, 0) for k in tracker.COUNTERS},
                module_loop=seen.get("module_loop"),
                error=f"{error['ename']}: {error['evalue']}" if error else None,
            )
        )
    return facts


def _marked(notebook: Any, chosen: list[int], line: str) -> Any:
    marked = copy.deepcopy(notebook)
    for index in chosen:
        marked.cells[index - 1].source = f"{line}\n{marked.cells[index - 1].source}"
    return marked


def scan(path: Path, options: ScanOptions, log: Callable[[str], None]) -> ScanResult:
    """Run the scan; ScanInputError or ExecuteError where it cannot start or run."""
    notebook = load_notebook(path)
    kernel = kernel_of(notebook, options.kernel)
    check_kernel(kernel)
    folder = path.resolve().parent
    run_options: dict[str, Any] = {
        "kernel_name": kernel,
        "timeout": options.timeout,
        "allow_errors": options.allow_errors,
    }
    try:
        wanted = choose.parse_cells(options.cells, notebook) if options.cells else None
    except ValueError as error:
        raise ScanInputError(str(error)) from None
    with tempfile.TemporaryDirectory(prefix="torchtune-magic-scan-") as scratch:
        records = Path(scratch) / "cells.jsonl"
        log("plain run with a step counter…")
        plain = execute(notebook, folder, setup=tracker.setup_code(records), **run_options)
        facts = _facts(notebook, plain, records)
    choices = choose.chosen_by_user(facts, wanted) if wanted else choose.choose(facts)
    failure = plain.error and CellFailure(
        plain.error.index, f"{plain.error.ename}: {plain.error.evalue}"
    )
    stopped = bool(failure) and not options.allow_errors
    chosen = [c.index for c in choices if c.checked]
    result = ScanResult(
        notebook=str(path),
        cells=[
            ScannedCell(c.index, c.checked, f.seconds, c.why, f.source)
            for c, f in zip(choices, facts, strict=True)
        ],
        plain_s=plain.total_s,
        failure=failure,
        stopped=stopped,
    )
    listed = ", ".join(map(str, chosen)) or "(none)"
    log(f"plain run: {plain.total_s:.1f} s; checking cells {listed}")
    if not chosen:
        if options.write or options.verify:
            asked = " and ".join(
                o for o, on in (("--write", options.write), ("--verify", options.verify)) if on
            )
            result.notes.append(
                f"{asked}: no cell was checked, so there is no fix to write and the copy "
                "would be the original (nothing written, nothing run again)"
            )
        return result
    marked = _marked(notebook, chosen, options.magic_line())
    checking = execute(
        marked,
        folder,
        setup=REGISTER_MAGIC,
        cells=max(chosen),
        report_log=log,
        **run_options,
    )
    reports = {r.cell: r for r in runner.collect_reports(checking.notebook)}
    for cell in result.cells:
        if cell.checked:
            cell.report = reports[cell.index].data if cell.index in reports else None
            if cell.report is None:
                result.notes.append(f"cell {cell.index} published no report")
    result.notes += _disturbed(plain, checking, set(chosen))
    if stopped:
        return result
    parsed = {index: Report.from_dict(r.data) for index, r in reports.items()}
    copy_, edits, left_out = notebook_write.optimized_copy(notebook, checking.notebook, parsed)
    result.notes += left_out
    if options.write:
        import nbformat

        Path(options.write).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(copy_, options.write)
    if options.write or options.verify:
        result.optimized = Optimized(options.write, edits)
    if options.verify:
        if not edits:
            result.notes.append(
                "verify: no fix measured clearly faster with identical results, so the copy "
                "is the original: the verify shows how alike two plain runs are"
            )
        result.verification = notebook_verify.verify(
            notebook,
            copy_,
            folder,
            first_original=plain,
            runs=options.verify_runs,
            run_options=run_options,
            log=log,
        )
    return result


def _disturbed(plain: Execution, checking: Execution, checked: set[int]) -> list[str]:
    """Where an unchecked cell printed something else in the checking run than in the
    plain run (checking in place should change nothing after the checked cell)."""
    notes = []
    first_checked = min(checked, default=0)
    for index in sorted(set(plain.seconds) & set(checking.seconds) - checked):
        outcome = compare_outputs(
            plain.notebook.cells[index - 1].outputs, checking.notebook.cells[index - 1].outputs
        )
        if outcome.same:
            continue
        if index < first_checked:  # nothing of the check had run yet: two plain runs differ
            notes.append(
                f"cell {index} printed something else in two plain runs (it ran before any "
                "checked cell): the notebook itself differs from run to run there (random "
                f"numbers drawn without a seed, times, ...): {outcome.difference}"
            )
        else:
            notes.append(
                f"cell {index} printed something else in the checking run than in the plain "
                f"run: {outcome.difference}"
            )
    return notes


__all__ = ["ExecuteError", "ScanInputError", "ScanOptions", "scan"]
