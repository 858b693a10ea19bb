"""Did a fix change what the cell produced? Compare a fixed run against a baseline run.

Both runs start from the same restored state and RNG seed. What is compared: tensors and
numbers the cell bound in the namespace, and parameters/buffers of the models it touched;
for a training cell, beside them, the loss per step (`losses`), the judge a user reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..kernel import allocator
from ..report import Numerics
from . import losses

Outputs = dict[str, torch.Tensor]


def capture(
    namespace: dict[str, Any], names: set[str], modules: dict[str, torch.nn.Module]
) -> Outputs:
    """CPU copies of what the cell produced, keyed by a readable name."""
    outputs: Outputs = {}
    for name in sorted(names):
        value = namespace.get(name)
        if isinstance(value, torch.Tensor):
            outputs[name] = allocator.outside_copy(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            outputs[name] = torch.tensor(float(value), dtype=torch.float64)
    for label, module in modules.items():
        for key, tensor in module.state_dict().items():
            outputs[f"{label}.{key}"] = allocator.outside_copy(tensor)
    return outputs


@dataclass
class _Diff:
    name: str
    rel: float


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if not a.is_floating_point() and not a.is_complex():
        return 0.0 if torch.equal(a, b) else math.inf
    a64, b64 = a.double(), b.double()
    nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
    if not torch.equal(nan_a, nan_b):
        return math.inf
    a64, b64 = a64[~nan_a], b64[~nan_b]
    if a64.numel() == 0:
        return 0.0
    scale = max(float(a64.abs().max()), float(b64.abs().max()), 1e-12)
    return float((a64 - b64).abs().max()) / scale


def compare(baseline: Outputs, variant: Outputs, tolerance: float) -> Numerics:
    """identical (bit for bit) / close (within tolerance) / changed (with the largest diff)."""
    shared = sorted(set(baseline) & set(variant))
    missing = sorted(set(baseline) ^ set(variant))
    if not shared:
        return Numerics("not-compared", None, "the cell bound no tensors or models to compare")
    identical = all(
        baseline[k].dtype == variant[k].dtype and torch.equal(baseline[k], variant[k])
        for k in shared
    )
    note = f"not compared (present in one run only): {', '.join(missing)}" if missing else None
    if identical:
        return Numerics("identical", 0.0, note)
    worst = max((_Diff(k, _rel_diff(baseline[k], variant[k])) for k in shared), key=lambda d: d.rel)
    detail = f"largest difference in {worst.name}"
    if note:
        detail = f"{detail}; {note}"
    verdict = "close" if worst.rel <= tolerance else "changed"
    rel = worst.rel if math.isfinite(worst.rel) else None
    return Numerics(verdict, rel, detail)


@dataclass
class Produced:
    """What one run from the restored start left to compare: the cell's outputs (None
    where capturing them failed) and the loss of each backward call, in order."""

    outputs: Outputs | None
    losses: list[float]


def with_losses(
    result: Numerics,
    baseline: list[float],
    fixed: list[float],
    fix_tolerance: float,
    noise: float = 0.0,
) -> Numerics:
    """`result` with the loss curves' comparison beside it; as it was where either run
    called no backward."""
    compared = losses.compare(baseline, fixed, fix_tolerance, noise)
    if compared is None:
        return result
    detail = result.detail
    if compared.note and compared.note not in (detail or ""):
        detail = f"{detail}; {compared.note}" if detail else compared.note
    steps = compared.steps
    diff = compared.max_rel_diff
    return replace(
        result,
        detail=detail,
        loss_verdict=compared.verdict,
        loss_max_rel_diff=diff if math.isfinite(diff) else None,
        loss_tolerance=compared.tolerance,
        loss_steps=steps,
        loss_baseline=losses.downsampled(baseline[:steps]),
        loss_fix=losses.downsampled(fixed[:steps]),
    )


def rejudged(
    result: Numerics, baseline: list[float], fixed: list[float], again: list[float]
) -> Numerics:
    """`result`'s loss verdict judged again where the cell is not deterministic: `again`
    is the baseline's own repeat from the same start, and a fix's curve within twice
    what that differs by is the cell's own noise, not the fix's doing."""
    noise = losses.max_rel_diff(baseline, again)
    if result.loss_tolerance is None or noise == 0.0 or not math.isfinite(noise):
        return result
    judged = with_losses(result, baseline, fixed, result.loss_tolerance, noise)
    note = (
        "the cell itself is not deterministic: two baseline runs' losses differ by up to "
        f"{noise:.1e}, so the fix's was judged against {losses.NOISE_FACTOR:g}x that"
    )
    return replace(judged, detail=f"{judged.detail}; {note}" if judged.detail else note)
