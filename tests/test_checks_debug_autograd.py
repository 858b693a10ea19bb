"""The first five checks: where they fire (with evidence), where they must stay silent,
and that every live fix round-trips exactly."""

from __future__ import annotations

import re

import pytest
import torch
from workloads import detected, namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.kernel.fixes import FixError

# the checks of this file (other families, e.g. CPU autocast, may fire on the same cells)
FIRST_FIVE = "debug-anomaly,debug-profiler,debug-gradcheck,no-grad,zero-grad-none"

PROFILED = """\
with torch.profiler.profile() as prof:
    for step in range(4):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
summary = prof.key_averages().table(row_limit=3)
"""

GRADCHECKED = """\
for step in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), Y)
    loss.backward()
    opt.step()
    probe_input = torch.randn(12, 12, dtype=torch.double, requires_grad=True)
    torch.autograd.gradcheck(lambda t: (t.sin() @ t).tanh().sum(), (probe_input,))
"""


def test_profiler_in_the_cell_is_found_and_the_fix_keeps_the_cell_running():
    ns = namespace_with()
    report = perfcheck(PROFILED, ns, budget=2, checks="debug-profiler")
    (finding,) = report.findings
    assert "torch.profiler.profile started 1 time during" in finding.evidence
    assert finding.where == "cell line 1"
    assert "-with torch.profiler.profile() as prof:" in finding.code_change.diff
    variant = report.variant_for(["debug-profiler"])
    assert variant.error is None and variant.speedup is not None
    assert isinstance(ns["summary"], str)  # the cell's own profiler result, as after one run


LEFT_RUNNING = """
import types
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(8)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(4, 16)  # tiny ops: recording each one costs about as much as running it
# counts every execution of the cell, measuring runs included (a module: the state guard
# leaves its attributes alone, where it would put a counter of the namespace back each run)
runs = types.ModuleType("runs")
runs.count = 0
prof = torch.profiler.profile(record_shapes=True)
prof.start()
"""
UNDER_PROFILER = """\
runs.count += 1
with torch.profiler.record_function("cell-run"):
    for step in range(20):
        opt.zero_grad()
        model(X).square().mean().backward()
        opt.step()
"""


def recorded(prof: torch.profiler.profile, name: str) -> int:
    return sum(1 for event in prof.events() if event.name == name)


def mark(name: str) -> None:
    with torch.profiler.record_function(name):
        torch.ones(2).add_(1)


def test_profiler_left_running_by_an_earlier_cell_is_measured_paused_and_resumes():
    ns = namespace_with(LEFT_RUNNING)
    prof = ns["prof"]
    try:
        report = perfcheck(UNDER_PROFILER, ns, budget=3, checks="debug-profiler")
        assert torch.autograd._profiler_enabled()  # still on after measuring
        mark("after-measuring")
    finally:
        prof.stop()
    (finding,) = report.findings
    assert finding.fixable and finding.where == "`prof`, started before this cell"
    assert finding.evidence.startswith("torch.profiler.profile `prof`, started before")
    assert "its trace has a gap there" in finding.caveat
    variant = report.variant_for(["debug-profiler"])
    assert variant.error is None and variant.numerics.verdict == "identical"
    assert variant.speedup > 1.3  # 1.64-1.97x in 8 perfcheck runs here (2.6x by hand)
    cell_runs = ns["runs"].count
    assert 0 < recorded(prof, "cell-run") < cell_runs  # the fix's runs are the gap
    assert recorded(prof, "after-measuring") == 1  # recording again afterwards


def test_the_profiler_toggle_pauses_until_undone_and_keeps_one_trace():
    ns = namespace_with(LEFT_RUNNING)
    prof = ns["prof"]
    try:
        session = detected(UNDER_PROFILER, ns)
        mark("before-toggle")
        session.apply("debug-profiler")
        mark("while-toggled-on")
        assert detected(UNDER_PROFILER, ns).detections == []  # paused: nothing to flag
        session.undo("debug-profiler")
        mark("after-toggle")
    finally:
        prof.stop()
    assert recorded(prof, "before-toggle") == recorded(prof, "after-toggle") == 1
    assert recorded(prof, "while-toggled-on") == 0


def test_a_stopped_profiler_is_not_restarted_by_undo_nor_paused_by_apply():
    ns = namespace_with(LEFT_RUNNING)
    try:
        session = detected(UNDER_PROFILER, ns)
        session.apply("debug-profiler")
    finally:
        ns["prof"].stop()  # the user stops it while the fix is on
    session.undo("debug-profiler")
    assert not torch.autograd._profiler_enabled()
    with pytest.raises(FixError, match="is stopped now"):
        session.apply("debug-profiler")


