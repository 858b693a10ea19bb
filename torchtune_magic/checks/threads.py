"""torch's intra-op threads against the cores this process may really use.

Guide, CPU part: "Utilize OpenMP" — one compute thread per physical core, no more than the
process may run at once. torch's default is the machine's physical core count, which is too
many in a container with a CPU quota or a narrowed affinity mask; a `set_num_threads(1)`
left over from debugging (or `OMP_NUM_THREADS=1`) leaves cores idle; DataLoader workers
that are busy loading while the main process computes compete with its threads, and so do
other processes on a shared machine (a notebook server, a busy laptop): torch's threads
wait for each other at every parallel region, so one thread without a core stalls them
all. Beside one CPU-bound process on a 2-core machine a 2.8 s training cell ran 13.3 s
with torch's 2 threads and 2.96 s with 1.

The cores left to torch are the available ones (split evenly among the job's ranks that
share them, under torchrun: two ranks of one thread each on two cores is a full machine,
not a half-idle one) less those busy loader workers take and those other processes took
during the probe (`load.py`: their CPU time on the CPUs this
process may use; a core per OTHER_CORE_SHARE of a CPU kept busy). Where that equals the
current count the check stays silent without timing anything. Otherwise the count is
chosen by a quick trial: the main model's forward under no_grad (`proxy.py`) timed with
each candidate count, under whatever load there is then. The trial cannot see busy loader
workers, so when they are the reason, and where no model call exists to try, the count is
the cores left free, and the measurement of the real cell decides.
"""

from __future__ import annotations

import ast
import math
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..cell import codeedit
from ..distributed import lockstep
from ..kernel.fixes import Fix, Patcher
from ..probe import cpu, load
from ..report import CodeChange, count
from . import proxy
from .base import Check, Detection
from .loader import WAIT_SHARE

if TYPE_CHECKING:
    from ..probe.observation import Observation

TRIAL_BUDGET_S = 1.5  # all candidate counts together
TIE = 1.05  # counts within 5% of the fastest tie; ties go to fewer threads
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Other processes' CPU time during the probe takes a core from torch's threads for every
# this much of a CPU they kept busy (rounded at it). Measured on a 2-core VM, a 6-step MLP
# training cell with torch's 2 threads against 1, interleaved, five rounds, beside a busy
# (or duty-cycled) process and other people's work: 2 threads took 0.60-0.77x the time of 1
# with 0.02-0.30 CPUs kept busy by others, 0.98-1.08x (a tie) at 0.46-0.64, 2.1-2.6x at
# 0.83-1.17 and 2.5-6.6x at 1.2-1.6.
OTHER_CORE_SHARE = 0.75
# /proc/stat counts in 10 ms ticks per CPU: over a shorter probe the load is too coarse
LOAD_MIN_WINDOW_S = 0.25
SETTERS = {"set_num_threads"}


@dataclass
class Trial:
    threads: int
    seconds: float


def candidates(current: int, cores: int, wanted: int) -> list[int]:
    """The current count, the target, the cores, and powers of two between them."""
    low, high = min(current, cores, wanted), max(current, cores, wanted)
    between = {2**i for i in range(12) if low < 2**i < high}
    return sorted({current, cores, wanted, *between})


def trial(step_proxy: proxy.Proxy, counts: list[int], budget_s: float) -> list[Trial]:
    """Seconds per forward with each thread count, within `budget_s` in all; the count is
    put back afterwards."""
    previous = torch.get_num_threads()
    trials = []
    try:
        with step_proxy.ready() as step:
            for count in counts:
                torch.set_num_threads(count)
                seconds = proxy.seconds_per_step(step, budget_s / len(counts))
                trials.append(Trial(count, seconds))
    finally:
        torch.set_num_threads(previous)
    return trials


def _pick(trials: list[Trial], current: int) -> Trial:
    """The fastest count other than the current one (the fix must change something);
    ties go to fewer threads."""
    others = [t for t in trials if t.threads != current]
    fastest = min(t.seconds for t in others)
    return min((t for t in others if t.seconds <= TIE * fastest), key=lambda t: t.threads)


