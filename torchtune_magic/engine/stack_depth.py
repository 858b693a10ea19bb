"""Measuring runs at the stack depth the plain cell runs at, where the cell's cost depends on it.

Anomaly detection stores the Python stack (`traceback.format_stack()`) with every autograd
node a forward creates, and the cost of that grows with the frames on the stack and the
distinct source files among them (each is stat'ed per capture). A `%%perfcheck` cell runs
inside IPython's magic dispatch, the session, the timing loop and the fixes' contexts: 13 or
more frames from five more files than IPython runs the same cell under. So a baseline timed
where perfcheck stands reads slower than the user's own run of the cell, and the anomaly
fix's speedup high (long_cell benchmark: 2.07x sampled against 1.60x by a full-run A/B).

Python cannot call a function higher in the stack than its caller. A greenlet can: it runs
on a stack of its own, in the same OS thread, so everything thread-local (torch's grad and
autocast modes, a profiler recording this thread, glibc's malloc arena, the OpenMP team) is
what the cell has in the kernel. A fresh OS thread was tried first and measured ~10% slower
than the plain cell on the same loop: a thread allocates from a malloc arena of its own
(with MALLOC_ARENA_MAX=1 the difference went away). On the greenlet's stack the cell's frame
is put at the plain depth by padding with frames of this module. Without greenlet installed
the runs stay where they are (`fresh_stack_available`).
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

# frames of these modules are the machinery around a cell, not where a plain cell runs
_MACHINERY = ("torchtune_magic", "IPython")


def depth(frame: FrameType | None) -> int:
    """How many frames the stack holds from `frame` out to its first (1: it is the first)."""
    count = 0
    while frame is not None:
        count += 1
        frame = frame.f_back
    return count


def plain_cell_depth() -> int:
    """The depth a plain run of the cell would execute at: that of the first frame outward
    from the caller that is not perfcheck's or IPython's magic machinery — the notebook
    cell's own frame that called `%%perfcheck`, or the code that called `perfcheck()` (the
    cell would run there in place of the call)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _is_machinery(frame):
        frame = frame.f_back
    return depth(frame) if frame is not None else 1


def _is_machinery(frame: FrameType) -> bool:
    module = frame.f_globals.get("__name__") or ""
    return module.split(".")[0] in _MACHINERY or frame.f_code.co_filename.startswith(
        "<decorator-gen"
    )


def call_at(cell_depth: int, run: Callable[..., T], *args: Any) -> T:
    """`run(*args)` called from a frame at depth `cell_depth - 1`, so that code `run`
    executes (`exec` adds no Python frame of its own) has its frame at `cell_depth`. A
    caller already that deep or deeper calls it directly."""
    here = depth(sys._getframe())
    return _padded(cell_depth - 2 - here, run, args)


def _padded(frames: int, run: Callable[..., T], args: tuple[Any, ...]) -> T:
    """One frame per call: `frames` more of them, then `run`."""
    if frames <= 0:
        return run(*args)
    return _padded(frames - 1, run, args)


@functools.cache
def fresh_stack_available() -> bool:
    try:
        import greenlet  # noqa: F401
    except ImportError:
        return False
    return True


def on_fresh_stack(run: Callable[[], T]) -> T:
    """`run()` on a stack of its own (a greenlet in this thread, started in a copy of this
    context), its result or exception handed back here. Ctrl-C raises in it as anywhere
    in this thread, and unwinds it before reaching the caller."""
    import greenlet

    runner = greenlet.greenlet(run)
    runner.gr_context = contextvars.copy_context()
    return runner.switch()
