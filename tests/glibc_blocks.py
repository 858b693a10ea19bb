"""glibc's public allocator statistics, to see whether it serves a block with its own mmap
(which it does only at or above its current mmap threshold; glibc cannot report the
threshold itself). For tests that run in a fresh process, so glibc starts as a user's does."""

from __future__ import annotations

import ctypes


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]


def mapped(nbytes: int) -> bool:
    """Whether glibc serves a fresh block of `nbytes` with its own mmap: only when its mmap
    threshold is at most `nbytes` (glibc's default: 128 KiB). Asking moves the threshold:
    when the block was mapped, freeing it raises the threshold past `nbytes`."""
    libc.malloc_trim(0)  # no free heap top left over to serve it from
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(nbytes)
    result = libc.mallinfo2().hblkhd - before >= nbytes
    libc.free(block)
    return result