class ThreadsFix(Fix):
    """`torch.set_num_threads(k)` for the process (and in the cell's own calls, if it makes
    any); undo puts back the exact count read before."""

    check_id = "cpu-threads"
    # another thread count splits reductions differently: last-bit differences are "close"
    tolerance = 1e-5

    def __init__(self, threads: int):
        super().__init__()
        self.threads = threads

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        previous = torch.get_num_threads()
        patcher.call(
            lambda: torch.set_num_threads(self.threads),
            lambda: torch.set_num_threads(previous),
        )

    def edit_source(self, source: str) -> str:
        return codeedit.edited(source, lambda s: with_threads(s, self.threads))[0]


def with_threads(source: str, threads: int) -> str:
    """The cell's own `set_num_threads(...)` calls given `threads`."""
    calls = [c for c in codeedit.calls_named(ast.parse(source), SETTERS) if len(c.args) == 1]
    return codeedit.replace_nodes(source, [(call.args[0], str(threads)) for call in calls])


def _threads_origin(obs: Observation, current: int) -> tuple[str, int | None]:
    """Where the current count comes from, as far as can be told, and its cell line."""
    lines = [c.lineno for c in codeedit.calls_named(obs.tree, SETTERS)]
    if lines:
        return f"set by torch.set_num_threads at cell line {lines[0]}", lines[0]
    env = [f"{name}={os.environ[name]}" for name in THREAD_ENV if name in os.environ]
    if env:
        return f"{' and '.join(env)} in the kernel's environment", None
    if current == cpu.machine_cores():
        return f"torch's default: the machine's {current} physical cores", None
    return "set by torch.set_num_threads before this cell", None


def _busy_workers(obs: Observation) -> int:
    """Worker processes of loaders the main process waited on (a real share of the cell):
    those workers were busy while it computed."""
    if not obs.wall_s:
        return 0
    uses = [use for use in obs.loaders.values() if use.loader.num_workers]
    shares = lockstep.mean_of([use.wait_s / obs.wall_s for use in uses])
    return sum(
        use.loader.num_workers
        for use, share in zip(uses, shares, strict=True)
        if share is not None and share >= WAIT_SHARE
    )


def _ranks_sharing_cores() -> int:
    """How many of the job's ranks (this one included) run on this host on CPUs this
    process may use too; 1 outside torchrun. Ranks pinned to CPUs of their own do not
    count: their affinity masks do not meet this one."""
    mine = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    here = socket.gethostname()
    ranks = lockstep.gathered((here, mine))
    return max(
        1,
        sum(
            1
            for host, cpus in ranks
            if host == here and (mine is None or cpus is None or cpus & mine)
        ),
    )


def _other_cores(obs: Observation) -> int:
    """Cores other processes took from this one during the probe (0 where the load was
    not measured or the probe was too short to tell; the job's other ranks are not other
    processes to the meter: `load.count_as_ours`)."""
    seen = obs.load
    figures = [None, None] if seen is None else [seen.window_s, seen.busy_cpus]
    window_s, busy_cpus = lockstep.mean_of(figures)
    if window_s is None or busy_cpus is None or window_s < LOAD_MIN_WINDOW_S:
        return 0
    return math.floor(busy_cpus + 1 - OTHER_CORE_SHARE)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


