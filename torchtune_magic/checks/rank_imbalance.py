"""One rank slower than the others (`rank-imbalance`): every synced step ends when the
slowest rank's all-reduce does, so the others spend the difference waiting in it.

The probe records, on each rank, how long its synced backward passes ran on after its own
last gradient was ready (the all-reduce not hidden behind the backward, and the wait for
slower ranks inside it) and how long it waited for its DataLoader; the session gathers every
rank's figures (`Observation.rank_work`). A rank whose own work (its run less those tails)
is clearly longer than the others' is the one they wait for; where its extra time went is
read from its DataLoader wait. There is no live fix: the cause is in the data, the loader or
the host, and the finding says which rank and where its time went.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ..report import DATA_WAIT, CodeChange
from .base import Detection
from .distributed import DistributedCheck

if TYPE_CHECKING:
    from ..probe.observation import Observation, RankWork

# the slowest rank's own work at least this much longer than the others' (their median) ...
SLOWER_BY = 1.2
# ... and the others waiting at least this share of their run for it in the all-reduce
WAITED_SHARE = 0.1
# the slowest rank's extra DataLoader wait explains at least this share of its extra work
LOADER_EXPLAINS = 0.5


class RankImbalanceCheck(DistributedCheck):
    id = "rank-imbalance"
    title = "One rank is slower and the others wait for it"
    threshold = (
        f"a rank's own work ≥ {SLOWER_BY:g}x the others' and them waiting ≥ "
        f"{WAITED_SHARE:.0%} of their run in the all-reduce"
    )

    def not_applicable(self, obs: Observation) -> str | None:
        reason = super().not_applicable(obs)
        if reason is None and not any(w.steps for w in obs.rank_work or []):
            reason = "not applicable: no DistributedDataParallel backward pass synced in the run"
        return reason

    def detect(self, obs: Observation) -> list[Detection]:
        work = obs.rank_work or []
        if len(work) < 2 or not all(w.steps for w in work):
            return []
        slowest = max(work, key=lambda w: w.working_s / w.steps)
        others = [w for w in work if w is not slowest]
        own = slowest.working_s / slowest.steps
        typical = statistics.median(w.working_s / w.steps for w in others)
        waited = statistics.median(w.collective_s / w.wall_s for w in others if w.wall_s)
        if own < SLOWER_BY * typical or waited < WAITED_SHARE:
            return []
        extra = own - typical
        loader_extra = slowest.loader_s / slowest.steps - statistics.median(
            w.loader_s / w.steps for w in others
        )
        went = _where_it_went(extra, loader_extra)
        loader = loader_extra >= LOADER_EXPLAINS * extra
        evidence = (
            f"rank {slowest.rank}'s own work took {own / typical:.2f}x the time of the other "
            f"rank{'s' if len(others) > 1 else ''} a step ({_ms(own)} against {_ms(typical)})"
        )
        details = (
            f"{'they' if len(others) > 1 else 'it'} waited {waited:.0%} of the run in the "
            f"all-reduce for it; {went}"
        )
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,
                    # its loader's wait, where that explains it; else forward and backward
                    segment=DATA_WAIT if loader else None,
                    where=f"rank {slowest.rank}",
                    fixable=False,
                    code_change=CodeChange(elsewhere=[_advice(slowest, loader)]),
                )
            )
        ]


def _where_it_went(extra: float, loader_extra: float) -> str:
    if loader_extra >= LOADER_EXPLAINS * extra:
        return (
            f"{_ms(loader_extra)} of its extra {_ms(extra)} a step went waiting for its DataLoader"
        )
    return (
        f"its DataLoader explains {_ms(max(loader_extra, 0.0))} of its extra {_ms(extra)} a "
        "step: the rest is its own forward and backward"
    )


def _advice(slowest: RankWork, loader: bool) -> str:
    if loader:
        return (
            f"feed rank {slowest.rank} faster: more DataLoader workers (`num_workers`), the "
            "slow preprocessing done once ahead of training, or its data on faster storage"
        )
    return (
        f"even out rank {slowest.rank}'s work: the same batch size and sequence lengths on "
        "every rank (a DistributedSampler with `drop_last=True`, length bucketing), and the "
        "same hardware and load on every host"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
