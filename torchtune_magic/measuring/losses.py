"""The loss per step, as the judge of "same results" for a training cell.

A parameter's last bits say little about whether training got worse: a fix that sums in
another order (channels-last, a folded conv bias) or in bfloat16 (autocast) moves weights
in ways that grow over the steps, while the loss the user watches stays where it was. So
each configuration's first run from the restored start records the tensor every
`backward()` is called on, and the fix's curve is compared with the baseline's over the
same steps.

Recording is two attribute patches through a `Patcher`, active only during the run and
undone exactly after, and per backward call one `.detach()` and a list append: no host
sync per step (the detached scalars are stacked and read back once, after the run).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kernel.fixes import Patcher

# The smallest tolerance a loss curve is judged with. Reordered float32 sums (NHWC
# kernels, a bias folded away) differ by ~1e-7 relative at the first step and that grows
# over the steps, chaotically, yet a mean loss stays within ~1e-5..1e-4 of the baseline's
# for hundreds of steps; 0.1 % is well above that drift, ten times under the spread
# between training runs with different seeds (~1 %), and too small to see on a plot.
LOSS_TOLERANCE = 1e-3
# A loss that falls towards zero is compared on the scale it started on: a difference
# under this share of the curve's largest value counts no more than one of that size
# (a relative difference of 1e-9 against 1e-9 is not a changed loss).
SCALE_FLOOR = 1e-3
# The baseline run twice from the same start can already differ (a nondeterministic
# cell): a fix is judged against twice that difference, where it is wider.
NOISE_FACTOR = 2.0
# Points kept of each curve in the report: enough for a plot, bounded for the JSON.
MAX_POINTS = 200

SAME = "same loss"
CHANGED = "loss changed"


class Recorder:
    """Keeps the tensor each outermost `backward()` of a run is called on (a scalar, no
    explicit gradient), detached; `curve` reads them back once."""

    def __init__(self) -> None:
        self._kept: list[torch.Tensor] = []
        # inside a backward: a nested call (Tensor.backward → autograd's, a checkpoint's
        # recomputation) is the same step
        self._depth = 0

    def _keep(self, tensor: Any, gradient: Any) -> None:
        if self._depth or gradient is not None or not isinstance(tensor, torch.Tensor):
            return
        if tensor.numel() == 1:
            self._kept.append(tensor.detach())

    def _wrapped(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            one = tensors
            if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
                one = tensors[0]
            gradient = args[0] if args else kwargs.get("gradient", kwargs.get("grad_tensors"))
            self._keep(one, gradient)
            self._depth += 1
            try:
                return original(tensors, *args, **kwargs)
            finally:
                self._depth -= 1

        return recorded

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record while inside. Entered innermost, after the fixes' own patches: a fix that
        scales the loss in `Tensor.backward` (amp's GradScaler) is reached through ours, so
        the loss kept is the cell's own, unscaled."""
        patcher = Patcher()
        try:
            patcher.setattr(torch.Tensor, "backward", self._wrapped(torch.Tensor.backward))
            patcher.setattr(torch.autograd, "backward", self._wrapped(torch.autograd.backward))
            yield
        finally:
            patcher.undo()

    def curve(self) -> list[float]:
        """The losses recorded, in order, as floats (one read-back for all of them)."""
        kept, self._kept = self._kept, []
        if not kept:
            return []
        if len({(t.device, t.shape) for t in kept}) == 1:  # one stack, one copy to the host
            return torch.stack(kept).reshape(-1).double().cpu().tolist()
        return [float(t) for t in kept]


@contextlib.contextmanager
def recorded(inner: contextlib.AbstractContextManager[Any], recorder: Recorder) -> Iterator[None]:
    """`inner` (the fixes' in-cell contexts), with the loss recorded inside it."""
    with inner, recorder.recording():
        yield


@dataclass(frozen=True)
class Comparison:
    """Two loss curves over the steps both ran: the verdict, the largest relative
    difference at a step, and the tolerance it was judged by."""

    verdict: str  # SAME | CHANGED
    max_rel_diff: float  # inf where one curve is not finite at a step the other is
    steps: int
    tolerance: float
    note: str | None = None  # the runs called backward a different number of times


def tolerance_for(fix_tolerance: float, noise: float = 0.0) -> float:
    """The loss tolerance for a fix: LOSS_TOLERANCE, or the fix's own looser one (amp,
    TF32: one half-precision rounding, already accepted per result), or twice what the
    baseline differs from itself by, whichever is widest."""
    return max(LOSS_TOLERANCE, fix_tolerance, NOISE_FACTOR * noise)


def _step_diff(a: float, b: float, floor: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if math.isinf(a) or math.isinf(b):
        return 0.0 if a == b else math.inf
    return abs(a - b) / max(abs(a), abs(b), floor)


def max_rel_diff(baseline: Sequence[float], fixed: Sequence[float]) -> float:
    """The largest relative difference at a step, over the steps both curves have."""
    steps = min(len(baseline), len(fixed))
    pairs = list(zip(baseline[:steps], fixed[:steps], strict=True))
    finite = [abs(a) for a, _ in pairs if math.isfinite(a)]
    floor = max(max(finite, default=0.0) * SCALE_FLOOR, 1e-30)
    return max((_step_diff(a, b, floor) for a, b in pairs), default=0.0)


def compare(
    baseline: Sequence[float], fixed: Sequence[float], fix_tolerance: float, noise: float = 0.0
) -> Comparison | None:
    """The fix's loss curve against the baseline's, over the steps both ran; None where
    either run called no backward (not a training cell, or nothing to judge by)."""
    steps = min(len(baseline), len(fixed))
    if steps == 0:
        return None
    tolerance = tolerance_for(fix_tolerance, noise)
    diff = max_rel_diff(baseline, fixed)
    note = None
    if len(baseline) != len(fixed):
        note = (
            f"the fix's run called backward {len(fixed)} times, the baseline's "
            f"{len(baseline)}: the first {steps} compared"
        )
    verdict = SAME if diff <= tolerance else CHANGED
    return Comparison(verdict, diff, steps, tolerance, note)


def downsampled(curve: Sequence[float], points: int = MAX_POINTS) -> list[float | None]:
    """At most `points` values, evenly spread, the first and last kept; 7 significant
    digits (a plot needs no more); a value that is not finite is None (JSON has none)."""
    if len(curve) > points:
        last = len(curve) - 1
        curve = [curve[round(i * last / (points - 1))] for i in range(points)]
    return [float(f"{v:.7g}") if math.isfinite(v) else None for v in curve]
