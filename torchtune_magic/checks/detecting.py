"""Running the checks on the probe's observation: each check's findings, or why it does not
apply here; under torchrun, only the findings every rank made.

`Session.detect` runs this step; each check runs contained as a part of its own
(`own_failures`), so one that fails costs only its own findings.
"""

from __future__ import annotations

from ..distributed import lockstep
from ..probe.observation import Observation
from ..report import Checked, NotApplicable
from .base import Check, Detection


def run_check(
    check: Check, obs: Observation, under_torchrun: bool
) -> list[Detection | Checked] | NotApplicable:
    """One check's findings (and fixes its own trial measured slower here), or why it
    does not apply here."""
    reason = check.not_applicable(obs)
    if reason is None and under_torchrun:
        reason = check.not_applicable_under_torchrun()
    return NotApplicable(check.id, reason) if reason is not None else check.detect(obs)


def found_on_every_rank(detections: list[Detection], warnings: list[str]) -> list[Detection]:
    """Under torchrun, the findings every rank made (each rank's fix is applied on that
    rank, all together); one seen on some ranks only is said in `warnings`, not measured."""
    seen = lockstep.gathered([d.finding.id for d in detections])
    everywhere = set.intersection(*(set(ids) for ids in seen))
    for finding_id in dict.fromkeys(i for ids in seen for i in ids):
        if finding_id not in everywhere:
            on = [str(r) for r, ids in enumerate(seen) if finding_id in ids]
            ranks = ("rank " if len(on) == 1 else "ranks ") + ", ".join(on)
            warnings.append(
                f"{finding_id}: found on {ranks} only, so it is not measured "
                "(a fix must run on every rank, as the cell's collectives do)"
            )
    return [d for d in detections if d.finding.id in everywhere]
