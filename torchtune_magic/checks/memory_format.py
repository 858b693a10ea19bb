"""Conv2d models fed NCHW-contiguous inputs: the channels_last memory format.

Guide: "Use channels_last memory format for computer vision models" — convolution kernels
(oneDNN on CPU, cuDNN with Tensor Cores on GPU) often prefer NHWC, and converting the model
and its inputs avoids layout reorders inside each conv. It also regresses some models, so
the check times every conv both ways and names the ones that get slower.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..cell.workload import synchronize
from ..distributed import lockstep
from ..kernel.fixes import Patcher
from ..probe import construction
from ..report import FORWARD, SLOWER_HERE, Checked, CodeChange, count
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import Observation

MAX_CONVS = 16  # convs micro-timed per model
MICRO_BUDGET_S = 1.5  # wall time for all of a model's per-conv timing
REGRESSION = 1.1  # a conv this much slower in channels_last is named
# Convolutions must take this share of the cell's time. Measured on a 2-core CPU (AVX-512):
# one conv's NHWC speedup was 0.6x-3.1x forward and 1.0x-1.45x forward+backward, so below
# 10% even the best bounds the cell's gain near 7% (typical ones near 3%). A ViT-style model
# (a lone 16x16 patch-embedding conv, then transformer blocks) spent 1.8-2.9% of its step in
# convs and channels_last measured 0.95x-1.01x; conv-heavy CNNs spent 36-78% and measured up
# to 1.33x.
MIN_CONV_SHARE = 0.10
# Without the profiler's op times (CUDA, where they are host times; a cell running a profiler
# of its own) the share is of the model's conv + linear FLOPs, from the shapes the probe saw:
# a timing estimate against the probe's cold, instrumented run swung 0.6%-600% for one CNN
# on this loaded machine, FLOPs do not. It errs towards flagging (attention's matmuls and
# pointwise work are not counted), and the fix is measured anyway.


def _to_channels_last(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.contiguous(memory_format=torch.channels_last)
        if isinstance(a, torch.Tensor) and a.dim() == 4
        else a
        for a in args
    )


def _channels_last_inputs(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: the cell keeps passing NCHW tensors; the model sees NHWC."""
    return _to_channels_last(args)


class ChannelsLastFix(construction.BuiltObjectsFix):
    """4-D parameters, grads and buffers become channels_last in place (same tensor objects,
    new storage); a pre-hook converts 4-D inputs. Undo copies the current values back into
    the original storage and puts it back, so strides, storage and values are as before."""

    check_id = "channels-last"
    tolerance = 1e-5  # NHWC kernels sum in another order: last-bit differences are "close"

    def __init__(
        self, model: torch.nn.Module | None, built: construction.AtConstruction | None = None
    ):
        super().__init__()
        self.model = model  # None: the checked code builds it (`built` reaches each run's)
        self.built = built

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        if self.model is None:
            return
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        for tensor in tensors:
            if tensor.dim() != 4 or tensor.is_contiguous(memory_format=torch.channels_last):
                continue
            original = tensor.data

            def convert(t: torch.Tensor = tensor, data: torch.Tensor = original) -> None:
                t.data = data.contiguous(memory_format=torch.channels_last)

            def restore(t: torch.Tensor = tensor, data: torch.Tensor = original) -> None:
                with torch.no_grad():
                    if t.data.shape == data.shape and t.data.data_ptr() != data.data_ptr():
                        data.copy_(t.data)
                t.data = data

            patcher.call(convert, restore)
        handle: list[Any] = []
        model = self.model
        patcher.call(
            lambda: handle.append(model.register_forward_pre_hook(_channels_last_inputs)),
            lambda: handle.pop().remove(),
        )


