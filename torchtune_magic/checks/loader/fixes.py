"""The loader fixes: a rebuilt loader rebound through its plan (or its constructor edited
in the cell), and a Hugging Face Trainer's arguments swapped for a copy with the settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...cell import codeedit
from ...kernel.fixes import Fix, Patcher
from ...probe import frameworks, steps

if TYPE_CHECKING:
    from .rebuild import LoaderPlan


class _LoaderFix(Fix):
    """Rebind a loader to its rebuilt version with `overrides`, or, for a loader the cell
    builds itself, edit its constructor call (and copy lines) in the cell."""

    def __init__(
        self,
        overrides: dict[str, Any],
        plan: LoaderPlan | None,
        cell_edit: Callable[[str], str] | None,
    ):
        super().__init__()
        self.overrides = overrides
        self.plan = plan
        self.cell_edit = cell_edit

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        plan = self.plan
        if plan is not None:
            patcher.call(
                lambda: plan.want(self, self.overrides, namespace),
                lambda: plan.drop(self, namespace, patcher.notes),
            )

    def edit_source(self, source: str) -> str:
        if self.cell_edit is None:
            return source
        return codeedit.edited(source, self.cell_edit)[0]  # a cell changed past editing


class WorkersFix(_LoaderFix):
    check_id = "dataloader-workers"
    one_time_cause = "worker start"
    one_time_guess_s = 1.0  # a few worker processes forked, their first batches loaded

    @property
    def warmup_steps(self) -> int:
        original = self.plan.original if self.plan else None
        factor = original.prefetch_factor if original is not None else None
        return steps.prefetch_depth(self.overrides["num_workers"], factor)


class PinMemoryFix(_LoaderFix):
    check_id = "pin-memory"


class _TrainerArgsFix(Fix):
    """Swap a Hugging Face Trainer's arguments for a copy with `overrides` (through the
    trainer's `ArgsPlan`, shared with its other loader fixes): the Trainer reads them each
    time it builds its DataLoader, on every `train()`. Refused when the notebook name no
    longer holds the Trainer the probe saw."""

    def __init__(self, overrides: dict[str, Any], plan: frameworks.ArgsPlan):
        super().__init__()
        self.overrides = overrides
        self.plan = plan
        self.seen = [(plan.owner.location, plan.owner.trainer)]

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        plan = self.plan
        patcher.call(
            lambda: plan.want(self, self.overrides, namespace),
            lambda: plan.drop(self, namespace, patcher.notes),
        )


class TrainerWorkersFix(_TrainerArgsFix):
    check_id = "dataloader-workers"
    one_time_cause = "worker start"
    one_time_guess_s = 1.0  # a few worker processes forked, their first batches loaded

    @property
    def warmup_steps(self) -> int:
        factor = getattr(self.plan.original, "dataloader_prefetch_factor", None)
        return steps.prefetch_depth(self.overrides["dataloader_num_workers"], factor)


class TrainerPinMemoryFix(_TrainerArgsFix):
    check_id = "pin-memory"
