"""The code changes of chosen findings: the checked cell rewritten (`codeedit`) and the
notebook cells to edit or re-run (`history`), for the panel, `%perfcheck insert` and Apply
to notebook. The session chooses the findings; this module only writes their changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cell import codeedit, history
from ..cell.workload import Workload
from ..report import CodeChange, NotebookEdits

if TYPE_CHECKING:
    from .base import Detection


def optimized_cell(
    workload: Workload, detections: list[Detection], check_ids: list[str] | None = None
) -> str:
    """The cell with the code changes of these findings (default: all) applied."""
    versions = [
        d.fixed_source
        for d in detections
        if d.fixed_source is not None and (check_ids is None or d.finding.id in check_ids)
    ]
    return codeedit.combine(workload.source, versions)


def notebook_edits(workload: Workload, chosen: list[Detection]) -> NotebookEdits | None:
    """Every notebook cell to edit for the chosen findings: the earlier cells that built the
    objects and the checked cell, several fixes' edits of one cell in one entry. None when
    no cell changes."""
    chosen = [d for d in chosen if d.fixed_source is not None or d.earlier]
    key = [d.finding.id for d in chosen]
    cells = history.cell_changes(
        workload,
        [d.fixed_source for d in chosen if d.fixed_source is not None],
        [edit for d in chosen for edit in d.earlier],
    )
    return NotebookEdits(key, cells) if cells else None


def cell_to_insert(
    workload: Workload, suggested: str, chosen: list[Detection]
) -> tuple[str, list[history.Rebuild], list[tuple[str, str]]]:
    """What `%perfcheck insert` puts below: the suggested cell as typed, preceded by the
    earlier cells' statements that rebuild the loaders and optimizers the fixes change
    (the live fixes do not outlive the kernel; these lines carry the biggest wins).
    Returns the cell, those rebuilds, and (fix id, what to edit by hand) for changes a
    statement cannot carry (a model's convs: rebuilding the model resets its weights; a
    switch an earlier cell turned on)."""
    typed = history.as_typed(workload, suggested).splitlines(keepends=True)
    body = "".join(typed[next((i for i, t in enumerate(typed) if t.strip()), 0) :])
    edits = [(d.finding.id, edit) for d in chosen for edit in d.earlier]
    rebuilt, left = history.rebuilds(workload.notebook, edits)
    head = [
        f"# from In[{r.execution_count}] with {', '.join(r.fixes)}:\n{r.text}\n" for r in rebuilt
    ]
    cell = "".join(head) + ("\n" if head else "") + body
    return cell, rebuilt, [(check, _by_hand(edit)) for check, edit in left]


def _by_hand(edit: history.Edit) -> str:
    """What an edit of an earlier cell that no inserted statement carries changes, and
    where: `%perfcheck insert` says to make it in that cell."""
    where = f"In[{edit.execution_count}] line {edit.line}"
    if isinstance(edit, history.RemovedCall):
        return f"removes the {edit.callee}(...) call at {where}, whose setting outlives the cell"
    return f"changes a constructor inside an object built earlier ({where})"


def attach_cell_changes(workload: Workload, detections: list[Detection]) -> None:
    """Each finding's own notebook cells to edit (`code_change.cells`)."""
    for detection in detections:
        versions = [detection.fixed_source] if detection.fixed_source is not None else []
        cells = history.cell_changes(workload, versions, detection.earlier)
        if not cells:
            continue
        if detection.finding.code_change is None:
            detection.finding.code_change = CodeChange()
        detection.finding.code_change.cells = cells
