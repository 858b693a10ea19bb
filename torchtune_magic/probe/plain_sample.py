"""Short uninstrumented runs of the cell, for the evidence the probe's instrumentation skews.

The probe runs the cell under hooks and the profiler, which change what some checks count:
the profiler's event buffers alone took 440k minor page faults over a 3000-step raw-tensor
training loop that takes a few dozen in a plain run. A check that needs the plain cell's
figures runs it here, as a user would (no hooks, no profiler, output swallowed), for at
most `limit_s` a run: a cell still running then is stopped wherever it is, as Ctrl-C would
stop it, and its figures cover the time it ran (its first steps). Before the runs the
state is snapshotted (`state.take`) and it is put back after each run, so the kernel ends
as it was.

The stop is a timer thread that trips SIGALRM's Python handler in the main thread
(`_thread.interrupt_main`): no real signal reaches the process, so no system call of torch's
threads is interrupted. Python runs signal handlers in the main thread only, so elsewhere
(and where SIGALRM has a handler of someone else's) no run is made.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..cell.workload import CellError, Workload, silenced
from ..kernel import allocator, discovery, state

# a snapshot larger than this share of free host memory is not taken (nor are the runs)
LANDING_S = 0.1  # how long a pending trip is waited for (it lands within microseconds)


@dataclass(frozen=True)
class Sample:
    """One plain run: its wall time and minor page faults, to its end or to the stop."""

    seconds: float
    faults: int
    whole: bool  # the cell ran to its end within the limit

    @property
    def faults_per_s(self) -> float:
        return self.faults / self.seconds if self.seconds > 0 else 0.0


class _TimeUp(BaseException):
    """Stops a run at its time limit; a BaseException, so the cell's `except Exception`
    lets it through."""


def _can_stop() -> bool:
    """Whether a run can be stopped at its limit here: in the main thread, on a platform
    with SIGALRM (not Windows), not handled by anyone else."""
    return (
        threading.current_thread() is threading.main_thread()
        and hasattr(signal, "SIGALRM")
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
    )


def runs(workload: Workload, count: int, limit_s: float) -> list[Sample] | None:
    """`count` plain runs of the cell from the state it is in now, each stopped after
    `limit_s`, the state put back after each. None when a run cannot be stopped here, a
    snapshot would not fit in memory, or the cell raised (its figures would not be the
    cell's)."""
    if not _can_stop():
        return None
    found = discovery.walk(workload.namespace)
    if state.too_big(found) is not None:
        return None
    snapshot = state.take(workload.namespace, found, workload.source)
    samples = []
    for _ in range(count):
        try:
            samples.append(_run(workload, limit_s))
        except CellError:
            return None
        finally:
            snapshot.restore()
    return samples


def _run(workload: Workload, limit_s: float) -> Sample:
    whole = False
    with silenced():
        started, faults = time.perf_counter(), allocator.minor_faults()
        try:
            with _stopped_after(limit_s):
                workload.run()
                whole = True
        except _TimeUp:
            pass
        seconds = time.perf_counter() - started
        faults = allocator.minor_faults() - faults
    return Sample(seconds, faults, whole)


@contextmanager
def _stopped_after(limit_s: float) -> Iterator[None]:
    """Raise _TimeUp in the main thread once `limit_s` has passed, unless the block ended
    first. The handler raises only while armed, and the previous handler goes back only
    once a trip on its way has landed on ours (landing on the default handler, Python
    would print "Signal 14 ignored due to race condition")."""
    armed = True
    tripped, landed = threading.Event(), threading.Event()

    def handler(signum: int, frame: object) -> None:
        landed.set()
        if armed:
            raise _TimeUp

    def trip() -> None:
        tripped.set()
        _thread.interrupt_main(signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, handler)
    timer = threading.Timer(limit_s, trip)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        armed = False  # first: no call before it, so no handler can run before it
        timer.cancel()
        timer.join()
        deadline = time.monotonic() + LANDING_S
        while tripped.is_set() and not landed.is_set() and time.monotonic() < deadline:
            pass  # a trip is pending: the loop's calls let the main thread run the handler
        signal.signal(signal.SIGALRM, previous)