def _channels_last_fix(obs: Observation, model: torch.nn.Module) -> ChannelsLastFix | None:
    """The fix, refusing later if the model was replaced since the probe; for a model the
    checked code builds, given to the model each run builds, at its first call (None where
    no construction in the checked code shows how each run makes it)."""
    key = obs.constructed.get(id(model))
    if key is None and obs.built_by_cell(model):
        return None
    if key is not None:
        return ChannelsLastFix(
            None,
            construction.AtConstruction(
                obs.workload, [key], key, lambda built: ChannelsLastFix(built[0]), [model]
            ),
        )
    fix = ChannelsLastFix(model)
    fix.seen = obs.places_of(model)
    return fix


@dataclass
class ConvTiming:
    path: str
    nchw_s: float
    nhwc_s: float

    @property
    def ratio(self) -> float:
        return self.nhwc_s / self.nchw_s if self.nchw_s else 1.0


def conv_timings(obs: Observation, convs: list[torch.nn.Conv2d]) -> list[ConvTiming]:
    """Forward time of each conv on a random input of the shape it saw, NCHW vs NHWC.

    No grad, copies of the weights: the live model is untouched. Stops at the budget."""
    timings: list[ConvTiming] = []
    deadline = time.perf_counter() + MICRO_BUDGET_S
    with torch.no_grad(), _restored_rng():
        for conv in convs[:MAX_CONVS]:
            use = obs.modules.get(id(conv))
            if use is None or use.input_shape is None or len(use.input_shape) != 4:
                continue
            if time.perf_counter() > deadline:
                break
            weight = conv.weight.detach()
            x = torch.randn(use.input_shape, dtype=weight.dtype, device=weight.device)
            bias = conv.bias.detach() if conv.bias is not None else None
            nchw, nhwc = _conv_times(conv, x, weight, bias, deadline)
            timings.append(ConvTiming(obs.module_path(conv), nchw, nhwc))
    return timings


FORMATS = (torch.contiguous_format, torch.channels_last)
# Each conv is timed in ROUNDS rounds, one call in each layout per round, and each layout's
# best call is its time: on a shared machine a burst of other work lasting a few calls
# then slows both layouts' calls in turn, not all of one layout's (timed three in a row,
# one conv read 14.1 ms in channels_last and 0.37 ms a moment later, 8x "slower").
ROUNDS = 5
# rounds timed even past the deadline: beside a CPU-bound process a float64 depthwise conv's
# call read 13 ms or, in a burst, 350-500 ms; cut to the one round the budget allowed, its
# NCHW call read slower than channels_last and the fix was offered where it is 7x slower
MIN_ROUNDS = 3


def _conv_times(
    conv: torch.nn.Conv2d,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    deadline: float,
) -> tuple[float, float]:
    """The conv's best forward time in NCHW and in channels_last, over interleaved rounds
    (fewer once past the deadline, MIN_ROUNDS at least)."""
    calls = []
    for memory_format in FORMATS:
        x_in = x.contiguous(memory_format=memory_format)
        w_in = weight.contiguous(memory_format=memory_format)

        def call(x_in: torch.Tensor = x_in, w_in: torch.Tensor = w_in) -> None:
            conv._conv_forward(x_in, w_in, bias)

        call()  # warm up (oneDNN primitive creation)
        calls.append(call)
    best = [float("inf")] * len(calls)
    for rounds in range(1, ROUNDS + 1):
        for index, call in enumerate(calls):
            synchronize()
            start = time.perf_counter()
            call()
            synchronize()  # a CUDA conv is timed to its end, not to its launch
            best[index] = min(best[index], time.perf_counter() - start)
        if rounds >= MIN_ROUNDS and time.perf_counter() > deadline:
            break
    return best[0], best[1]


