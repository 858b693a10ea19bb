"""Timed runs at the stack depth the plain cell runs at, where the cell's cost depends on it.

Anomaly detection stores the Python stack (`traceback.format_stack()`) with every autograd
node a forward creates, so an anomaly cell costs more the deeper it runs. A `%%perfcheck`
cell runs inside IPython's magic dispatch, the session, the timing loop and the fixes'
contexts: 15-25 frames deeper than IPython runs the same cell plain. Measured on this
project's 2-core machine, the same MLP step took 9.7 ms at a notebook cell's depth and
11.7 ms 20 frames deeper, so a baseline timed where perfcheck stands is slower than the
user's own run of the cell, and the anomaly fix's speedup overstated by 20-30%.

Python cannot call a function higher in the stack than its caller, so such a run goes to a
fresh thread, and the cell's frame is put at the plain depth there by padding the thread's
stack with frames of this module (format_stack's cost follows the number of frames). The
thread starts in the caller's thread-local torch modes, Ctrl-C in the caller is passed on to
it as a KeyboardInterrupt, and the caller returns only once the run has unwound (every fix's
context exited). Where a fresh thread could not reproduce what the cell runs under — a torch
mode or profiler of the caller's thread, or autocast entered outside the cell — the run
stays where it is (`ThreadModes.capture` returns None).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# frames of these modules are the machinery around a cell, not where a plain cell runs
_MACHINERY = ("torchtune_magic", "IPython")
_JOIN_POLL_S = 0.1


def depth(frame: FrameType | None) -> int:
    """How many frames the stack holds from `frame` out to its thread's first (1: it is
    the first)."""
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


@dataclass(frozen=True)
class ThreadModes:
    """The caller's thread-local torch state a fresh thread must start in (grad mode and
    the global switches are set again by each run's restore, in the thread itself)."""

    grad_enabled: bool
    inference: bool
    cuda_device: int | None

    @classmethod
    def capture(cls) -> ThreadModes | None:
        """None where a fresh thread would not run the cell as this one does: a torch
        function or dispatch mode, a profiler or autocast active in this thread (each is
        thread-local, and entering it again elsewhere would not be the user's object)."""
        if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
            return None
        if torch.autograd._profiler_enabled():
            return None
        if any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda")):
            return None
        device = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), device)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.cuda_device is not None:
                torch.cuda.set_device(self.cuda_device)
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            yield


def in_fresh_thread(run: Callable[[], T], modes: ThreadModes) -> T:
    """`run()` in a new thread started in `modes`; its result or exception comes back to
    the caller. Ctrl-C while it runs raises KeyboardInterrupt inside it (at its next Python
    line), waits until it has unwound, then raises here."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            with modes.entered():
                outcome["value"] = run()
        except BaseException as error:  # handed to the caller, raised there
            outcome["error"] = error

    thread = threading.Thread(target=target, name="perfcheck-timed-run", daemon=True)
    thread.start()
    interrupted = False
    while thread.is_alive():
        try:
            thread.join(_JOIN_POLL_S)
        except KeyboardInterrupt:
            interrupted = True
            _raise_in(thread, KeyboardInterrupt)
    if "error" in outcome:
        error = outcome["error"]
        raise error.with_traceback(error.__traceback__)
    if interrupted:  # the run ended before the interrupt reached it
        raise KeyboardInterrupt
    return outcome["value"]


def _raise_in(thread: threading.Thread, error: type[BaseException]) -> None:
    """Raise `error` in `thread` when it next runs Python code."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(error)
        )
