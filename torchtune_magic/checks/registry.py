"""The list of checks. Ids are a public interface: never rename one."""

from __future__ import annotations

from functools import cache

from ..kernel.applied import settled_without_win
from ..report import NotApplicable, Variant
from .base import Check, Detection


@cache
def all_checks() -> tuple[Check, ...]:
    from . import (
        allocator,
        autograd,
        checkpointing,
        conv_bn,
        cuda,
        data_parallel,
        ddp_settings,
        debug,
        distributed,
        fusion,
        loader,
        memory_format,
        optimizer,
        precision,
        rank_imbalance,
        sync,
        threads,
    )

    return (
        debug.AnomalyCheck(),
        debug.ProfilerCheck(),
        debug.GradcheckCheck(),
        autograd.NoGradCheck(),
        autograd.ZeroGradNoneCheck(),
        loader.WorkersCheck(),
        loader.PinMemoryCheck(),
        conv_bn.ConvBiasBNCheck(),
        fusion.FusePointwiseCheck(),
        memory_format.ChannelsLastCheck(),
        checkpointing.ActivationCheckpointingCheck(),
        precision.AmpCheck(),
        precision.TF32Check(),
        cuda.CudnnBenchmarkCheck(),
        sync.HostSyncCheck(),
        cuda.NonBlockingCopyCheck(),
        optimizer.FusedOptimizerCheck(),
        cuda.TensorOnDeviceCheck(),
        threads.ThreadsCheck(),
        allocator.AllocatorCheck(),
        distributed.DdpNoSyncCheck(),
        distributed.DistributedSamplerCheck(),
        ddp_settings.DdpFindUnusedCheck(),
        ddp_settings.DdpBucketViewCheck(),
        rank_imbalance.RankImbalanceCheck(),
        data_parallel.DataParallelCheck(),
    )


def ids() -> list[str]:
    return [check.id for check in all_checks()]


def get(check_id: str) -> Check:
    for check in all_checks():
        if check.id == check_id:
            return check
    raise KeyError(check_id)


def without_win(
    detections: list[Detection], variants: list[Variant], applied: list[str]
) -> tuple[list[Detection], list[NotApplicable]]:
    """The detections that stand, and those that fall as "not applicable here": a finding
    whose check stands only on a measured win (`Check.needs_measured_win`) and whose fix,
    not applied, measured none (`settled_without_win`), with the measurement as reason."""
    measured = {tuple(v.fixes): v for v in variants}
    needing = {c.id: c for c in all_checks() if c.needs_measured_win}
    kept, fallen = [], []
    for detection in detections:
        check_id = detection.finding.id
        check, variant = needing.get(check_id), measured.get((check_id,))
        if (
            check is not None
            and variant is not None
            and check_id not in applied
            and settled_without_win(variant)
        ):
            fallen.append(NotApplicable(check_id, check.without_win(variant)))
        else:
            kept.append(detection)
    return kept, fallen
