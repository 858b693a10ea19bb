"""Answers within the default budget (issue 30): the CNN training cell a new user tries.

Two epochs of a small CNN over a dataset whose items take 2 ms to load, anomaly mode left on
from an earlier cell, gradients zeroed in place, conv bias before BatchNorm. At the default
budget each measuring run is the cell's first epoch; the loader's fix must come back
"faster", the fixes whose evidence bounds them below the no-change band untimed with their
bound, the rest of the budget spent on anomaly mode, and the whole wait within the promise.
With a CPU-bound process beside the kernel, the loader's fix is timed and claims nothing
its rounds cannot back."""

from __future__ import annotations

import contextlib
import io
import textwrap
import time

import pytest
from busy_process import other_busy_process
from workloads import detected, namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.measuring.plan import promising_first
from torchtune_magic.report import Report

SETUP = """
import time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        time.sleep(0.002)
        return self.x[i], self.y[i]

torch.manual_seed(0)
loader = DataLoader(Items(), batch_size=32, shuffle=True)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch.autograd.set_detect_anomaly(True)
"""

CELL = """
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    print(f"epoch {epoch} loss {loss.item():.4f}")
"""
DEFAULT_BUDGET_S = 20.0
# other processes' busy CPUs while measuring past which the machine is not a quiet one
BUSY_CPUS = 0.5
PROMISE_SLACK_S = 10.0


def _checked() -> tuple[Report, float, float]:
    """The report at the default budget, perfcheck's wait, and a plain run's time."""
    import torch

    try:
        plain_ns = namespace_with(SETUP)
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            exec(textwrap.dedent(CELL), plain_ns)
        plain = time.perf_counter() - started
        ns = namespace_with(SETUP)
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            report = perfcheck(textwrap.dedent(CELL), ns, skip="cpu-threads")
        return report, time.perf_counter() - started, plain
    finally:
        torch.autograd.set_detect_anomaly(False)


def _settled(report: Report, check_id: str) -> bool:
    variant = report.variant_for([check_id])
    if variant is None:
        return False
    if variant.at_most is not None and variant.speedup is None:
        return True  # too small to matter: untimed, with its bound
    return variant.verdict is not None and not variant.budget_to_tell_s


def test_the_default_budget_settles_the_wins_of_a_cnn_training_cell():
    report, waited, plain = _checked()
    if report.load is not None and report.load.busy_cpus >= BUSY_CPUS:
        # other processes shared the cores while it measured (a CI box's neighbours): the
        # quiet machine's promises do not apply, those of a busy one do
        _timed_and_never_overclaimed(report, waited, plain)
        return
    found = {f.id for f in report.findings if f.fixable}
    assert {"dataloader-workers", "debug-anomaly", "zero-grad-none", "conv-bias-bn"} <= found
    # two epochs of 8 batches: each run is the first epoch, timed whole
    assert report.sampling is not None and report.sampling.warmup_steps == 0
    assert report.sampling.steps_timed == 8 and report.sampling.steps_per_run == 16
    workers = report.variant_for(["dataloader-workers"])
    assert workers is not None and workers.verdict == "faster", workers
    assert workers.speedup > 2.0 and not workers.budget_to_tell_s
    # a fill and an add over 5 K grads, a bias add over 400 K values: not timed, with bounds
    for check_id in ("zero-grad-none", "conv-bias-bn"):
        variant = report.variant_for([check_id])
        assert variant is not None and variant.speedup is None, variant
        assert variant.at_most is not None and variant.at_most < 1.02, variant
    # what is left goes to anomaly mode: rounds of its own once the loader's fix settled
    anomaly = report.variant_for(["debug-anomaly"])
    assert anomaly is not None and anomaly.rounds is not None
    # settled itself, or still measuring when the budget ran out after the loader's fix had
    # settled (both settled "faster" in 4 rounds each on a fresh clone: the budget held both)
    assert _settled(report, "debug-anomaly") or anomaly.rounds > workers.rounds, (anomaly, workers)
    assert waited <= plain + DEFAULT_BUDGET_S + PROMISE_SLACK_S, (waited, plain)
    _budget_kept(report)


def test_the_loaders_fix_is_timed_before_anomaly_mode_whose_bound_leaves_out_the_waits():
    """Anomaly mode slows the autograd work, never the waits for batches: with the loader
    waiting most of the run its evidence allows far less than the loader's fix, which is
    timed first (before, a fix with no bound counted as the most promising, and beside a
    busy process anomaly mode took the only round there was). A fresh clone's run beside a
    CPU-bound process saw the waits under half the probe's run: anomaly mode first then,
    as its bound says."""
    try:
        session = detected(CELL, namespace_with(SETUP), skip="cpu-threads", budget=DEFAULT_BUDGET_S)
    finally:
        import torch

        torch.autograd.set_detect_anomaly(False)
    obs = session.observation
    waited = sum(use.wait_s for use in obs.loaders.values()) / obs.wall_s
    timed, _ = promising_first(session.fixable)
    order = [d.finding.id for d in timed]
    gains = {d.finding.id: d.fix.most_gain for d in timed}
    # Amdahl over all of the run but the waits
    assert gains["debug-anomaly"] == pytest.approx(1 / waited), (gains, waited)
    if waited > 0.6:  # a quiet machine's probe: the loader waits 70-80 % of the run
        assert gains["debug-anomaly"] < 1.6 < 2.5 < gains["dataloader-workers"], gains
        assert order.index("dataloader-workers") < order.index("debug-anomaly"), order
    # beside a busy process the compute stretches and the waits do not: the bounds then
    # come nearer each other, and both are still timed


def _budget_kept(report: Report) -> None:
    """"Measured in" never past the budget: a run stops before a step that would end
    past the deadline (what is left after it, the report's own assembly, is milliseconds)."""
    assert report.budget_s == DEFAULT_BUDGET_S
    assert report.elapsed_s is not None and report.elapsed_s <= report.budget_s + 0.25, report


def test_beside_a_cpu_bound_process_the_loaders_fix_is_timed_and_never_overclaimed():
    """Under load every run takes two or more times as long, so the budget holds one to
    four rounds (one, in a fresh clone's full run); a verdict at 99.9 % needs the fix's
    run to beat the baseline's in more rounds than that on a busy machine
    (`measuring/verdict.py`), so the row says what budget would tell instead of a verdict it
    cannot back."""
    with other_busy_process():  # not one of ours, as a user's other work is not
        report, waited, plain = _checked()
    assert report.load is not None and report.load.busy_cpus >= BUSY_CPUS, report.load
    _timed_and_never_overclaimed(report, waited, plain)


def _timed_and_never_overclaimed(report: Report, waited: float, plain: float) -> None:
    """The loader's fix timed, never read slower, and either settled faster or saying what
    budget would tell; the wait within the promise."""
    variant = report.variant_for(["dataloader-workers"])
    assert variant is not None and variant.rounds is not None and variant.rounds >= 1, variant
    assert variant.speedup is not None and variant.speedup > 1.0, variant
    assert variant.verdict == "faster" or variant.budget_to_tell_s, variant
    assert variant.verdict != "slower", variant
    assert waited <= plain + DEFAULT_BUDGET_S + PROMISE_SLACK_S, (waited, plain)
    _budget_kept(report)


@pytest.fixture(autouse=True)
def _anomaly_off():
    yield
    import torch

    torch.autograd.set_detect_anomaly(False)
