"""A fix's run context is timed with the cell when it stands for code the fix puts in the
cell (`with torch.no_grad():` around it), as the user's hand-fixed cell pays for it; the
measurement's own devices (debug calls made inert for the run) are not timed.

Measured before this (benchmarks/engine_overhead.py, eval-with-grad): entering and leaving
`torch.no_grad()` cost ~60 µs of a 240 µs cell here; outside the clock, perfcheck read the
no-grad fix as 1.21x where the user's A/B of the hand-fixed cell read 1.02x.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from torchtune_magic.cell.workload import Workload
from torchtune_magic.checks.autograd import NoGradFix
from torchtune_magic.checks.base import Detection
from torchtune_magic.checks.debug import AnomalyOffFix, ProfilersOffFix
from torchtune_magic.kernel.fixes import Fix
from torchtune_magic.options import Options
from torchtune_magic.report import Finding
from torchtune_magic.session import Session

PAUSE_S = 0.02  # many times a trivial cell's run, and the noise of one


@contextlib.contextmanager
def _pausing() -> Iterator[None]:
    time.sleep(PAUSE_S)
    yield


class _InCell(Fix):
    check_id = "in-cell"
    context_in_cell = True

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        return _pausing()


class _Device(Fix):
    check_id = "device"

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        return _pausing()


def _finding(check_id: str) -> Finding:
    return Finding(check_id, "test", "seen in the test", "cell", True, "test")


def test_a_context_around_the_run_is_inside_its_time() -> None:
    workload = Workload("x = 1\n", {})
    assert workload.run() < PAUSE_S
    assert workload.run(around=_pausing()) >= PAUSE_S


def test_contexts_that_stand_for_code_in_the_cell_are_timed_and_devices_are_not() -> None:
    session = Session(Workload("x = sum(range(10))\n", {}), Options(budget=1))
    session.probe()
    session.detect()
    for fix in (_InCell(), _Device()):
        session.detections.append(Detection(_finding(fix.check_id), fix))

    report = session.measure([["in-cell"], ["device"]])

    baseline = report.baseline.median_s
    in_cell, device = report.variant_for(["in-cell"]), report.variant_for(["device"])
    assert baseline is not None and baseline < PAUSE_S / 4
    assert in_cell.median_s is not None and in_cell.median_s >= PAUSE_S
    assert device.median_s is not None and device.median_s < PAUSE_S / 4


def test_which_fixes_put_their_context_in_the_cell() -> None:
    """no-grad's change wraps the cell in `with torch.no_grad():`; the debug fixes' changes
    remove calls, and their contexts only make those calls inert while measuring."""
    assert NoGradFix.context_in_cell
    assert not AnomalyOffFix.context_in_cell and not ProfilersOffFix.context_in_cell
