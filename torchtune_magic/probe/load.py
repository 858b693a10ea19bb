"""How much of this kernel's CPUs other processes took during a window: the load meter.

On a shared machine (a notebook server, a busy laptop, CI) other processes take CPU time
from the cell being measured. Beside one CPU-bound process on a 2-core machine, a 2.8 s
training cell ran 13.3 s with torch's two threads (2.96 s with one): its threads wait for
each other while one of them waits for a core. A reading taken before and after a run says
how much of the CPUs this process may use (its affinity mask) other processes kept busy:

    other CPU time = busy time of those CPUs (/proc/stat: user, nice, system, irq, softirq,
                     steal) - this process's CPU time - its descendants'

Descendants (DataLoader workers, anything the cell starts) do the cell's own work, so they
are not "other"; nor, under torchrun, do the job's other ranks on this host and theirs
(`count_as_ours`): two ranks of one thread on two cores are one job keeping both busy, not a
neighbour taking half the machine. They are found by parent pid in `/proc/PID/stat`: the
kernel's own list (`/proc/PID/task/TID/children`) needs CONFIG_PROC_CHILDREN, which not
every kernel has (the VM this was written on lacks it). Pids already classified are
remembered while they live, so a reading lists /proc and reads the stat files of descendants
and of new pids only.
Children that ended and were waited for are in this process's own children's times.

/proc/stat counts in clock ticks (10 ms at the usual 100 Hz), per CPU, so a window of a
few tenths of a second reads to within a few hundredths of a CPU-second; the arithmetic
is clamped to what the CPUs could have done. Linux only: elsewhere `reading()` is None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

PROC = "/proc"
# /proc/stat per-CPU columns counted as busy: user, nice, system, irq, softirq, steal (a
# hypervisor running another guest on this CPU); idle and iowait are not. guest time is
# already inside user.
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class Reading:
    """A snapshot of the counters, taken by `reading()`."""

    at_s: float  # time.monotonic()
    cpus: frozenset[int]  # the affinity mask
    busy_s: float  # busy CPU-seconds of those CPUs since boot
    own_s: float  # CPU-seconds of this process and its descendants, live or waited for


@dataclass(frozen=True)
class Load:
    """What other processes did on this process's CPUs during a window."""

    window_s: float  # wall seconds of the window
    other_cpu_s: float  # CPU-seconds other processes ran on the CPUs this process may use
    cpus: int  # CPUs in the affinity mask

    @property
    def busy_cpus(self) -> float:
        """How many of the CPUs other processes kept busy, on average over the window."""
        return self.other_cpu_s / self.window_s if self.window_s > 0 else 0.0

    @property
    def share(self) -> float:
        """The share of this process's CPUs other processes took."""
        return self.busy_cpus / self.cpus

    def describe(self) -> str:
        """e.g. "other processes kept 0.97 of this kernel's 2 CPUs busy (49%)"."""
        plural = "" if self.cpus == 1 else "s"
        return (
            f"other processes kept {self.busy_cpus:.2f} of this kernel's {self.cpus} "
            f"CPU{plural} busy ({self.share:.0%})"
        )


