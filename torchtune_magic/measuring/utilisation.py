"""Model FLOPs per run and how much of the device's peak the cell reaches.

FLOPs come from one untimed run under `torch.utils.flop_counter.FlopCounterMode` (the
formulas PyTorch itself ships), split by dtype and by kind (convolution or matrix product)
so the peak each part could reach is known. The fixes this tool offers do not change the
model's math (autocast and TF32 change precision, compile and channels_last change kernels,
checkpointing recomputes — recompute is not *model* FLOPs), so every variant is credited
with the baseline's FLOPs and differs only in time.

Utilisation = the time the FLOPs would take at the device's dense peak for the precision
they ran at, divided by the measured median. The peaks are datasheet numbers (dense, no
sparsity) looked up by device name; a device not in the table (every CPU) gets none, with
the reason, and the achieved TFLOP/s alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

# Dense datasheet peaks in TFLOP/s: bf16 / fp16 tensor cores, tf32 tensor cores, fp32 CUDA
# cores. Looked up by substring of torch.cuda.get_device_name(), first match wins (so
# "H100 PCIe" before "H100", "L40S" before "L4", "A100" before "A10").
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)
PEAKS_SOURCE = "NVIDIA datasheet, dense (no sparsity), TFLOP/s"
NO_CPU_PEAK = (
    "no peak table for CPUs (it depends on cores, clocks and vector units): FLOPs and "
    "achieved FLOP/s only"
)
_DTYPE_COLUMN = {"bfloat16": "bf16", "float16": "fp16"}


def peaks_for(device: str, device_name: str) -> tuple[dict[str, float] | None, str]:
    """The device's peak TFLOP/s per precision column, and where they come from (or why
    there are none)."""
    if device != "cuda":
        return None, NO_CPU_PEAK
    for key, peaks in PEAKS:
        if key.lower() in device_name.lower():
            return dict(peaks), f"{key}: {PEAKS_SOURCE}"
    return None, f"{device_name} is not in the peak table: achieved FLOP/s only"


@dataclass
class FlopCount:
    """Model FLOPs of one run of the cell, by "dtype kind" bucket (`float32 conv`)."""

    total: int = 0
    buckets: dict[str, int] = field(default_factory=dict)


class _BucketedCounter(FlopCounterMode):
    """FlopCounterMode that also files each op's FLOPs under its input dtype and kind."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.buckets: dict[str, int] = defaultdict(int)

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        before = self.get_total_flops()
        result = super()._count_flops(func_packet, out, args, kwargs)
        added = self.get_total_flops() - before
        if added:
            self.buckets[f"{_dtype_of(args)} {_kind_of(func_packet)}"] += added
        return result


def _dtype_of(args: Any) -> str:
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return str(arg.dtype).removeprefix("torch.")
    return "other"


def _kind_of(func_packet: Any) -> str:
    return "conv" if "conv" in str(func_packet) else "matmul"


def count(run: Any) -> FlopCount:
    """Run `run()` once under the counter; its FLOPs (buckets stay empty on a torch whose
    FlopCounterMode has no per-op `_count_flops` to split them: no utilisation then)."""
    counter = _BucketedCounter()
    with counter:
        run()
    return FlopCount(int(counter.get_total_flops()), dict(counter.buckets))


def column(bucket: str, fixes: list[str], amp_dtype: str | None) -> str | None:
    """The peak column a bucket's FLOPs run at under these fixes, with the process's
    current TF32 settings (None: a dtype the table has no peak for, e.g. float64)."""
    dtype, _, kind = bucket.partition(" ")
    if dtype in _DTYPE_COLUMN:
        return _DTYPE_COLUMN[dtype]
    if dtype != "float32":
        return None
    if "amp" in fixes and amp_dtype in _DTYPE_COLUMN:
        return _DTYPE_COLUMN[amp_dtype]  # autocast runs matmul/conv in the lower precision
    if kind == "conv":
        return "tf32" if torch.backends.cudnn.allow_tf32 or "tf32" in fixes else "fp32"
    highest = torch.get_float32_matmul_precision() == "highest"
    return "tf32" if not highest or "tf32" in fixes else "fp32"


@dataclass
class Throughput:
    achieved_tflops: float | None = None
    utilisation: float | None = None
    peak_tflops: float | None = None  # the effective peak for this variant's precision mix


def throughput(
    flops: FlopCount | None,
    median_s: float | None,
    peaks: dict[str, float] | None,
    fixes: list[str],
    amp_dtype: str | None = None,
) -> Throughput:
    """Achieved TFLOP/s, and the share of peak: ideal time Σ flops_i / peak_i over the
    measured time (so a mix of bf16 and fp32 work is judged against both peaks)."""
    if flops is None or not flops.total or not median_s:
        return Throughput()
    result = Throughput(achieved_tflops=flops.total / median_s / 1e12)
    if peaks is None or not flops.buckets:
        return result
    ideal_s = 0.0
    for bucket, value in flops.buckets.items():
        peak = peaks.get(column(bucket, fixes, amp_dtype) or "")
        if not peak:
            return result  # some work runs at a precision the table has no peak for
        ideal_s += value / (peak * 1e12)
    result.utilisation = ideal_s / median_s
    result.peak_tflops = flops.total / ideal_s / 1e12
    return result
