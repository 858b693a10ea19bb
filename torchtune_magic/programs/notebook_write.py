"""The optimized copy of a scanned notebook (`scan --write`): the original file with the
code changes of the fixes that measured clearly faster and left results bit-identical
(`kernel.applied.wins`), nothing else changed.

The changes are the ones Apply to notebook makes (the report's `CellChange`s: the checked
cell, found as `execution_count` None, and the earlier cells that built what a fix
changes, found by the execution count they had in the scan's checking run). As in the
labextension, a cell is edited only where it still reads the change's `before`. Several
fixes (or several checked cells) editing one cell are combined with `codeedit.combine`.
Each edited cell is tagged `metadata["torchtune_magic"] = {"fixes": [...]}`.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

from ..cell import codeedit
from ..kernel.applied import wins
from ..report import CellChange, Report
from .scan_result import Edit

TAG = "torchtune_magic"


def _fix_changes(report: Report, fixes: list[str]) -> list[tuple[str, CellChange]]:
    """(fix, change) for these fixes: the report's combined edits where they are exactly
    these fixes, else each finding's own."""
    edits = report.notebook_edits
    if edits and sorted(edits.fixes) == sorted(fixes):
        return [(",".join(edits.fixes), change) for change in edits.cells]
    return [
        (finding.id, change)
        for finding in report.findings
        if finding.id in fixes and finding.code_change
        for change in finding.code_change.cells
    ]


def _without_magic_line(text: str) -> str:
    """The checked cell's text without its `%%perfcheck ...` first line."""
    return text.split("\n", 1)[1] if text.startswith("%%perfcheck") and "\n" in text else text


def _lines(text: str) -> list[str]:
    """A cell's lines as the kernel ran them: IPython hands a cell magic its body with each
    whitespace-only line emptied, so the reports' `before` of a checked cell reads "" where
    the notebook has "    "."""
    return [line if line.strip() else "" for line in text.rstrip().split("\n")]


def _same(a: str, b: str) -> bool:
    return _lines(a) == _lines(b)


def _onto(source: str, before: str, after: str) -> str:
    """`after`, with the notebook's own text on every line the change kept from `before`
    (`source` reads `before` but for whitespace-only lines, `_same`): the copy changes only
    what the fix changes."""
    own, ran = source.rstrip().split("\n"), before.rstrip().split("\n")
    changed = after.rstrip().split("\n")
    matcher = difflib.SequenceMatcher(a=ran, b=changed, autojunk=False)
    lines: list[str] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        lines += own[i1:i2] if tag == "equal" else changed[j1:j2]
    return "\n".join(lines) + source[len(source.rstrip()) :]


def optimized_copy(
    original: Any, checking_run: Any, reports: dict[int, Report]
) -> tuple[Any, list[Edit], list[str]]:
    """`original` (the notebook as read) with the winning fixes' changes; `checking_run`
    the executed notebook whose execution counts the reports' changes name; `reports` by
    the checked cell's position. Returns the copy, its edits and notes on changes left out."""
    by_count = {
        cell.execution_count: index
        for index, cell in enumerate(checking_run.cells, 1)
        if cell.cell_type == "code" and cell.execution_count is not None
    }
    versions: dict[int, list[str]] = {}
    fixes_at: dict[int, set[str]] = {}
    notes = []
    for checked, report in sorted(reports.items()):
        winning = wins([f.id for f in report.findings if f.fixable], report.variants)
        for fix, change in _fix_changes(report, winning):
            index = (
                checked if change.execution_count is None else by_count.get(change.execution_count)
            )
            before, after = change.before, change.after
            if change.execution_count is None:
                before, after = _without_magic_line(before), _without_magic_line(after)
            if index is None or not _same(original.cells[index - 1].source, before):
                where = (
                    f"cell {checked} (checked)"
                    if change.execution_count is None
                    else f"In[{change.execution_count}]"
                )
                notes.append(
                    f"{fix}: a change to {where} was left out: no cell of the notebook reads "
                    "what that cell read when it ran"
                )
                continue
            after = _onto(original.cells[index - 1].source, before, after)
            if after not in versions.setdefault(index, []):
                versions[index].append(after)
            fixes_at.setdefault(index, set()).update(fix.split(","))
    result = copy.deepcopy(original)
    edits = []
    for index in sorted(versions):
        cell = result.cells[index - 1]
        source = cell.source
        cell.source = (
            versions[index][0]
            if len(versions[index]) == 1
            else codeedit.combine(source, versions[index])
        )
        if _same(cell.source, source):
            continue
        fixes = sorted(fixes_at[index])
        cell.metadata[TAG] = {"fixes": fixes}
        edits.append(Edit(index, fixes))
    return result, edits, notes
