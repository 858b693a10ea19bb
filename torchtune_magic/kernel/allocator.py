"""The C allocator under torch's CPU tensors: glibc's thresholds, what page faults cost.

torch allocates CPU tensors with `posix_memalign`. glibc serves a block at or above its mmap
threshold with a fresh `mmap` and gives it back with `munmap` when freed; it also trims free
memory at the top of its heap back to the OS past the trim threshold. A loop that frees
and re-allocates large tensors every step (activations, set-to-None gradients) then faults
every page in again, zero-filled by the kernel. glibc raises the mmap threshold by itself
once a mapped block is freed (up to 32 MiB), so how often that happens depends on what the
process allocated before.

`mallopt` sets both thresholds at run time. glibc cannot report their current values, and
once either is set it stops adjusting them by itself for the rest of the process: "undo"
can only set them to what the process started with (the `MALLOC_*_` environment variables
or `GLIBC_TUNABLES`) or else glibc's documented defaults (128 KiB each).

Because freeing a mapped block moves the threshold, perfcheck keeps its own large copies of
the user's tensors (state snapshots, numerics) out of malloc altogether (`outside_copy`):
otherwise taking and dropping them would change how the cell's allocations are served, and
its timings, during the measurement and after it.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import statistics
import time
from pathlib import Path

import torch

KIB, MIB = 1 << 10, 1 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
# glibc's documented defaults (mallopt(3)): both 128 KiB.
DEFAULTS = {M_MMAP_THRESHOLD: 128 * KIB, M_TRIM_THRESHOLD: 128 * KIB}
NAMES = {M_MMAP_THRESHOLD: "M_MMAP_THRESHOLD", M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD"}
ENV = {M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_", M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_"}
TUNABLES = {
    M_MMAP_THRESHOLD: "glibc.malloc.mmap_threshold",
    M_TRIM_THRESHOLD: "glibc.malloc.trim_threshold",
}
# What the fix sets. 32 MiB is the largest mmap threshold glibc accepts on 64-bit (half its
# 64 MiB heap size) and the ceiling of its own dynamic threshold, so every block glibc would
# ever keep, it keeps; 128 MiB of free heap top stays with the process instead of being
# trimmed. Measured here on an MLP freeing 4 MiB gradients each step (fresh process, one
# thread): 0.52 s and 60-80k faults per 20 steps at glibc's settings, 0.30 s and 0 faults
# with these; the 4 MiB threshold often suggested kept every 4 MiB block mapped (82k faults).
FIX_THRESHOLDS = {M_MMAP_THRESHOLD: 32 * MIB, M_TRIM_THRESHOLD: 128 * MIB}
FAULT_PROBE_BYTES = 4 * MIB
FAULT_PROBE_ROUNDS = 8
PRELOADABLE = {
    "jemalloc": ("libjemalloc.so.2", "apt install libjemalloc2 / conda install jemalloc"),
    "tcmalloc": (
        "libtcmalloc.so.4",
        "apt install libgoogle-perftools4 / conda install gperftools",
    ),
}
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, where this process runs on it (musl and macOS have no tunable mallopt)."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def glibc_version() -> str | None:
    libc = _libc()
    return libc.gnu_get_libc_version().decode() if libc is not None else None


@functools.cache
def reports_faults() -> bool:
    """Whether the OS reports this process's page faults (getrusage; not on Windows)."""
    try:
        import resource  # noqa: F401
    except ImportError:
        return False
    return True


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where the OS does not report them)."""
    if not reports_faults():
        return 0
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def outside_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`; at DEFAULTS' mmap threshold (128 KiB, the least glibc ever
    maps) or above, in an anonymous memory map of its own, freed with it by `munmap`, so
    malloc never sees it. (Smaller blocks come from the heap and never move the threshold.)"""
    source = tensor.detach()
    nbytes = source.numel() * source.element_size()
    if nbytes < DEFAULTS[M_MMAP_THRESHOLD] or source.layout != torch.strided or source.is_quantized:
        return source.to("cpu", copy=True)
    buffer = mmap.mmap(-1, nbytes)
    # frombuffer holds a reference to the map: it is unmapped when the copy is freed
    copy = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    copy = copy.view(source.dtype).view(source.shape)
    copy.copy_(source)
    return copy


