"""A cell that runs out of memory: recognise the error and say what it asked for, where, and
how much memory was in use, so the report can say what makes the cell fit."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import types

import torch

from ..cell.workload import Workload
from ..report import OutOfMemory

_CPU_ASKED = re.compile(r"you tried to allocate (\d+) bytes")
_CUDA_ASKED = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]i?B)")
_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9}
RSS_MEASURE = "resident memory of the kernel process (RSS) when the allocation failed"
CUDA_MEASURE = "CUDA tensor memory allocated when the allocation failed"


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), or the CPU allocator's failure to get memory."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "DefaultCPUAllocator: can't allocate memory" in text or "out of memory" in text.lower()
    )


def describe(error: BaseException, workload: Workload, device: str) -> OutOfMemory:
    """The error, the cell line that asked, the size it asked for and the memory in use."""
    text = f"{type(error).__name__}: {error}"
    return OutOfMemory(
        error=text.splitlines()[0],
        line=_cell_line(error, workload),
        requested_bytes=_requested(str(error)),
        in_use_bytes=_in_use(device),
        in_use_measure=CUDA_MEASURE if device == "cuda" else RSS_MEASURE,
    )


def release_failed_run(error: BaseException, workload: Workload) -> int:
    """Free what the failed run still holds: its traceback keeps every frame it went
    through, and their locals keep the activations that did not fit (a plain kernel keeps
    them too, until the traceback is dropped), so nothing else would fit in their place.
    The locals of the frames below the cell's own are cleared, and so is the per-call
    closure of `Module._call_impl` (torch makes one on every module call while global
    module hooks, such as the probe's, are registered; it holds the call's inputs and
    output). The traceback still shows every line. Returns how many frames were cleared."""
    names = {workload.filename, workload.fixed_filename}
    cleared = 0
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename not in names:
            _clear_module_call_closure(frame)
            try:
                frame.clear()
                cleared += 1
            except RuntimeError:  # still executing (ours, up the stack): keep it
                pass
        tb = tb.tb_next
    gc.collect()
    return cleared


def _module_call_inner() -> types.CodeType | None:
    """The code of the closure `Module._call_impl` defines per call (`inner`)."""
    consts = torch.nn.Module._call_impl.__code__.co_consts
    return next((c for c in consts if isinstance(c, types.CodeType) and c.co_name == "inner"), None)


def _clear_module_call_closure(frame: types.FrameType) -> None:
    """Empty the cells of a finished `_call_impl` call's `inner` closure run by `frame` (a
    frame holds its function; only that dead per-call closure is touched)."""
    inner = _module_call_inner()
    if inner is None or frame.f_code is not inner:
        return
    for func in gc.get_referents(frame):
        if isinstance(func, types.FunctionType) and func.__code__ is inner:
            for cell in func.__closure__ or ():
                with contextlib.suppress(ValueError):  # already empty
                    del cell.cell_contents


def _cell_line(error: BaseException, workload: Workload) -> int | None:
    """The innermost line of the cell's own code in the traceback."""
    names = {workload.filename, workload.fixed_filename}
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in names:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _requested(text: str) -> int | None:
    found = _CPU_ASKED.search(text)
    if found:
        return int(found.group(1))
    found = _CUDA_ASKED.search(text)
    if found:
        return int(float(found.group(1)) * _UNITS[found.group(2)])
    return None


def _in_use(device: str) -> int | None:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
