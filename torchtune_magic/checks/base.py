"""What a check is: an id, a guide section, and `detect(observation) -> detections`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..engine.fixes import Fix
from ..report import Finding

if TYPE_CHECKING:
    from ..engine.probe import Observation

GUIDE_URL = "https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html"


@dataclass
class Detection:
    """A finding, the live fix that goes with it (if any), and the edited cell text
    (if the permanent change edits the cell) so several changes can be combined."""

    finding: Finding
    fix: Fix | None = None
    fixed_source: str | None = None


class Check:
    """One rule from the tuning guide. Adding a check = one module + one registry line."""

    id: ClassVar[str]
    title: ClassVar[str]
    guide: ClassVar[str]  # the guide's section title
    needs_cuda: ClassVar[bool] = False
    # When the evidence counts as mattering for this cell, with the measurement the
    # threshold came from (shown in the README's check table); "" where any occurrence does.
    threshold: ClassVar[str] = ""

    def not_applicable(self, obs: Observation) -> str | None:
        """Why this check cannot apply to this run, or None."""
        if self.needs_cuda and obs.device != "cuda":
            return "not applicable on CPU: this only matters for work on a CUDA device"
        return None

    def detect(self, obs: Observation) -> list[Detection]:
        raise NotImplementedError

    def finding(self, **fields: object) -> Finding:
        """A Finding pre-filled with this check's id, title and guide section."""
        base = {"id": self.id, "title": self.title, "guide": self.guide}
        base.update(fields)
        return Finding(**base)  # type: ignore[arg-type]
