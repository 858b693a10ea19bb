"""The load meter (probe/load.py) with real processes: another process busy on our CPUs
reads as other load; our own busy loop, and children we start as workers, do not.

The machine these run on may be busy with other people's work, which the meter rightly
counts: each test asserts against CPU time it can see independently (a process's own
counters in /proc) rather than against an idle machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from busy_process import BUSY, other_busy_process

from torchtune_magic.cell.workload import Workload
from torchtune_magic.probe import load, probe

pytestmark = pytest.mark.skipif(load.reading() is None, reason="needs /proc (Linux)")
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
SLACK_S = 4 * TICK_S  # /proc counts whole ticks, per CPU and per process
WINDOW_S = 2.0


def _cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of a process, from its own counters."""
    fields = _stat(pid)
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) * TICK_S


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2 :].split()


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and int(_stat(int(name))[1]) == pid:
                found.append(int(name))
        except OSError:  # it ended meanwhile
            pass
    return found


@contextmanager
def _pinned_to_one_cpu() -> Iterator[None]:
    """This thread (and what it starts) on one CPU: there, what we run and what others
    run add up to at most one CPU-second per second, whatever else the machine does."""
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mask)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_another_busy_process_on_our_cpus_reads_as_about_one_busy_cpu():
    with other_busy_process() as pid:
        before_s, start = _cpu_s(pid), load.reading()
        time.sleep(1.0)
        end, busy_s = load.reading(), _cpu_s(pid) - before_s
    measured = load.between(start, end)
    assert measured is not None and measured.cpus == len(os.sched_getaffinity(0))
    assert 0.9 < measured.window_s < 3
    # all it ran is counted; and while it was ready to run on our CPUs, they were never
    # idle: at least about one of them was busy with work that is not ours
    assert measured.other_cpu_s >= busy_s - SLACK_S
    assert measured.busy_cpus > 0.9
    assert measured.busy_cpus <= measured.cpus and 0 <= measured.share <= 1
    assert measured.describe().startswith(
        f"other processes kept {measured.busy_cpus:.2f} of this kernel's {measured.cpus} CPU"
    )


def test_the_jobs_other_ranks_are_our_own_work_not_other_load():
    """Under torchrun the job's other ranks on this host are not our descendants (torchrun's
    agent starts them all): counted as ours, a busy one no longer reads as another
    process's load, and one that is not counted still does."""
    try:
        with other_busy_process() as pid:
            load.count_as_ours([pid])
            start = load.reading()
            time.sleep(1.0)
            counted = load.since(start)
            load.count_as_ours([])
            start = load.reading()
            time.sleep(1.0)
            not_counted = load.since(start)
    finally:
        load.count_as_ours([])
    assert counted is not None and not_counted is not None
    # the spinning rank's CPU, and nothing else, is what the two readings differ by
    assert not_counted.busy_cpus - counted.busy_cpus > 0.7, (counted, not_counted)


def test_short_windows_summed_unclamped_read_what_one_window_over_them_reads():
    """A round of a fast cell lasts a few milliseconds, under a clock tick, so each reads a
    tick too many or too few; summed unclamped they read what one window over all of them
    reads (clamping each would keep only the ticks too many: a quiet machine read half a
    CPU busy over rounds of 3 ms)."""
    first, pieces = load.reading(), []
    while (whole := load.since(first)) is not None and whole.window_s < 1.5:
        start = load.reading()
        _spin(0.003)
        piece = load.since(start, clamped=False)
        assert piece is not None
        pieces.append(piece)
    assert whole is not None and len(pieces) > 200
    summed = sum(p.other_cpu_s for p in pieces) / sum(p.window_s for p in pieces)
    assert abs(summed - whole.busy_cpus) < 0.2, (summed, whole.busy_cpus)


def _ours_tell(ours: float, slack: float) -> None:
    """On one CPU, others can have had only what we did not: `busy_cpus <= 1 - ours +
    slack`. A meter counting our work as theirs would read about 1 on a CPU kept busy,
    which that bound tells apart only when we had more than the slack."""
    if ours < 2 * slack:
        pytest.skip(f"other work left this test {ours:.0%} of its CPU: too little to tell")


def test_our_own_busy_loop_is_not_other_load():
    with _pinned_to_one_cpu():
        own, start = os.times(), load.reading()
        _spin(WINDOW_S)
        end, after = load.reading(), os.times()
    measured = load.between(start, end)
    assert measured is not None and measured.cpus == 1
    ours = (after.user + after.system - own.user - own.system) / measured.window_s
    slack = SLACK_S / measured.window_s
    _ours_tell(ours, slack)
    assert measured.busy_cpus <= 1 - ours + slack


def test_workers_we_start_are_not_other_load_even_when_they_end_or_start_their_own():
    """A child started inside the window (as DataLoader workers start during a run), a
    grandchild it starts, and a child that ends and is waited for before the window ends:
    all the cell's own work."""
    with _pinned_to_one_cpu():
        waited, start = os.times(), load.reading()
        worker = subprocess.Popen([sys.executable, "-c", BUSY])
        # its own process group, so the grandchild goes with it
        shell = f"{sys.executable} -c '{BUSY}'; true"
        via_shell = subprocess.Popen(["sh", "-c", shell], start_new_session=True)
        try:
            brief = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\n"
                                      "while time.time() - t < 0.3: pass"])  # fmt: skip
            brief.wait()
            time.sleep(WINDOW_S)
            [grandchild] = _children(via_shell.pid)
            children_s = _cpu_s(worker.pid) + _cpu_s(via_shell.pid) + _cpu_s(grandchild)
            end, now = load.reading(), os.times()
        finally:
            worker.kill()
            os.killpg(via_shell.pid, 9)
            for child in (worker, via_shell):
                child.wait()
    measured = load.between(start, end)
    assert measured is not None and measured.cpus == 1
    waited_s = now.children_user + now.children_system - waited.children_user
    ours = (children_s + waited_s - waited.children_system) / measured.window_s
    slack = 2 * SLACK_S / measured.window_s  # four processes' counters, in whole ticks
    _ours_tell(ours, slack)
    assert measured.busy_cpus <= 1 - ours + slack


def test_readings_are_cheap_with_a_few_children():
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])]
    children += [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        load.reading()  # the first reading classifies every process on the machine
        costs = []
        for _ in range(50):
            started = time.perf_counter()
            load.reading()
            costs.append(time.perf_counter() - started)
    finally:
        for child in children:
            child.kill()
            child.wait()
    costs.sort()
    assert costs[len(costs) // 2] < 1e-3  # ~0.2 ms here with these four children


def test_a_changed_affinity_mask_gives_no_load_and_no_reading_gives_none():
    start = load.reading()
    with _pinned_to_one_cpu():
        end = load.reading()
    if len(os.sched_getaffinity(0)) > 1:
        assert load.between(start, end) is None
    assert load.since(None) is None


def test_the_probe_records_the_load_during_its_run():
    cell = (
        "import time\nend = time.perf_counter() + 0.5\nwhile time.perf_counter() < end:\n    pass\n"
    )
    with other_busy_process():
        obs = probe.run(Workload(cell, {}), "cpu")
    assert obs.load is not None and obs.load.cpus == len(os.sched_getaffinity(0))
    assert obs.wall_s <= obs.load.window_s < obs.wall_s + 0.5  # the run, and a little more
    assert obs.load.busy_cpus > 0.9  # the busy process, at the least
