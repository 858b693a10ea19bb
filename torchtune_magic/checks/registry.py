"""The list of checks. Ids are a public interface: never rename one."""

from __future__ import annotations

from functools import cache

from .base import Check


@cache
def all_checks() -> tuple[Check, ...]:
    from . import (
        allocator,
        autograd,
        checkpointing,
        conv_bn,
        cuda,
        debug,
        fusion,
        loader,
        memory_format,
        optimizer,
        precision,
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
    )


def ids() -> list[str]:
    return [check.id for check in all_checks()]


def get(check_id: str) -> Check:
    for check in all_checks():
        if check.id == check_id:
            return check
    raise KeyError(check_id)
