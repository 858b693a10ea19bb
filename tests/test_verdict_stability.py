"""Verdicts that hold on a busy machine: the same cell checked five times, with another
CPU-bound process beside it the whole time, never flips a fix between "faster" and
"slower", and a fix with no effect at all is "no clear change" every time.

The fix with no effect is the test's own: a live fix that changes nothing (an A/A
comparison: the baseline against itself through the fix machinery). The fix with a real
effect is debug-anomaly's (anomaly mode off: 2.5-4x on this cell, quiet or busy).
"""

from __future__ import annotations

import textwrap
from typing import Any

import torch
from busy_process import other_busy_process
from workloads import namespace_with

from torchtune_magic.cell.workload import Workload
from torchtune_magic.checks.base import Detection
from torchtune_magic.kernel.fixes import Fix, Patcher
from torchtune_magic.options import Options
from torchtune_magic.report import Finding
from torchtune_magic.session import Session

CELL = textwrap.dedent(
    """
    torch.autograd.set_detect_anomaly(True)
    for step in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
    torch.autograd.set_detect_anomaly(False)
    """
)
CHECKS = 5


class _NothingFix(Fix):
    """A live fix that changes nothing: whatever it measures is noise."""

    check_id = "nothing"

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        return None


class _WithControl(Session):
    """The checks' findings plus the no-effect control."""

    def detect(self) -> list[Detection]:
        found = super().detect()
        control = Finding("nothing", "A fix with no effect", "test", "nowhere", True, "test")
        found.append(Detection(control, _NothingFix()))
        return found


def _verdicts() -> dict[str, str | None]:
    ns = namespace_with()
    options = Options.build(budget=4, checks="debug-anomaly", no_finish=True)
    report = _WithControl(Workload(CELL, ns), options).run()
    return {v.fixes[0]: v.verdict for v in report.variants if len(v.fixes) == 1}


def test_the_same_cell_checked_five_times_on_a_busy_machine_keeps_its_verdicts():
    try:
        with other_busy_process():
            seen = [_verdicts() for _ in range(CHECKS)]
    finally:
        torch.autograd.set_detect_anomaly(False)
    real = [v["debug-anomaly"] for v in seen]
    assert "slower" not in real and "faster" in real, seen  # never flips; a busy run may
    # not have the rounds to tell a 2x gain through the noise, and then says so
    assert [v["nothing"] for v in seen] == ["no clear change"] * CHECKS, seen