def reading() -> Reading | None:
    """The counters now, or None where /proc or an affinity mask is not available (not
    Linux). Cheap enough for every run: 0.13 ms on the 2-core VM this was written on, 0.19
    ms with four children; the first reading in a process reads every process's stat."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        cpus = frozenset(os.sched_getaffinity(0))
        busy = _busy_ticks(cpus)
        descendants = _descendants.ticks()
    except OSError:
        return None
    own = os.times()
    mine = own.user + own.system + own.children_user + own.children_system
    return Reading(time.monotonic(), cpus, busy / _TICKS_PER_S, mine + descendants / _TICKS_PER_S)


def between(start: Reading, end: Reading, clamped: bool = True) -> Load | None:
    """Other processes' CPU time on this process's CPUs from `start` to `end`; None when the
    affinity mask changed in between (the two readings count different CPUs). `clamped`:
    within what the CPUs could have done. A window shorter than a clock tick reads a tick
    too many or too few, so windows to be summed are read unclamped (clamping each would
    keep the ticks too many and drop the too few: a quiet machine read half a CPU busy
    over rounds of a few milliseconds) and the sum clamped once."""
    if start.cpus != end.cpus or end.at_s <= start.at_s:
        return None
    window = end.at_s - start.at_s
    other = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    if clamped:
        other = min(max(other, 0.0), window * len(end.cpus))
    return Load(window, other, len(end.cpus))


def since(start: Reading | None, clamped: bool = True) -> Load | None:
    """The load from `start` to now (None when there was no start reading)."""
    if start is None:
        return None
    end = reading()
    return between(start, end, clamped) if end is not None else None


def _busy_ticks(cpus: frozenset[int]) -> int:
    """Busy ticks since boot, summed over `cpus`, from their `cpuN` lines in /proc/stat."""
    total = 0
    for line in _read(f"{PROC}/stat").splitlines():
        if not line.startswith(b"cpu"):
            break
        name, *columns = line.split()
        if name != b"cpu" and int(name[3:]) in cpus:
            total += sum(int(columns[i]) for i in BUSY_COLUMNS if i < len(columns))
    return total


def _read(path: str) -> bytes:
    """A whole /proc file, read with plain system calls: a third of what
    `Path.read_text` costs, which counts at several readings per run."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def count_as_ours(pids: Iterable[int]) -> None:
    """From now on, count `pids` (the job's other ranks on this host) and their descendants
    as this process's own work."""
    _descendants.peers = frozenset(pids) - {os.getpid()}
    _descendants.known = {}


class _Descendants:
    """The live processes under this one (or under one of its `peers`), found by parent
    pid, and their CPU ticks."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.peers: frozenset[int] = frozenset()  # processes whose work is ours too
        self.known: dict[int, bool] = {}  # pid: whether it descends from `owner` or a peer

    def ticks(self) -> int:
        """utime + stime + cutime + cstime of every live descendant (each one's waited-for
        children included, so a worker's helper that ended is still counted)."""
        if os.getpid() != self.owner:  # read in a forked child: its own descendants
            self.owner, self.peers, self.known = os.getpid(), frozenset(), {}
        pids = [int(name) for name in os.listdir(PROC) if name.isdigit()]
        live = set(pids)
        self.known = {pid: mine for pid, mine in self.known.items() if pid in live}
        stats = {pid: _stat(pid) for pid in pids if pid not in self.known and pid != self.owner}
        for pid in stats:
            self._classify(pid, stats)
        total = 0
        for pid, mine in self.known.items():
            if mine:
                fields = stats.get(pid) or _stat(pid)
                if fields is not None:  # None: it ended since the listing
                    total += sum(int(fields[i]) for i in _TIMES)
        return total

    def _classify(self, pid: int, stats: dict[int, list[bytes] | None]) -> bool:
        """Whether `pid` is a peer or descends from this process or a peer (its parent chain
        among new pids is followed; a pid that vanished counts as not)."""
        if pid == self.owner:
            return True
        if pid in self.peers:
            self.known[pid] = True  # counted like a descendant
            return True
        if pid in self.known:
            return self.known[pid]
        fields = stats.get(pid)
        self.known[pid] = False  # also ends a cycle of reused pids
        if fields is not None:
            self.known[pid] = self._classify(int(fields[_PPID]), stats)
        return self.known[pid]


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        text = _read(f"{PROC}/{pid}/stat")
    except OSError:
        return None
    return text[text.rfind(b")") + 2 :].split()


# indices into `_stat`'s fields (proc(5) numbers them from 1 with pid and comm first)
_PPID = 1
_TIMES = (11, 12, 13, 14)  # utime, stime, cutime, cstime
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_descendants = _Descendants()