@contextlib.contextmanager
def _restored_rng() -> Any:
    """The random inputs must not move the user's RNG stream."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _is_conv_op(name: str) -> bool:
    """`aten::mkldnn_convolution`, `aten::convolution_backward`, `aten::cudnn_convolution`…"""
    return "conv" in name.rsplit("::", 1)[-1]


@dataclass
class ConvShare:
    """How much of the work the convolutions are, as the evidence reads it: `lead` the key
    figure, `text` what it was measured from."""

    share: float
    lead: str
    text: str


def conv_share(obs: Observation, model: torch.nn.Module, convs: list[torch.nn.Conv2d]) -> ConvShare:
    """The convolutions' share of the cell's time (the probe's profiler self time of conv
    ops, on CPU), held to their share of the model's conv and linear FLOPs: on a busy
    machine a thread taken off its core holds up the whole op, and a ViT's lone
    patch-embedding conv read over 10% of the profiled time (2% of the FLOPs). Without op
    times, the FLOPs share alone."""
    flops, total = _flops_share(obs, model, convs)
    if obs.device == "cpu" and obs.op_totals and obs.profiled_s > 0:
        seconds = sum(us for op, (_, us) in obs.op_totals.items() if _is_conv_op(op)) / 1e6
        share = lockstep.mean(seconds / obs.profiled_s)
        return ConvShare(
            min(share, flops),
            f"took {share:.0%} of the cell's time",
            f"convolutions took {_ms(seconds)} of {obs.profiled_text(_ms)} ({share:.0%}, "
            f"profiler self time of the convolution ops; {flops:.0%} of its FLOPs)",
        )
    return ConvShare(
        flops,
        f"are {flops:.0%} of its conv and linear FLOPs",
        f"convolutions are {flops:.0%} of its conv and linear FLOPs ({total / 1e9:.2f} "
        "GFLOP forward, from the shapes seen: no op times in this run)",
    )


def _flops_share(
    obs: Observation, model: torch.nn.Module, convs: list[torch.nn.Conv2d]
) -> tuple[float, float]:
    """The convolutions' share of the model's conv and linear forward FLOPs, and that total.
    Load cannot move it; it errs high (attention's matmuls and pointwise work are left out)."""
    conv = sum(_flops(obs, m) for m in convs)
    linear = sum(_flops(obs, m) for m in model.modules() if isinstance(m, torch.nn.Linear))
    return (conv / (conv + linear) if conv + linear else 1.0), conv + linear


def _flops(obs: Observation, module: torch.nn.Module) -> float:
    """Forward FLOPs of a Conv2d or Linear over its calls, from the first input shape seen
    (the output shape comes from a meta-device run: no memory, no compute)."""
    use = obs.modules.get(id(module))
    if use is None or use.input_shape is None:
        return 0.0
    if isinstance(module, torch.nn.Linear):
        rows = math.prod(use.input_shape) // max(1, module.in_features)
        return 2.0 * rows * module.in_features * module.out_features * use.calls
    try:
        out = module._conv_forward(
            torch.empty(use.input_shape, device="meta"),
            module.weight.detach().to("meta"),
            None,
        )
    except (RuntimeError, ValueError, TypeError):  # e.g. a shape the conv no longer takes
        return 0.0
    per_output = module.weight[0].numel()  # in_channels / groups x kernel area
    return 2.0 * out.numel() * per_output * use.calls


class ChannelsLastCheck(Check):
    id = "channels-last"
    title = "A conv model runs on NCHW (channels-first) inputs"
    guide = "Use channels_last memory format for computer vision models"
    threshold = (
        f"convolutions ≥ {MIN_CONV_SHARE:.0%} of the cell's time and of the model's conv + "
        "linear FLOPs (without op times, e.g. on CUDA: of the FLOPs); 2-core CPU: a ViT's "
        "lone patch-embedding conv was 2-3% of its step (2% of its FLOPs), channels_last "
        "0.95-1.01x; conv CNNs 36-78%, up to 1.33x"
    )

    def detect(self, obs: Observation) -> list[Detection | Checked]:
        for use in obs.modules.values():
            model = use.module
            if not use.input_nchw_4d:
                continue
            convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
            called = [c for c in convs if id(c) in obs.modules]
            if not called:
                continue
            share = conv_share(obs, model, called)
            if share.share < MIN_CONV_SHARE:
                continue  # e.g. a ViT's patch embedding: nothing to gain for this cell
            timings = conv_timings(obs, called)
            # the fix would make the cell slower: said apart, not offered (one decision for
            # every rank of a torchrun job: their mean ratio)
            ratio = lockstep.mean_of([_nhwc_ratio(timings)])[0]
            if ratio is not None and ratio > REGRESSION:
                return [Checked(self.id, self.title, SLOWER_HERE, _timing_text(timings))]
            # one finding per id: the first model on NCHW input whose convs matter
            return [self._detection(obs, model, use.input_nchw_4d, called, timings, share)]
        return []

    def _detection(
        self,
        obs: Observation,
        model: torch.nn.Module,
        calls: int,
        convs: list[torch.nn.Conv2d],
        timings: list[ConvTiming],
        share: ConvShare,
    ) -> Detection:
        name = obs.module_path(model)
        shape = obs.modules[id(model)].input_shape
        details = [
            f"{name} ran {count(calls, 'time')} on NCHW-contiguous 4-D input "
            f"{list(shape) if shape else ''} through {len(convs)} Conv2d",
            share.text,
        ]
        if timings:
            details.append(_timing_text(timings))
        fix = _channels_last_fix(obs, model)
        if fix is None:
            details.append(f"not applied live: {name} is {construction.UNREACHED}")
        caveat = (
            "measure, never assume: channels_last regresses some models (most of the gain is "
            "on GPU with AMP)"
        )
        slower = _slowest(timings)
        if slower:  # the convs gain together: the ones that do not are a note
            caveat += "; the convs gain together, but these run slower in channels_last: "
            caveat += ", ".join(_conv_text(t) for t in slower)
        return Detection(
            self.finding(
                evidence=f"{name}'s convolutions {share.lead}, on NCHW-contiguous input",
                details="; ".join(details),
                where=name,
                fixable=fix is not None,
                caveat=caveat,
                segment=FORWARD,
                code_change=CodeChange(
                    "",
                    [
                        f"once, after building the model: {name} = "
                        f"{name}.to(memory_format=torch.channels_last)",
                        "for each 4-D input batch: x = x.to(memory_format=torch.channels_last)",
                    ],
                ),
            ),
            fix.bounded_by(share.share) if fix is not None else None,
        )


def _nhwc_ratio(timings: list[ConvTiming]) -> float | None:
    """The convs' time together in channels_last over theirs in NCHW (None: none timed)."""
    nchw = sum(t.nchw_s for t in timings)
    return sum(t.nhwc_s for t in timings) / nchw if nchw else None


def _slowest(timings: list[ConvTiming]) -> list[ConvTiming]:
    """The convs slower in channels_last, the worst first (four at most)."""
    return sorted((t for t in timings if t.ratio > REGRESSION), key=lambda t: -t.ratio)[:4]


def _conv_text(timing: ConvTiming) -> str:
    """`model.2.0 (0.66 ms → 10.39 ms, 15.75x the time)`."""
    figures = f"{_ms(timing.nchw_s)} → {_ms(timing.nhwc_s)}, {timing.ratio:.2f}x the time"
    return f"{timing.path} ({figures})"


def _timing_text(timings: list[ConvTiming]) -> str:
    """The per-conv trial: `per-conv forward timing (no grad) of 2 convs: 3.10 ms NCHW →
    12.40 ms channels_last (4.00x the time); slower: model.2.0 (…)`."""
    nchw = sum(t.nchw_s for t in timings)
    nhwc = sum(t.nhwc_s for t in timings)
    ratio = _nhwc_ratio(timings) or 1.0
    text = (
        f"per-conv forward timing (no grad) of {count(len(timings), 'conv')}: {_ms(nchw)} NCHW "
        f"→ {_ms(nhwc)} channels_last ({ratio:.2f}x the time)"
    )
    slower = _slowest(timings)
    if len(timings) > 1 and slower and ratio > REGRESSION:
        text += "; slowest: " + ", ".join(_conv_text(t) for t in slower)
    return text
