"""Memory as the constraint: a memory fix is judged by memory under --memory, and a cell
that runs out of memory gets a report (what, where, how much) as well as its traceback.

On a CPU an allocation larger than the machine's memory makes the real allocator refuse at
once, so running out of memory is cheap to test here."""

from __future__ import annotations

import re

import pytest
from test_checks_checkpointing import DEEP_MLP, STEP, namespace

from torchtune_magic import perfcheck
from torchtune_magic.cell.workload import CellError
from torchtune_magic.render import summary, text
from torchtune_magic.report import Report

HUGE = 2**42  # 4 TiB: no machine here has it
OOM_CELL = f"""\
loss = model(x).square().mean()
loss.backward()
scratch = torch.empty({HUGE}, dtype=torch.uint8)
opt.step()
"""


def test_a_memory_fix_under_memory_reads_by_memory_never_not_recommended() -> None:
    report = perfcheck(STEP, namespace(), checks="activation-checkpointing", memory=True, budget=3)
    variant = report.variant_for(["activation-checkpointing"])
    assert variant is not None and variant.judged_by == "memory"
    label = summary.speedup(report, variant)
    assert re.fullmatch(r"\d+\.\dx less peak memory for \d+% (more|less) time", label), label
    assert summary.SLOWER not in text.render(report)
    assert variant.peak_memory_bytes < report.baseline.peak_memory_bytes


def test_without_memory_a_memory_fix_is_a_speed_fix_like_any_other() -> None:
    report = perfcheck(
        "with torch.autograd.detect_anomaly():\n"
        + "".join(f"    {line}\n" for line in STEP.splitlines()),
        namespace(),
        checks="debug-anomaly",
        budget=3,
    )
    variant = report.variant_for(["debug-anomaly"])
    assert variant is not None and variant.judged_by is None


def test_a_cell_that_runs_out_of_memory_gets_a_report_and_its_traceback() -> None:
    ns = namespace()
    reports: list[Report] = []
    with pytest.raises(CellError) as raised:
        perfcheck(OOM_CELL, ns, budget=3, on_report=reports.append)
    assert "can't allocate memory" in str(raised.value.original)  # the user's own error

    report = reports[-1]
    assert reports[0].phase == "measuring" and report.phase == "done"
    oom = report.oom
    assert oom is not None and "can't allocate memory" in oom.error
    assert oom.line == 3 and oom.requested_bytes == HUGE
    assert oom.in_use_bytes and oom.in_use_bytes > 2**20 and "RSS" in oom.in_use_measure
    assert report.cell_run.status == "failed"
    # memory is the constraint now: the repeated blocks' fix is offered, and tried: no
    # checkpointing makes a 4 TiB buffer fit
    assert "activation-checkpointing" in {f.id for f in report.findings}
    [tried] = report.variants
    assert tried.fixes == ["activation-checkpointing"] and tried.fits is False
    assert tried.error.startswith("still out of memory with this fix")
    shown = text.render(report)
    assert "ran out of memory at cell line 3, asking for 4.0 TiB" in shown
    assert "with each memory fix tried it ran out of memory again" in shown
    assert "loss" in ns  # as the plain cell would: it ran up to the failing line


def test_the_magic_shows_the_report_and_the_original_traceback(ip) -> None:
    from IPython.utils.capture import capture_output

    ip.run_cell(DEEP_MLP)
    with capture_output() as shown:
        result = ip.run_cell(f"%%perfcheck --budget 3 --no-widget\n{OOM_CELL}")
    assert isinstance(result.error_in_exec, RuntimeError)  # the cell's own error, unwrapped
    assert "can't allocate memory" in str(result.error_in_exec)
    assert "ran out of memory at cell line" in shown.stdout  # a terminal shell prints it


def test_peak_memory_counts_what_the_run_allocates_not_what_the_last_run_left() -> None:
    # each run binds a fresh 16 MiB tensor; the previous run's is freed when the start
    # state comes back, which must happen before the measured window opens
    ns = namespace()
    report = perfcheck("big = torch.ones(2**22)\nloss = model(x).square().mean()\n", ns, budget=2)
    assert report.baseline.peak_memory_bytes >= 2**24
