"""Anomaly cells are measured under the stack IPython runs the plain cell under.

Anomaly detection stores the Python stack with every autograd node, so the same cell costs
more the deeper it runs and the more files its stack holds; perfcheck's own frames (magic,
session, timing loop, fixes) would otherwise make its baseline slower than the user's plain
run. Real IPython shell, real torch: the cell itself records the stack above it as a stack
capture formats it (what anomaly mode stores), its thread and its greenlet.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from typing import Any

import greenlet
import pytest
import torch

from torchtune_magic import perfcheck
from torchtune_magic.kernel import plain_stack
from torchtune_magic.report import Report

SETUP = """
import sys, threading, traceback
import greenlet
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 16), torch.randn(32, 1)
import types
log = types.ModuleType("log")  # every run's record: modules are not restored between runs
log.seen = []
"""

CELL = """
with torch.autograd.detect_anomaly(){grad}:
    log.seen.append((tuple(traceback.format_stack()[:-1]),
                     greenlet.getcurrent().parent is not None,
                     threading.current_thread().name, torch.is_grad_enabled(),
                     torch.is_anomaly_enabled()))
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""
ANOMALY_CELL = CELL.format(grad="")
PLAIN_CELL = CELL.replace("torch.autograd.detect_anomaly(){grad}", "torch.enable_grad()")


# the stack above the cell as anomaly mode stores it, on a greenlet of perfcheck's, thread,
# grad mode, anomaly mode
Seen = tuple[tuple[str, ...], bool, str, bool, bool]


def _seen(ip: Any) -> list[Seen]:
    return list(ip.user_ns["log"].seen)


def test_measuring_runs_of_an_anomaly_cell_run_under_the_plain_cells_stack(ip: Any) -> None:
    ip.run_cell(SETUP)
    magic = "%%perfcheck --budget 2 -q -o --checks debug-anomaly"
    results = [ip.run_cell(cell) for cell in (ANOMALY_CELL, magic + ANOMALY_CELL)]  # one line
    report = results[1].result

    (plain_stack, plain_fresh, *_), probe, *measuring = _seen(ip)
    assert not plain_fresh
    timed = report.baseline.runs + sum(v.runs or 0 for v in report.variants)
    assert report.cell_run.status == "probe"  # the probe ran it whole: the kernel's one run
    assert not probe[1] and len(probe[0]) > len(plain_stack)  # where perfcheck runs: deeper
    assert any("torchtune_magic" in line for line in probe[0])
    assert len(measuring) >= timed
    anomalous = [run for run in measuring if run[4]]
    assert len(anomalous) >= report.baseline.runs
    # every measuring run with anomaly detection on reads, to a stack capture, as the plain
    # run: the same files, lines, line text and names, frame for frame
    assert all(fresh and stack == plain_stack for stack, fresh, *_ in anomalous), (
        plain_stack,
        anomalous[0][0],
    )
    # with it off (the fix measured), the stack costs nothing: the runs stay in place
    assert not any(fresh for _, fresh, _, _, anomaly in measuring if not anomaly)
    assert {thread for _, _, thread, *_ in _seen(ip)} == {"MainThread"}  # the kernel's thread


def test_a_cell_without_anomaly_stays_on_perfchecks_stack(ip: Any) -> None:
    ip.run_cell(SETUP)
    ip.run_cell("%%perfcheck --budget 1 -q" + PLAIN_CELL)
    assert _seen(ip) and not any(fresh for _, fresh, *_ in _seen(ip))


def test_the_fresh_stack_keeps_the_threads_torch_modes() -> None:
    from workloads import namespace_with

    ns = namespace_with(SETUP + "log.modes = []\n")
    cell = (
        "log.modes.append((greenlet.getcurrent().parent is not None, torch.is_grad_enabled()))"
        + ANOMALY_CELL.replace("detect_anomaly():", "detect_anomaly(), torch.enable_grad():")
    )
    torch.set_grad_enabled(False)  # as an earlier cell can leave it, for the whole kernel
    try:
        perfcheck(cell, ns, budget=1, checks="debug-anomaly")
    finally:
        torch.set_grad_enabled(True)
    modes = set(ns["log"].modes)
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
    assert any(fresh for _, fresh, *_ in ns["log"].seen)
    assert greenlet.getcurrent().parent is None  # back on the caller's own stack
    assert torch.autograd.detect_anomaly is detect_anomaly and not torch.is_anomaly_enabled()
    # the kernel as after the cell's one run (the probe ran it whole)
    for mine, theirs in zip(ns["model"].parameters(), plain["model"].parameters(), strict=True):
        assert torch.equal(mine, theirs)


CAPTURE = compile(
    "sink.append((traceback.format_stack()[:-1], greenlet.getcurrent().parent is not None))",
    "<cell>",
    "exec",
)


def _replayed(code: Any, names: dict[str, Any]) -> None:
    """Stands where the cell's own frame would stand, and runs the cell under a replica of
    the stack outside it."""
    plain_stack.PlainStack.of_caller().run(exec, code, names)


def _run(how: Any, sink: list[Any]) -> None:
    how(CAPTURE, {"sink": sink, "traceback": traceback, "greenlet": greenlet})


def test_a_replica_stack_reads_as_the_plain_one_frame_for_frame() -> None:
    """What a stack capture in the cell formats — files, lines, line text, names, how many
    — is what it formats in a plain run of the cell at the same place."""
    plain: list[Any] = []
    replayed: list[Any] = []
    for how, sink in ((exec, plain), (_replayed, replayed)):
        _run(how, sink)  # the same line for both
    ((plain_text, plain_fresh),), ((text, fresh),) = plain, replayed
    assert not plain_fresh and fresh  # the replica runs on a stack of its own
    assert any("test_plain_stack.py" in line and "_run(how, sink)" in line for line in text)
    assert text == plain_text
