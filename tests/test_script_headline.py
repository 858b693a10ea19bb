"""A script's headline sets a fix's per-step gain against its start-up: a short script whose
workers' start eats the gain reads so (with what would make it pay), never "faster"; a long
one reads when the start-up is paid back."""

from __future__ import annotations

from torchtune_magic.programs import headline
from torchtune_magic.report import CellRun, Report, Sampling, Stats, Variant

STEP_S, FIXED_STEP_S, START_S = 0.050, 0.030, 0.9  # the start-up pays back after 45 batches


def _report(batches: int) -> tuple[Report, Variant]:
    lead = 0.5  # setup and the warm-up steps
    base = Stats(STEP_S, 0.002, 6, None, projected_cell_s=lead + batches * STEP_S)
    fixed = Variant(
        ["dataloader-workers"],
        median_s=FIXED_STEP_S,
        runs=6,
        speedup=STEP_S / FIXED_STEP_S,
        verdict="faster",
        one_time_s=START_S,
        one_time_cause="worker start",
        projected_cell_s=lead + START_S + batches * FIXED_STEP_S,
    )
    sampling = Sampling("batch", batches, f"1 epoch x {batches} batches", 2, 4, 4, False)
    report = Report(
        environment={},
        baseline=base,
        variants=[fixed],
        sampling=sampling,
        cell_run=CellRun("complete", lead + batches * STEP_S, batches),
    )
    return report, fixed


def test_a_short_script_reads_that_the_start_up_eats_the_per_batch_gain():
    report, fixed = _report(batches=20)
    line = headline.fix_line(report, fixed)
    assert line is not None
    assert "50.0 ms → 30.0 ms per batch (1.67×)" in line
    assert "start-up 900.0 ms per run (worker start)" in line
    assert "whole run 1.50 s → 2.00 s" in line
    assert "the start-up eats the per-batch gain here" in line
    assert "more than 45 batches per run (this run has 20)" in line
    assert "persistent workers" in line


def test_a_long_script_reads_when_the_start_up_is_paid_back():
    report, fixed = _report(batches=200)
    line = headline.fix_line(report, fixed)
    assert line is not None
    assert "whole run 10.50 s → 7.40 s" in line
    assert "pays back its start-up after 45 batches of this run's 200" in line
    assert "eats" not in line
    whole = headline.whole_run(report)
    assert whole is not None and whole.startswith("the script's whole run: 10.50 s (200 batches")


def test_the_whole_run_counts_what_follows_the_last_step():
    """A test pass after training is in no step: the complete run's time carries it, and
    the fix's whole run keeps it too."""
    report, fixed = _report(batches=200)
    assert report.cell_run is not None
    report.cell_run.seconds = 10.50 + 2.0  # the projection, then a 2 s evaluation
    line = headline.fix_line(report, fixed)
    assert line is not None and "whole run 12.50 s → 9.40 s" in line