class ThreadsCheck(Check):
    id = "cpu-threads"
    title = "torch's compute threads do not match the cores this process may use"
    guide = "Utilize OpenMP"
    devices = ("cpu",)
    threshold = (
        "torch.get_num_threads() ≠ the physical cores in the affinity mask capped by the "
        "cgroup quota, less busy loader workers and a core per 0.75 CPU other processes kept "
        "busy during the probe (2-core CPU, an MLP training cell, 2 threads against 1: "
        "0.60-0.77x the time at 0-0.3 CPUs kept busy by others, a tie at 0.46-0.64, "
        "2.1-2.6x at 0.83-1.17)"
    )

    def detect(self, obs: Observation) -> list[Detection]:
        current = torch.get_num_threads()
        cores = cpu.available_cores()
        sharing = _ranks_sharing_cores()
        per_rank = max(1, cores.count // sharing)
        workers = _busy_workers(obs)
        others = _other_cores(obs)
        wanted = max(1, per_rank - workers - others)
        if wanted == current:
            return []
        origin, line = _threads_origin(obs, current)
        evidence = (
            f"torch runs {count(current, 'intra-op thread')} ({origin}); "
            f"this process may use {cores.count} ({cores.detail})"
        )
        if sharing > 1:
            evidence += f", {per_rank} each for the {sharing} ranks of this job that share them"
        details = []
        if workers:
            details.append(
                f"{count(workers, 'DataLoader worker')} {'was' if workers == 1 else 'were'} "
                "busy loading (the cell waited on them) while it computed"
            )
        if others and obs.load is not None:
            details.append(f"{obs.load.describe()} during the probe's run")
        if current > wanted and (workers or others):
            beside = [f"{workers} busy workers"] if workers else []
            if others:
                beside.append(f"{count(others, 'core')} of other processes' work")
            details.append(f"{current} threads + {' + '.join(beside)} on {count(per_rank, 'core')}")
        if current > wanted and workers:  # the trial cannot see busy workers
            chosen = wanted
        else:
            chosen, text = self._trial(obs, current, per_rank, wanted, loaded=others > 0)
            details.append(text)
        source = obs.workload.source
        fixed, notes = codeedit.edited(source, lambda s: with_threads(s, chosen))
        if fixed == source and not notes:
            setting = f"torch.set_num_threads({chosen})"
            fixed, notes = codeedit.edited(
                source, lambda s: codeedit.insert_after_imports(s, setting)
            )
        elsewhere = [
            f"or start the kernel with OMP_NUM_THREADS={chosen} (it applies to every cell)",
            *notes,
        ]
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details="; ".join(details),  # no segment: the threads run every part
                    where=f"cell line {line}" if line else "torch's thread pool (process-wide)",
                    fixable=True,
                    line=line,
                    caveat=_caveat(others > 0),
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
                ),
                ThreadsFix(chosen),
                fixed,
            )
        ]

    @staticmethod
    def _trial(
        obs: Observation, current: int, cores: int, wanted: int, loaded: bool
    ) -> tuple[int, str]:
        """The count to offer and the evidence text of how it was chosen; `loaded`: other
        processes' work is a reason, so say what load the trial ran under."""
        step_proxy = proxy.main_model(obs)
        if step_proxy is None:
            left = "the cores left free" if wanted < cores else "the available cores"
            return wanted, f"no model call to try counts on: {wanted} ({left})"
        before = load.reading()
        trials = trial(
            step_proxy, candidates(current, cores, wanted), obs.trial_time(TRIAL_BUDGET_S)
        )
        during = load.since(before)
        for each, agreed in zip(trials, lockstep.mean_of([t.seconds for t in trials]), strict=True):
            each.seconds = agreed if agreed is not None else each.seconds
        best = _pick(trials, current)
        timings = ", ".join(
            f"{t.threads} thread{'s' if t.threads > 1 else ''} {_ms(t.seconds)}" for t in trials
        )
        text = f"quick trial on {step_proxy.describe()} (no_grad): {timings}; {best.threads} chosen"
        if loaded and during is not None:
            text += f" (during the trial {during.describe()})"
        return best.threads, text


def _caveat(loaded: bool) -> str:
    text = (
        "the setting is process-wide: other cells run with it too; results may differ in the "
        "last bits (reductions split across threads differently)"
    )
    if loaded:
        text += (
            "; the count fits the load other processes put on this machine during the "
            "probe: when that work stops, the old count is faster again, so re-check then"
        )
    return text
