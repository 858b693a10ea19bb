"""Anomaly cells are measured at the depth IPython runs the plain cell at.

Anomaly detection stores the Python stack with every autograd node, so the same cell costs
more the deeper it runs; perfcheck's own frames (magic, session, timing loop, fixes) would
otherwise make its baseline slower than the user's plain run. Real IPython shell, real
torch: the cell itself records the depth of its own frame, its thread and its greenlet.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import greenlet
import pytest
import torch

from torchtune_magic import perfcheck
from torchtune_magic.engine import stack_depth
from torchtune_magic.report import Report

SETUP = """
import sys, threading
import greenlet
import torch
from torch import nn
from torchtune_magic.engine.stack_depth import depth
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 16), torch.randn(32, 1)
seen = []
"""

CELL = """
seen.append((depth(sys._getframe()), greenlet.getcurrent().parent is not None,
             threading.current_thread().name, torch.is_grad_enabled()))
with torch.autograd.detect_anomaly(){grad}:
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""
ANOMALY_CELL = CELL.format(grad="")
PLAIN_CELL = CELL.replace("torch.autograd.detect_anomaly(){grad}", "torch.enable_grad()")


Seen = tuple[int, bool, str, bool]  # depth, on a greenlet of perfcheck's, thread, grad mode


def _seen(ip: Any) -> list[Seen]:
    return list(ip.user_ns["seen"])


def test_measuring_runs_of_an_anomaly_cell_run_at_the_plain_cells_depth(ip: Any) -> None:
    ip.run_cell(SETUP)
    ip.run_cell(ANOMALY_CELL)
    ((plain_depth, plain_fresh, _, _),) = _seen(ip)
    assert not plain_fresh
    ip.user_ns["seen"].clear()

    magic = "%%perfcheck --budget 2 -q -o --checks debug-anomaly"
    report = ip.run_cell(magic + ANOMALY_CELL).result

    runs = _seen(ip)
    timed = report.baseline.runs + sum(v.runs or 0 for v in report.variants)
    assert report.cell_run.status == "probe"  # the probe ran it whole: the kernel's one run
    probe, *measuring = runs
    assert not probe[1] and probe[0] > plain_depth  # where perfcheck runs, deeper than plain
    assert len(measuring) >= timed
    assert all(fresh and depth == plain_depth for depth, fresh, _, _ in measuring), runs
    assert {thread for _, _, thread, _ in runs} == {"MainThread"}  # the kernel's own thread


def test_a_cell_without_anomaly_stays_on_perfchecks_stack(ip: Any) -> None:
    ip.run_cell(SETUP)
    ip.run_cell("%%perfcheck --budget 1 -q" + PLAIN_CELL)
    assert _seen(ip) and not any(fresh for _, fresh, _, _ in _seen(ip))


def test_the_fresh_stack_keeps_the_threads_torch_modes() -> None:
    from workloads import namespace_with

    ns = namespace_with(SETUP)
    cell = ANOMALY_CELL.replace("detect_anomaly():", "detect_anomaly(), torch.enable_grad():")
    torch.set_grad_enabled(False)  # as an earlier cell can leave it, for the whole kernel
    try:
        perfcheck(cell, ns, budget=1, checks="debug-anomaly")
    finally:
        torch.set_grad_enabled(True)
    modes = {(fresh, grad) for _, fresh, _, grad in ns["seen"]}
    assert (True, False) in modes and (True, True) not in modes


@pytest.fixture
def ctrl_c() -> Any:
    """Ctrl-C raises KeyboardInterrupt, as in a kernel, whatever the suite started with."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_run_on_the_fresh_stack_stops_it_and_undoes_every_fix(
    ctrl_c: None,
) -> None:
    from workloads import namespace_with

    plain = namespace_with(SETUP)
    exec(ANOMALY_CELL, plain)
    ns = namespace_with(SETUP)
    detect_anomaly = torch.autograd.detect_anomaly
    reports: list[Report] = []

    def interrupt_once_measuring(report: Report) -> None:
        reports.append(report)
        if len(reports) == 1:  # findings out: measuring starts now
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()

    with pytest.raises(KeyboardInterrupt):
        perfcheck(ANOMALY_CELL, ns, budget=30, on_report=interrupt_once_measuring)
    assert reports[-1].phase == "interrupted"
    assert any(fresh for _, fresh, _, _ in ns["seen"])
    assert greenlet.getcurrent().parent is None  # back on the caller's own stack
    assert torch.autograd.detect_anomaly is detect_anomaly and not torch.is_anomaly_enabled()
    # the kernel as after the cell's one run (the probe ran it whole)
    for mine, theirs in zip(ns["model"].parameters(), plain["model"].parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_call_at_puts_the_callees_frame_at_the_depth_asked() -> None:
    asked = stack_depth.depth(sys._getframe()) + 12
    got: list[int] = []
    stack_depth.call_at(asked, lambda: got.append(stack_depth.depth(sys._getframe())))
    assert got == [asked]
