"""Measuring runs under the stack a plain run of the cell has, where the cell's cost depends on it.

Anomaly detection stores the Python stack (`traceback.format_stack()`) with every autograd
node a forward creates: one entry per frame (its file's line read and formatted) and one
`os.stat` per distinct source file among them. A `%%perfcheck` cell runs inside IPython's
magic dispatch, the session, the timing loop and the fixes' contexts: 13 or more frames
from five more files than the kernel runs the same cell under. So a baseline timed where
perfcheck stands reads slower than the user's own run of the cell, and the anomaly fix's
speedup high (long_cell benchmark: 2.07x sampled against 1.60x by a full-run A/B).

Python cannot call a function higher in the stack than its caller. A greenlet can: it runs
on a stack of its own, in the same OS thread, so everything thread-local (torch's grad and
autocast modes, a profiler recording this thread, glibc's malloc arena, the OpenMP team) is
what the cell has in the kernel. (A fresh OS thread measured ~10% slower than the plain
cell on the same loop: it allocates from a malloc arena of its own.) Padding that stack to
the plain cell's depth with frames of one file was not enough: the kernel's frames come
from a dozen files (ipykernel, tornado, asyncio, IPython), each stat'ed and read per
capture, and the anomaly fix measured 2.26x against 2.91x by the user's A/B. So the
greenlet's stack holds a replica of each frame outside the plain cell: a function compiled
under that frame's file name, with that frame's name, calling on that frame's line. Stack
captures in the cell then read the same lines of the same files, stat the same files, and
format the same text as in the plain run. Without greenlet installed the runs stay where
they are (`fresh_stack_available`).
"""

from __future__ import annotations

import builtins
import contextvars
import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

# frames of these modules are the machinery around a cell, not where a plain cell runs
_MACHINERY = ("torchtune_magic", "IPython")


@dataclass(frozen=True)
class FrameSpec:
    """What a stack capture reads of a frame: its file, the line it is at, its name, and
    the module it runs in."""

    filename: str
    lineno: int
    name: str
    module: str


@dataclass(frozen=True)
class PlainStack:
    """The frames a plain run of the cell would run under, outermost first: those outward
    from the first frame that is not perfcheck's or IPython's magic machinery — the
    notebook cell that called `%%perfcheck` (a plain cell would run in its place), or the
    code that called `perfcheck()`."""

    frames: tuple[FrameSpec, ...]

    @classmethod
    def of_caller(cls) -> PlainStack:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and _is_machinery(frame):
            frame = frame.f_back
        outer = []
        frame = frame.f_back if frame is not None else None
        while frame is not None:
            code = frame.f_code
            module = frame.f_globals.get("__name__") or ""
            outer.append(FrameSpec(code.co_filename, frame.f_lineno or 1, code.co_name, module))
            frame = frame.f_back
        return cls(tuple(reversed(outer)))

    def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` (a builtin such as `exec`, which adds no frame of its own) on a
        stack of its own under replicas of these frames, in this thread; its result or
        exception handed back here. Ctrl-C raises in it as anywhere in this thread, and
        unwinds it before reaching the caller."""
        import greenlet

        call: Callable[[], Any] = functools.partial(function, *args)
        for spec in reversed(self.frames):
            call = functools.partial(_replica(spec), call)
        runner = greenlet.greenlet(call)
        runner.gr_context = contextvars.copy_context()
        return runner.switch()


def _is_machinery(frame: FrameType) -> bool:
    module = frame.f_globals.get("__name__") or ""
    return module.split(".")[0] in _MACHINERY or frame.f_code.co_filename.startswith(
        "<decorator-gen"
    )


@functools.cache
def _replica(spec: FrameSpec) -> Callable[[Callable[[], Any]], Any]:
    """A function whose frame reads, to a stack capture, as `spec`'s: compiled under its
    file name with the call on its line, and named as it is. It calls its one argument
    (a `functools.partial`, which adds no Python frame)."""
    if spec.lineno > 1:
        source = "\n" * (spec.lineno - 2) + "def _(call):\n    return call()\n"
    else:
        source = "def _(call): return call()\n"
    module = compile(source, spec.filename, "exec")
    code = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    names = {"co_name": spec.name}
    if sys.version_info >= (3, 11):  # what 3.11+ tracebacks print
        names["co_qualname"] = spec.name
    code = code.replace(**names)
    return types.FunctionType(code, {"__name__": spec.module, "__builtins__": builtins})


@functools.cache
def fresh_stack_available() -> bool:
    try:
        import greenlet  # noqa: F401
    except ImportError:
        return False
    return True