def test_a_legacy_autograd_profiler_entered_earlier_is_found_and_paused():
    ns = namespace_with()
    prof = torch.autograd.profiler.profile()
    prof.__enter__()
    try:
        session = detected("y = model(X).sum()", ns, checks="debug-profiler")
        (detection,) = session.detections
        session.apply("debug-profiler")
        mark("while-paused")
        session.undo("debug-profiler")
        mark("resumed")
    finally:
        prof.__exit__(None, None, None)
    assert detection.finding.where == "started before this cell"  # not bound to a name
    assert "prof.stop()" in " ".join(detection.finding.code_change.elsewhere)
    names = [event.name for event in prof.function_events]
    assert "resumed" in names and "while-paused" not in names


def test_gradcheck_in_the_loop_is_found_with_its_share_of_time():
    ns = namespace_with()
    report = perfcheck(GRADCHECKED, ns, budget=4, checks="debug-gradcheck")
    (finding,) = report.findings
    share = r"gradcheck took \d+% of the cell's time \(\d+\.\d+ s of \d+\.\d+ s\)"
    assert re.fullmatch(share, finding.evidence)
    assert finding.details == "gradcheck ran 3 times"
    assert finding.where == "cell line 7"
    variant = report.variant_for(["debug-gradcheck"])
    assert variant.speedup is not None and variant.speedup > 1.4  # 2.2x measured here


def test_gradcheck_outside_the_cell_work_is_silent():
    ns = namespace_with()
    probe_input = torch.randn(2, dtype=torch.double, requires_grad=True)
    torch.autograd.gradcheck(lambda t: t.sin().sum(), (probe_input,))
    report = perfcheck(
        "loss = model(X).sum()\nloss.backward()", ns, budget=1, checks="debug-gradcheck"
    )
    assert report.findings == []


def test_no_grad_hides_behind_a_user_class_and_is_silent_when_already_off():
    ns = namespace_with()
    exec(
        "class Evaluator:\n"
        "    def __init__(self, net):\n"
        "        self.net = net\n"
        "    def score(self, batch):\n"
        "        return self.net(batch).mean()\n"
        "evaluator = Evaluator(model)\n",
        ns,
    )
    report = perfcheck("s = evaluator.score(X)", ns, budget=1, checks=FIRST_FIVE)
    assert [f.id for f in report.findings] == ["no-grad"]
    assert report.findings[0].where == "model, cell line 1"
    quiet = perfcheck(
        "with torch.no_grad():\n    s = evaluator.score(X)", ns, budget=1, checks=FIRST_FIVE
    )
    assert quiet.findings == []


def test_manual_in_place_grad_zeroing_is_found_and_edited():
    ns = namespace_with()
    cell = (
        "for step in range(4):\n"
        "    for p in model.parameters():\n"
        "        if p.grad is not None:\n"
        "            p.grad.zero_()\n"
        "    torch.nn.functional.mse_loss(model(X), Y).backward()\n"
        "    opt.step()\n"
    )
    session = detected(cell, ns, budget=1)
    (detection,) = [d for d in session.detections if d.finding.id == "zero-grad-none"]
    assert detection.finding.fixable
    assert "+            p.grad = None" in detection.finding.code_change.diff
    assert "p.grad = None" in detection.fix.edit_source(cell)
    report = session.measure()
    assert report.variant_for(["zero-grad-none"]).error is None


def test_each_fix_round_trips_and_fixes_compose_in_any_order():
    cell = (
        "torch.autograd.set_detect_anomaly(True)\n"
        "for step in range(3):\n"
        "    opt.zero_grad(set_to_none=False)\n"
        "    torch.nn.functional.mse_loss(model(X), Y).backward()\n"
        "    opt.step()\n"
    )
    ns = namespace_with()
    session = detected(cell, ns, budget=1, checks=FIRST_FIVE)
    torch.autograd.set_detect_anomaly(True)  # as the cell leaves it
    names = {k: v for k, v in ns.items() if not k.startswith("__")}
    ids = [d.finding.id for d in session.fixable]
    assert ids == ["debug-anomaly", "zero-grad-none"]
    for order in (ids, list(reversed(ids))):
        for check_id in order:
            session.apply(check_id)
        assert not torch.is_anomaly_enabled()
        assert "zero_grad" in vars(ns["opt"])
        for check_id in reversed(order):
            session.undo(check_id)
        assert torch.is_anomaly_enabled()
        assert "zero_grad" not in vars(ns["opt"])
        assert all(ns[k] is v for k, v in names.items())
    torch.autograd.set_detect_anomaly(False)
