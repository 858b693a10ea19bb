"""A cell that runs out of memory: recognise the error and say what it asked for, where, and
how much memory was in use, so the report can say what makes the cell fit."""

from __future__ import annotations

import os
import re

import torch

from ..report import OutOfMemory
from .workload import Workload

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
