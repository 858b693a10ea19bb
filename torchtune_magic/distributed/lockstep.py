"""Ranks in lockstep under torchrun: every figure a measuring decision is made from is the
same on every rank, so every rank takes the same decisions and issues the cell's collectives
in the same runs, over the same steps, in the same order.

A run of a distributed step ends when its slowest rank does, so a duration agreed is the
maximum over ranks (`slowest`); a stop (the probe's, a run's give-up at the deadline) is
taken when any rank wants it (`any_rank`); a value worked out from rank-local figures (the
measuring plan) is rank 0's (`from_first`). A check that decides from a timing or a measured
signal (an op's share of the time, a wait share, a trial's seconds, the load) thresholds the
ranks' mean of it (`mean_of`): each rank's probe times its own run, and a figure near the
threshold would otherwise find the check on one rank only, whose fix the others could not
run with it. Outside torchrun, or with one process, each is the identity and costs nothing.

The messages go over a gloo group of our own (CPU tensors whatever the user's backend),
made once per process group; each is issued at a point every rank reaches, which is what
keeps them paired: a rank that would skip one (a fix that does not apply there) says so
through the same message instead (`all_ok`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# our messages wait this long for a rank that does not come (a rank whose process died is
# seen at once: its connections close) before the collective raises
CONTROL_TIMEOUT = timedelta(seconds=120)
_NONE = -1.0  # a duration not taken on this run (times are never negative)

_active: ContextVar[Ranks | None] = ContextVar("torchtune_magic_ranks", default=None)
# our gloo group and the world group it spans (a process group destroyed and made again
# is another world: it gets a group of its own)
_group: list[tuple[Any, Any]] = []


class RankFailed(RuntimeError):
    """Another rank could not go on: every rank stops measuring with this."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of a torch.distributed job."""

    rank: int
    world: int
    backend: str
    nodes: int
    host: str
    group: Any  # the gloo group our messages go over
    peers: tuple[int, ...] = ()  # the pids of the job's other ranks on this host

    @property
    def first(self) -> bool:
        return self.rank == 0

    def slowest(self, values: list[float | None]) -> list[float | None]:
        """Each value's maximum over ranks (None where a rank took none)."""
        sent = torch.tensor([_NONE if v is None else v for v in values], dtype=torch.float64)
        torch.distributed.all_reduce(sent, torch.distributed.ReduceOp.MAX, group=self.group)
        return [None if v == _NONE else float(v) for v in sent.tolist()]

    def mean(self, values: list[float | None]) -> list[float | None]:
        """Each value's mean over the ranks that took it (None where none did)."""
        pairs = [(0.0, 0.0) if v is None else (float(v), 1.0) for v in values]
        sent = torch.tensor(pairs, dtype=torch.float64).reshape(-1, 2)
        torch.distributed.all_reduce(sent, torch.distributed.ReduceOp.SUM, group=self.group)
        return [None if taken == 0 else total / taken for total, taken in sent.tolist()]

    def any(self, flag: bool) -> bool:
        sent = torch.tensor([1 if flag else 0], dtype=torch.int64)
        torch.distributed.all_reduce(sent, torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(sent.item())

    def from_first(self, value: T) -> T:
        sent = [value if self.first else None]
        torch.distributed.broadcast_object_list(sent, src=0, group=self.group)
        return sent[0]  # type: ignore[return-value]

    def gather(self, value: T) -> list[T]:
        got: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(got, value, group=self.group)
        return got


def joined() -> Ranks | None:
    """This process's ranks, where torch.distributed is initialised with more than one."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    world = dist.group.WORLD
    if not _group or _group[0][0] is not world:
        _group[:] = [(world, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))]
    group = _group[0][1]
    size = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    host = socket.gethostname()
    places: list[Any] = [None] * size
    dist.all_gather_object(places, (host, os.getpid()), group=group)
    return Ranks(
        rank=dist.get_rank(),
        world=size,
        backend=str(dist.get_backend()),
        nodes=max(1, size // max(1, local)),
        host=host,
        group=group,
        peers=tuple(pid for where, pid in places if where == host and pid != os.getpid()),
    )


def launched_rank() -> int | None:
    """This process's rank where torchrun launched it (from its environment, before any
    process group exists), else None."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and os.environ.get("WORLD_SIZE") else None


def launched_by_torchrun() -> bool:
    """Whether this process is one of several ranks torchrun started (its environment says
    so even before anything has joined the process group)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and "TORCHELASTIC_RUN_ID" in os.environ


@contextmanager
def active(ranks: Ranks | None) -> Iterator[None]:
    """Inside, every agreement below goes over `ranks` (None: this process alone)."""
    token = _active.set(ranks)
    try:
        yield
    finally:
        _active.reset(token)


def current() -> Ranks | None:
    return _active.get()


def slowest(seconds: float) -> float:
    """A duration as the slowest rank took it."""
    ranks = _active.get()
    if ranks is None:
        return seconds
    agreed = ranks.slowest([seconds])[0]
    return seconds if agreed is None else agreed


def slowest_of(values: list[float | None]) -> list[float | None]:
    ranks = _active.get()
    return values if ranks is None else ranks.slowest(values)


def mean_of(values: list[float | None]) -> list[float | None]:
    """Figures measured on this rank that a finding is decided from, as the ranks' mean:
    every rank then decides the same (call it where every rank gets to, with as many
    figures)."""
    ranks = _active.get()
    return values if ranks is None else ranks.mean(values)


def mean(value: float) -> float:
    """One figure every rank took, as the ranks' mean (`mean_of`)."""
    agreed = mean_of([value])[0]
    return value if agreed is None else agreed


def any_rank(flag: bool) -> bool:
    """Whether any rank says so (a stop: every rank stops where one must)."""
    ranks = _active.get()
    return flag if ranks is None else ranks.any(flag)


def all_ok(ok: bool, what: str) -> None:
    """Raise RankFailed on every rank when `ok` is False on any (this one included, after
    it has said so: the caller raises its own error there)."""
    ranks = _active.get()
    if ranks is None:
        return
    if ranks.any(not ok) and ok:
        raise RankFailed(f"another rank could not go on: {what}")


def from_first(value: T) -> T:
    """Rank 0's value."""
    ranks = _active.get()
    return value if ranks is None else ranks.from_first(value)


def gathered(value: T) -> list[T]:
    """Every rank's value, by rank."""
    ranks = _active.get()
    return [value] if ranks is None else ranks.gather(value)
