"""What a check is: an id, a guide section, and `detect(observation) -> detections`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ..cell.history import Edit
from ..kernel.fixes import Fix
from ..report import Checked, Finding, Variant

if TYPE_CHECKING:
    from ..probe.observation import Observation

GUIDE_URL = "https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html"
DEVICE_NAMES = {"cpu": "CPU", "cuda": "CUDA"}
_WORK_ON = {"cpu": "the CPU", "cuda": "a CUDA device"}


@dataclass
class Detection:
    """A finding, the live fix that goes with it (if any), the edited cell text (if the
    permanent change edits the cell) and the edits of the earlier cells that built the
    objects (`history.keyword_edit`) or turned a switch on (`history.switched_on`), so
    several changes can be combined."""

    finding: Finding
    fix: Fix | None = None
    fixed_source: str | None = None
    earlier: list[Edit] = field(default_factory=list)


class Check:
    """One rule from the tuning guide. Adding a check = one module + one registry line."""

    id: ClassVar[str]
    title: ClassVar[str]
    guide: ClassVar[str]  # the guide's section title
    # The devices whose runs this check is about ("cpu", "cuda"): shown in the check table
    # and `%perfcheck list`; a run on another device lists the check as not applicable.
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    # When the evidence counts as mattering for this cell, with the measurement the
    # threshold came from (shown in the README's check table); "" where any occurrence does.
    threshold: ClassVar[str] = ""
    # Evidence that only suggests a cost (page faults priced at a per-fault cost measured
    # apart): the finding stands only if its fix then measurably wins the time back; a
    # fix measured slower, or settled within the no-change band, moves it to "not
    # applicable here" with the measurement as the reason (`without_win`).
    needs_measured_win: ClassVar[bool] = False
    # Its trial runs the cell for a time each process measures on its own clock: under
    # torchrun the ranks would issue the cell's collectives in runs of different lengths,
    # so it is not run there (`not_applicable_under_torchrun`).
    trial_runs_cell_on_own_clock: ClassVar[bool] = False

    def without_win(self, variant: Variant) -> str:
        """Why the finding was dropped: its fix measured no win (`needs_measured_win`)."""
        rounds = f" over {variant.rounds} rounds" if variant.rounds else ""
        interval = ""
        if variant.speedup_low is not None and variant.speedup_high is not None:
            interval = f", {variant.speedup_low:.2f}x-{variant.speedup_high:.2f}x"
        return (
            f"its evidence was seen, but the fix measured {variant.speedup:.2f}x"
            f"{interval}{rounds} ({variant.verdict}): no time to win back here"
        )

    def not_applicable(self, obs: Observation) -> str | None:
        """Why this check cannot apply to this run, or None."""
        if obs.device in self.devices:
            return None
        where = " or ".join(_WORK_ON[device] for device in self.devices)
        device = DEVICE_NAMES.get(obs.device, obs.device)
        return f"not applicable on {device}: this only matters for work on {where}"

    def not_applicable_under_torchrun(self) -> str | None:
        """Why this check is not run on the ranks of a torchrun job, or None."""
        if not self.trial_runs_cell_on_own_clock:
            return None
        return (
            "not checked under torchrun: its trial runs the cell for a time each rank "
            "measures on its own clock, so the ranks' collectives would fall out of step"
        )

    @classmethod
    def devices_text(cls) -> str:
        """Where this check applies, for people: "CPU", "CUDA" or "CPU, CUDA"."""
        return ", ".join(DEVICE_NAMES[device] for device in cls.devices)

    def detect(self, obs: Observation) -> Sequence[Detection | Checked]:
        """The findings this check makes of the run, each with its fix; a `Checked` where
        the check's own trial measured its fix slower here (the report lists it apart,
        never as a finding to act on)."""
        raise NotImplementedError

    def finding(self, **fields: object) -> Finding:
        """A Finding pre-filled with this check's id, title and guide section."""
        base = {"id": self.id, "title": self.title, "guide": self.guide}
        base.update(fields)
        return Finding(**base)  # type: ignore[arg-type]


def size_text(nbytes: int) -> str:
    """`4.0 MiB`, or `96 KiB` below an eighth of a MiB (where one decimal of MiB says 0.0)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**17 else f"{nbytes / 2**10:.0f} KiB"
