"""Proof by re-execution (`scan --verify`): the original notebook and its optimized copy,
executed plainly in their own folder, in alternation (original, copy, original, copy, …,
so a machine that slows down or speeds up weighs on both), every code cell's outputs
compared (`outputs.compare_outputs`: text exactly, images by content, wall-clock figures
masked and named) and the times added per notebook.

The scan's first plain run is the original's first run here: it executed the same cells in
the same folder with only a counter per batch and step added (`tracker.py`), so the verify
costs one plain run of the copy per `--verify-runs`, and one more of the original from the
second on. A difference is never hidden: each cell that differs is listed with its first
differing line; run N of the copy is compared with run N of the original.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .execute import Execution, execute
from .outputs import compare_outputs
from .scan_result import Difference, Verification


def compare_runs(
    original: Execution, optimized: Execution
) -> tuple[int, list[str], list[Difference]]:
    """(cells compared, wall-clock lines masked, differences) over the code cells both ran."""
    compared, masked, differences = 0, [], []
    for index in sorted(set(original.seconds) & set(optimized.seconds)):
        outcome = compare_outputs(
            original.notebook.cells[index - 1].get("outputs", []),
            optimized.notebook.cells[index - 1].get("outputs", []),
        )
        compared += 1
        masked.extend(line for line in outcome.masked if line not in masked)
        if not outcome.same:
            differences.append(Difference(index, outcome.difference or ""))
    return compared, masked, differences


def verify(
    original: Any,
    optimized: Any,
    folder: Path,
    *,
    first_original: Execution,
    runs: int,
    run_options: dict[str, Any],
    log: Callable[[str], None],
) -> Verification:
    """Execute `optimized` (and `original` again from the second run) `runs` times each."""
    originals, copies = [first_original], []
    for number in range(1, runs + 1):
        if number > 1:
            log(f"verify: original, run {number} of {runs}…")
            originals.append(execute(original, folder, **run_options))
        log(f"verify: optimized copy, run {number} of {runs}…")
        copies.append(execute(optimized, folder, **run_options))
    compared, masked, differences = 0, [], []
    for first, second in zip(originals, copies, strict=True):
        count, lines, found = compare_runs(first, second)
        compared = max(compared, count)
        masked.extend(line for line in lines if line not in masked)
        for difference in found:
            if all(d.index != difference.index for d in differences):
                differences.append(difference)
    cells = sorted(set().union(*(r.seconds for r in originals + copies)))
    cell_seconds = {
        index: (
            statistics.median(r.seconds.get(index, 0.0) for r in originals),
            statistics.median(r.seconds.get(index, 0.0) for r in copies),
        )
        for index in cells
    }
    return Verification(
        runs=runs,
        original_s=statistics.median(r.total_s for r in originals),
        optimized_s=statistics.median(r.total_s for r in copies),
        cells_compared=compared,
        cells_same=compared - len(differences),
        masked=masked,
        differences=sorted(differences, key=lambda d: d.index),
        cell_seconds=cell_seconds,
    )
