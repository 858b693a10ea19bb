"""perfcheck's own copies of the user's tensors (state snapshots, numerics) leave glibc's
allocator as it was. glibc raises its mmap threshold whenever a mapped block is freed; if
our copies went through malloc, taking and dropping them would change how the cell's own
allocations are served — and its timings — during the measurement and after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtune_magic.kernel import allocator

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import json, sys, torch
from glibc_blocks import mapped
from torchtune_magic.kernel import discovery, state
from torchtune_magic.measuring import numerics
MIB = 1 << 20
model = torch.nn.Module()
model.weight = torch.nn.Parameter(torch.zeros(4 * MIB))  # 16 MiB, built without temporaries
ns = {"weights": torch.zeros(4 * MIB), "model": model}
if sys.argv[1] == "ours":  # perfcheck's copies, taken and dropped after measuring
    snapshot = state.take(ns, discovery.walk(ns))
    outputs = numerics.capture(ns, {"weights"}, {"model": model})
    del snapshot, outputs
elif sys.argv[1] == "malloc":  # what a copy through malloc does
    copy = ns["weights"].clone()
    del copy
# one look per process (a mapped block, freed, moves the threshold): the imports leave it
# at 1-2 MiB, so a 4 MiB block is mapped unless something freed a bigger mapped block
print(json.dumps(mapped(4 * MIB)))
"""


@pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc only")
def _mapped_after(what: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, what],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc only")
def test_taking_and_dropping_our_copies_leaves_glibcs_threshold_where_it_was() -> None:
    assert _mapped_after("nothing") is True  # glibc as the imports leave it
    assert _mapped_after("ours") is True  # our 16 MiB copies came and went: unmoved
    # the control: a 16 MiB block freed through malloc raises glibc's threshold to 16 MiB,
    # so a 4 MiB block now comes from the heap: what our copies used to do to the kernel
    assert _mapped_after("malloc") is False


DRIFT = """
import json, torch, types
from torchtune_magic import perfcheck
log = types.ModuleType("log")  # counts every run: modules are not restored between runs
log.runs = 0
cell = '''
log.runs += 1
size = min(log.runs, 6) * (4 << 20)  # bigger blocks over the first runs, then the same
for _ in range(8):
    block = torch.empty(size, dtype=torch.uint8)
    block[::4096].fill_(1)  # a byte a page: every page faulted, little else timed, so the
    del block               # faults stay a clear share of a run on a busy machine too
'''
# cpu-allocator is left out: measuring it sets glibc's thresholds, which stops glibc moving
# them itself for the rest of the process (its undo caveat), so the state would be ours
report = perfcheck(cell, {"torch": torch, "log": log}, budget=3, skip="cpu-allocator")
# a cell whose blocks glibc always serves from its heap (below any mmap threshold) leaves
# the allocator's state alone: nothing is said
steady_cell = '''
for _ in range(200):
    block = torch.empty(96 << 10, dtype=torch.uint8)
    block.fill_(1)
    del block
'''
steady = perfcheck(steady_cell, {"torch": torch}, budget=2, skip="cpu-allocator")
print(json.dumps([report.warnings, steady.warnings, report.baseline.runs]))
"""


@pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc only")
def _drift_run() -> tuple[list[str], list[str], int]:
    done = subprocess.run(
        [sys.executable, "-c", DRIFT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    warnings, steady, baseline_runs = json.loads(done.stdout.strip().splitlines()[-1])
    return warnings, steady, baseline_runs


def test_a_change_in_the_allocators_state_under_the_measurement_is_said() -> None:
    said = "glibc's allocator"
    warnings, steady, baseline_runs = _drift_run()
    first = None
    if not [w for w in warnings if w.startswith(said)]:
        # seen once, in a fresh clone's full run only (passing alone every time): glibc's
        # faults did not move between the baseline's runs there; one more process
        first = (warnings, f"{baseline_runs} baseline runs")
        warnings, steady, baseline_runs = _drift_run()
    drift = [w for w in warnings if w.startswith(said)]
    assert drift, (warnings, f"{baseline_runs} baseline runs", first)
    assert "page faults" in drift[0] and "cpu-allocator" in drift[0]
    assert not [w for w in steady if w.startswith(said)]  # nothing changed: nothing said


OURS = """
import json, torch
from torchtune_magic.checks import Detection, registry
from torchtune_magic.checks.allocator import AllocatorFix
from torchtune_magic.cell.workload import Workload
from torchtune_magic.options import Options
from torchtune_magic.session import Session
cell = '''
for _ in range(8):
    block = torch.empty(24 << 20, dtype=torch.uint8)
    block.fill_(1)
    del block
'''
session = Session(Workload(cell, {"torch": torch}), Options.build(budget=2, checks="cpu-allocator"))
session.probe()
session.detect()
# the check decides on plain runs after the probe, and once glibc has moved its threshold
# past these blocks they may take no faults: the fix is measured here either way
if not session.detections:
    check = registry.get("cpu-allocator")
    finding = check.finding(evidence="measured for this test", where="", fixable=True)
    session.detections.append(Detection(finding, AllocatorFix()))
report = session.measure()
print(json.dumps([[v.fixes for v in report.variants], report.warnings]))
"""


@pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc only")
def test_a_change_made_by_measuring_cpu_allocator_is_not_blamed_on_the_cell() -> None:
    """Measuring cpu-allocator sets glibc's thresholds; after its undo glibc no longer moves
    them, so the baseline's runs after it fault differently from its first: perfcheck's own
    doing, which the cpu-allocator finding's caveat explains, not a drift of the cell's."""
    done = subprocess.run(
        [sys.executable, "-c", OURS],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    variants, warnings = json.loads(done.stdout.strip().splitlines()[-1])
    assert ["cpu-allocator"] in variants, variants
    assert not [w for w in warnings if w.startswith("glibc's allocator")]


def test_the_drift_note_says_what_moved_the_baseline() -> None:
    """First run faulting more: a kernel's first runs are slower than the baseline. Runs
    faulting unevenly (a cell freeing 16 MiB activations does so in a plain loop): the
    cell's time, fix or not, varies that much in a kernel too. Even runs, or faults worth
    under a millisecond: nothing said."""
    from torchtune_magic.measuring.figures import allocator_drift
    from torchtune_magic.measuring.run import RunTime

    def notes(*faults: int) -> list[str]:
        note = allocator_drift([], [RunTime(0.1, faults=f) for f in faults])
        return [] if note is None else [note]

    fault_s = allocator.fault_cost_s()
    many = int(0.05 * 0.1 / fault_s) * 4  # well past 5% of a 0.1 s run
    few = int(0.05 * 0.1 / fault_s) // 4  # well below it
    (first,) = notes(many, 0, 0, 0)
    assert "first runs in a kernel can be slower than this baseline" in first
    for uneven in [(0, many, 0, many), (0, many, many, many), (many, many, 0, many)]:
        (warning,) = notes(*uneven)
        assert warning.startswith("glibc's allocator served this cell unevenly"), warning
        assert f"0 to {many:,} page faults" in warning and "over 4 runs" in warning
    assert notes(0, 0, 0, 0) == [] and notes(few, 0, few, 0) == []

    def short_run_notes(*faults: int) -> list[str]:
        note = allocator_drift([], [RunTime(0.004, faults=f) for f in faults])
        return [] if note is None else [note]

    # a 4 ms run: a tenth of a millisecond of faults is 5 % of it, but a few dozen faults
    # that a busy machine's scheduling moves as much as the allocator does
    tenth_ms = int(1e-4 / fault_s) + 1
    assert short_run_notes(tenth_ms, 0, 0, 0) == [] and short_run_notes(0, tenth_ms, 0, 0) == []
    two_ms = int(2e-3 / fault_s) + 1
    assert len(short_run_notes(two_ms, 0, 0, 0)) == 1