def give_back_freed() -> None:
    """Hand the free memory glibc keeps inside its heaps back to the OS (`malloc_trim(0)`).

    glibc returns freed memory by itself only from the top of a heap. The profiler that
    perfcheck's instrumented runs use (the probe, each configuration's peak memory) fills the
    heap with its event buffers between allocations that stay, and frees them afterwards:
    holes glibc keeps. Measured here on a 4-layer MLP training cell, 20 profiled runs grew a
    process from 324 to 480 MiB resident (20 plain runs: flat), all of it free heap that
    `malloc_trim(0)` gave back. Called once a %%perfcheck run or a Re-time is over, when
    nothing timed follows: the pages it releases are faulted in again by whatever next
    reuses them. A no-op where malloc is not glibc's (musl, macOS, a preloaded jemalloc or
    tcmalloc, which manage their own)."""
    libc = _libc()
    if libc is None or preloaded() is not None:
        return
    libc.malloc_trim(0)


def preloaded() -> str | None:
    """The allocator replacing glibc's malloc here ("jemalloc", "tcmalloc"), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = os.environ.get("LD_PRELOAD", "")
    for name in PRELOADABLE:
        if f"lib{name}" in maps:
            return name
    return None


def set_thresholds(values: dict[int, int]) -> None:
    """`mallopt` each threshold; OSError when glibc refuses one (nothing else is undone:
    the caller's Patcher puts back the starting values)."""
    libc = _libc()
    if libc is None:
        raise OSError("this process does not run on glibc: mallopt is not available")
    for option, value in values.items():
        if libc.mallopt(option, value) != 1:
            raise OSError(f"glibc refused mallopt({NAMES[option]}, {value})")


def starting_thresholds() -> dict[int, int]:
    """What the process started with: the environment's `MALLOC_*_` variables or
    `GLIBC_TUNABLES` where set (glibc read them at start-up), else glibc's defaults."""
    tunables = dict(
        item.split("=", 1)
        for item in os.environ.get("GLIBC_TUNABLES", "").split(":")
        if "=" in item
    )
    values = {}
    for option, default in DEFAULTS.items():
        text = os.environ.get(ENV[option]) or tunables.get(TUNABLES[option])
        try:
            values[option] = int(text, 0) if text else default
        except ValueError:
            values[option] = default
    return values


def restore_thresholds() -> None:
    set_thresholds(starting_thresholds())


@functools.cache
def fault_cost_s() -> float:
    """Seconds one minor page fault costs here: first-touching fresh anonymous pages (mapped,
    faulted, zero-filled by the kernel, unmapped — what a re-allocated tensor pays) against
    touching pages already there; the median of a few rounds, measured once per process
    (~4 µs in a VM, well under 1 µs on bare metal)."""
    page = mmap.PAGESIZE
    kept = mmap.mmap(-1, FAULT_PROBE_BYTES)
    warm = torch.frombuffer(kept, dtype=torch.uint8)
    warm[::page].fill_(1)
    costs = []
    for _ in range(FAULT_PROBE_ROUNDS):
        before, start = minor_faults(), time.perf_counter()
        block = mmap.mmap(-1, FAULT_PROBE_BYTES)
        view = torch.frombuffer(block, dtype=torch.uint8)
        view[::page].fill_(1)
        del view
        block.close()
        fresh_s = time.perf_counter() - start
        faults = minor_faults() - before
        start = time.perf_counter()
        warm[::page].fill_(1)
        warm_s = time.perf_counter() - start
        if faults > 0:
            costs.append(max(fresh_s - warm_s, 0.0) / faults)
    del warm
    kept.close()
    return statistics.median(costs) if costs else 0.0


def preload_command(name: str) -> str:
    """How to start Jupyter with `name` preloaded, with the library's path on this machine
    when it is installed (else the usual Debian/Ubuntu path and how to install it)."""
    library, install = PRELOADABLE[name]
    for folder in LIBRARY_DIRS:
        path = Path(folder) / library
        if path.exists():
            return f"LD_PRELOAD={path} jupyter lab"
    return f"LD_PRELOAD=/usr/lib/x86_64-linux-gnu/{library} jupyter lab   ({install})"


def environment_command(values: dict[int, int]) -> str:
    """The thresholds as environment variables on the command that starts the kernel."""
    assignments = " ".join(f"{ENV[option]}={value}" for option, value in values.items())
    return f"{assignments} jupyter lab"
