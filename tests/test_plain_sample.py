"""Short plain runs of a cell (probe/plain_sample.py): stopped at their limit wherever the
cell is, the kernel's state put back after each, nothing left armed afterwards."""

from __future__ import annotations

import signal
import threading
import time

import torch

from torchtune_magic.cell.workload import Workload
from torchtune_magic.probe import plain_sample

FOREVER = """
seen = []
while True:
    try:
        counter.add_(1)
        seen.append(1)
    except Exception:  # a cell's own handler does not swallow the stop
        pass
"""


def test_a_cell_that_never_ends_is_stopped_at_the_limit_and_its_state_put_back():
    counter = torch.zeros(())
    namespace = {"torch": torch, "counter": counter}
    started = time.perf_counter()
    samples = plain_sample.runs(Workload(FOREVER, namespace), count=2, limit_s=0.3)
    assert time.perf_counter() - started < 5
    assert samples is not None and len(samples) == 2
    for sample in samples:
        assert not sample.whole and 0.25 < sample.seconds < 2.5
        assert sample.faults >= 0 and sample.faults_per_s >= 0
    assert counter.item() == 0 and namespace["counter"] is counter  # same object, put back
    assert "seen" not in namespace  # the name the cell bound is gone again
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_a_short_cell_runs_whole_and_what_it_prints_is_swallowed(capsys):
    namespace = {"torch": torch, "x": torch.ones(3)}
    samples = plain_sample.runs(Workload("print('hi')\ny = x * 2\n", namespace), 2, 5.0)
    assert samples is not None and all(sample.whole for sample in samples)
    assert "y" not in namespace
    assert capsys.readouterr().out == ""


def test_a_cell_that_raises_gives_no_figures_and_leaves_the_state_as_it_was():
    x = torch.ones(3)
    namespace = {"torch": torch, "x": x}
    assert (
        plain_sample.runs(Workload("x.mul_(5)\nraise ValueError('no')\n", namespace), 2, 5.0)
        is None
    )
    assert torch.equal(x, torch.ones(3))


def test_stops_that_land_as_the_cell_ends_leave_nothing_armed():
    """A limit about as long as the cell: some runs end just before their stop, some are
    stopped; none lets a stop out afterwards or leaves our handler installed."""
    namespace = {"time": time}
    for _ in range(20):
        samples = plain_sample.runs(Workload("time.sleep(0.02)\n", namespace), 1, 0.02)
        assert samples is not None
        for _ in range(10_000):  # a stray stop would be raised in this loop
            pass
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_outside_the_main_thread_no_run_is_made():
    namespace = {"ran": []}
    results = []
    thread = threading.Thread(
        target=lambda: results.append(
            plain_sample.runs(Workload("ran.append(1)\n", namespace), 1, 1.0)
        )
    )
    thread.start()
    thread.join()
    assert results == [None] and namespace["ran"] == []
