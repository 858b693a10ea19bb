"""Math precision: autocast (AMP) on GPUs and on CPUs with native bf16, TF32 matmuls.

Guide: "Use mixed precision and AMP" and "Enable TF32 on Ampere and later". Both fixes
change results a little by design, so each states its tolerance and the report records the
measured numerics verdict next to the speedup.

The detection reads what the probe saw (math modules called in float32 with autocast off,
the profiler's matmul/conv op counts and times). On a CPU, `amp` applies only where the CPU
runs bf16 in hardware (AMX, AVX512-BF16, Arm BF16: `engine/cpu.py`) and only when matmuls
and convolutions are a real share of the cell: elsewhere the casts cost more than bf16
saves. bf16 needs no loss scaling, so a CPU training cell gets autocast alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..engine import codeedit, cpu, discovery, frameworks
from ..engine.fixes import Fix, Patcher, patched
from ..report import CodeChange
from .base import Check, Detection

if TYPE_CHECKING:
    from ..engine.probe import ModuleUse, Observation

MATH_MODULES = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.MultiheadAttention,
    nn.RNNBase,
)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")
CONV_OPS = ("aten::convolution", "aten::cudnn_convolution", "aten::mkldnn_convolution")
# self time of these ops is the "math" a CPU autocast speeds up (composite ops such as
# aten::linear carry little self time, their mm/addmm children the rest)
CPU_MATH_OPS = (
    *MATMUL_OPS,
    *CONV_OPS,
    "aten::linear",
    "aten::_convolution",
    "aten::convolution_backward",
    "aten::mkldnn_convolution_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)
# On a CPU, autocast's casts cost more than bf16 math saves unless matmuls/convolutions
# dominate. Measured here (AVX512-BF16, shared 2-core machine): a 16-wide MLP (math 6% of
# the probe) 1.0x; a 1024-wide MLP (math 50-84%) 1.3-2.4x training; a 64-channel conv net
# (67-75%) 1.6x inference.
CPU_MIN_MATH_SHARE = 0.25
# ...and unless each matmul/conv is big enough to outweigh the casts: measured here on a
# training step of Linear layers (one thread), 0.5x at 0.5 MFLOP per call, 0.9x at 4, 1.0x
# at 8, 1.35x at 17, 1.8x at 537. Time shares alone mislead on a busy machine, where a
# stalled thread pool makes even tiny matmuls look like most of the time.
CPU_MIN_CALL_FLOPS = 16e6
# torch.testing.assert_close's default rtol for bfloat16: one bf16 rounding (8-bit mantissa,
# unit roundoff 3.9e-3) a few times over. Used for fp16 too (finer mantissa, same bound).
AMP_TOLERANCE = 1.6e-2
# PyTorch's own tests compare TF32 results with 5e-3 (tf32_on_and_off); TF32 keeps 10 bits.
TF32_TOLERANCE = 5e-3
CLIP_CALLS = {"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm"}


def fp32_math(obs: Observation) -> list[ModuleUse]:
    """Matmul/conv modules that ran in float32 with autocast off for at least one call."""
    return [
        use
        for use in obs.modules.values()
        if isinstance(use.module, MATH_MODULES)
        and use.calls > use.autocast_calls
        and any(p.dtype == torch.float32 for p in use.module.parameters(recurse=False))
    ]


def _op_counts(obs: Observation, names: tuple[str, ...]) -> int:
    return sum(obs.op_totals.get(name, (0, 0.0))[0] for name in names)


def _modules_text(uses: list[ModuleUse]) -> str:
    counts: dict[str, int] = {}
    for use in uses:
        name = type(use.module).__name__
        counts[name] = counts.get(name, 0) + use.calls - use.autocast_calls
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items()))


def _ops_text(obs: Observation) -> str:
    matmuls, convs = _op_counts(obs, MATMUL_OPS), _op_counts(obs, CONV_OPS)
    if not (matmuls or convs):
        return ""
    return f"; the profiler saw {matmuls} matmul and {convs} convolution ops"


def _loop_lines(obs: Observation, uses: list[ModuleUse]) -> tuple[int, int] | None:
    """First and last line of the cell statements that called these modules (through the
    outermost module that contains them: inner calls carry no cell line)."""
    inner = {id(use.module) for use in uses}
    lines = sorted(
        {
            line
            for outer in obs.modules.values()
            if outer.outer_calls and any(id(m) in inner for m in outer.module.modules())
            for line in outer.lines
        }
    )
    if not lines:
        return None
    first = codeedit.top_statement_at(obs.tree, lines[0])
    last = codeedit.top_statement_at(obs.tree, lines[-1])
    if first is None or last is None:
        return None
    return first.lineno, last.end_lineno or last.lineno


# amp ------------------------------------------------------------------------------------------


def _scaled_step(optimizer: torch.optim.Optimizer, scaler: Any) -> Any:
    """`optimizer.step` that goes through the GradScaler (unscale, skip on inf, update).

    GradScaler.step calls `optimizer.step` itself: that inner call reaches the step that was
    there before (the user's, or an LR scheduler's counting wrapper)."""
    previous = optimizer.step
    inside = False

    def step(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside
        if inside:
            return previous(*args, **kwargs)
        inside = True
        try:
            result = scaler.step(optimizer, *args, **kwargs)
            scaler.update()
            return result
        finally:
            inside = False

    if hasattr(previous, "_wrapped_by_lr_sched"):  # an LR scheduler checks for its wrapper
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


class AmpFix(Fix):
    """Every run of the cell under `torch.autocast(device, dtype)`. With float16 in a training
    cell, a fresh `GradScaler` per run scales `loss.backward()` and routes every optimizer
    the cell can reach (found at run time, so a rebuilt one counts) through `scaler.step`
    and `scaler.update`; all of it is undone when the run ends."""

    check_id = "amp"
    tolerance = AMP_TOLERANCE
    cuts_memory_on = frozenset({"cuda"})  # activations kept in half precision

    def __init__(self, device_type: str, dtype: torch.dtype, scaled: bool):
        super().__init__()
        self.device_type = device_type
        self.compute_dtype = dtype
        self.scaled = scaled

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        return self._context(namespace)

    @contextlib.contextmanager
    def _context(self, namespace: dict[str, Any]) -> Iterator[None]:
        with torch.autocast(self.device_type, dtype=self.compute_dtype):
            if not self.scaled:
                yield
                return
            scaler = torch.amp.GradScaler(self.device_type)
            with patched(lambda patcher: self._scale(patcher, scaler, namespace)):
                yield

    @staticmethod
    def _scale(patcher: Patcher, scaler: Any, namespace: dict[str, Any]) -> None:
        backward = torch.Tensor.backward

        def scaled_backward(loss: torch.Tensor, gradient: Any = None, *args: Any, **kw: Any):
            if gradient is None and loss.numel() == 1:
                loss = scaler.scale(loss)
            return backward(loss, gradient, *args, **kw)

        patcher.setattr(torch.Tensor, "backward", scaled_backward)
        found = discovery.of_type(discovery.walk(namespace), torch.optim.Optimizer)
        for entry in found:
            patcher.setattr(entry.obj, "step", _scaled_step(entry.obj, scaler))


class AmpCheck(Check):
    id = "amp"
    title = "Matmuls and convolutions run in float32 without autocast"
    guide = "Use mixed precision and AMP"
    threshold = (
        f"CUDA: any float32 matmul/conv; CPU (with native bf16): matmul/conv time ≥ "
        f"{CPU_MIN_MATH_SHARE:.0%} of the cell and ≥ {CPU_MIN_CALL_FLOPS / 1e6:.0f} MFLOP per "
        "call (Linear training here: 0.5x at 0.5 MFLOP, 1.0x at 8, 1.35x at 17, 1.8x at 537)"
    )

    def not_applicable(self, obs: Observation) -> str | None:
        if obs.device != "cpu":
            return super().not_applicable(obs)
        reason = cpu.no_bf16_reason()
        if reason is None and not torch.backends.mkldnn.is_available():
            reason = "this torch build has no oneDNN, which runs bf16 math on CPUs"
        return f"not applicable on this CPU: {reason}" if reason else None

    def detect(self, obs: Observation) -> list[Detection]:
        uses = fp32_math(obs)
        if not uses:
            return []
        share = _cpu_math_share(obs) if obs.device == "cpu" else None
        per_call = _flops_per_call(uses)
        if obs.device == "cpu" and (
            share is None
            or share < CPU_MIN_MATH_SHARE
            or (per_call is not None and per_call < CPU_MIN_CALL_FLOPS)
        ):
            return []  # unweighed (the cell ran its own profiler), too little or too small
        dtype = _amp_dtype(obs.device)
        training = obs.backward_calls > 0
        scaled = training and dtype == torch.float16
        blocked = None
        if scaled and len(obs.optimizers) != 1:
            blocked = "float16 training needs one GradScaler per step: scale it by hand"
        if scaled and any(codeedit.calls_named(obs.tree, CLIP_CALLS)):
            blocked = "the cell clips gradients, which must be unscaled first (scaler.unscale_)"
        name = "bfloat16" if dtype == torch.bfloat16 else "float16"
        evidence = f"{_modules_text(uses)} ran in float32 with autocast off{_ops_text(obs)}"
        if share is not None:
            size = f", {per_call / 1e6:,.0f} MFLOP per call" if per_call is not None else ""
            evidence += (
                f"; matmuls and convolutions took {share:.0%} of the cell's time{size}; this "
                f"CPU runs bf16 in hardware ({', '.join(cpu.bf16_features())} in its flags)"
            )
        evidence += f"; autocast would run them in {name}" + (
            " with a GradScaler" if scaled else ""
        )
        if blocked:
            evidence += f"; not applied live: {blocked}"
        source = obs.workload.source
        header = f'with torch.autocast("{obs.device}", dtype=torch.{name})'
        span = _loop_lines(obs, uses)
        fixed = codeedit.wrap_lines(source, *span, header) if span else source
        elsewhere = []
        trainer = frameworks.args_change(
            obs.workload,
            obs.names_before,
            {"bf16" if dtype == torch.bfloat16 else "fp16": "True"},
            "when the Trainer is built: make the Trainer again after changing it",
        )
        if trainer is not None:  # the Trainer's own mixed precision, not a with-block
            fixed, span, elsewhere = source, None, list(trainer.elsewhere)
            if scaled and blocked is None:
                blocked = (
                    f"{trainer.owner.name} makes its optimizer inside train(), out of a "
                    "GradScaler's reach: set fp16=True in its arguments"
                )
                evidence += f"; not applied live: {blocked}"
        if scaled and trainer is None:
            elsewhere.append(
                f"create scaler = torch.amp.GradScaler('{obs.device}') once, then "
                "scaler.scale(loss).backward(); scaler.step(opt); scaler.update()"
            )
        if not span and trainer is None:
            elsewhere.append(f"run the forward passes under {header}")
        fix = None if blocked else AmpFix(obs.device, dtype, scaled)
        names = sorted({obs.module_path(use.module) for use in uses})
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    where=", ".join(names[:6]) + (" …" if len(names) > 6 else ""),
                    fixable=fix is not None,
                    line=span[0] if span else None,
                    caveat=_amp_caveat(name, training),
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
                ),
                fix,
                fixed if fixed != source else None,
                trainer.earlier if trainer is not None else [],
            )
        ]


def _cpu_math_share(obs: Observation) -> float | None:
    """Self time of matmul/conv ops over the probe's wall time (None: no op stream)."""
    if not obs.op_totals or not obs.wall_s:
        return None
    math_us = sum(obs.op_totals.get(name, (0, 0.0))[1] for name in CPU_MATH_OPS)
    return min(1.0, math_us / 1e6 / obs.wall_s)


def _flops_per_call(uses: list[ModuleUse]) -> float | None:
    """Mean FLOPs of one float32 call of these modules, from the input shape each was
    first called with (None when no module's size can be told)."""
    flops = calls = 0.0
    for use in uses:
        each = _call_flops(use.module, use.input_shape)
        if each is not None:
            fp32_calls = use.calls - use.autocast_calls
            flops += each * fp32_calls
            calls += fp32_calls
    return flops / calls if calls else None


def _call_flops(module: nn.Module, shape: tuple[int, ...] | None) -> float | None:
    """Multiply-adds x 2 of one forward of a Linear or convolution on an input of `shape`."""
    if shape is None:
        return None
    if isinstance(module, nn.Linear):
        return 2.0 * math.prod(shape[:-1]) * module.in_features * module.out_features
    if isinstance(module, nn.modules.conv._ConvNd):
        dims = len(module.kernel_size)
        if len(shape) < dims + 1:
            return None
        batch = math.prod(shape[: -(dims + 1)])
        spatial = list(shape[-dims:])
        if not module.transposed:  # output positions (exact for "same" padding)
            spatial = [-(-size // module.stride[i]) for i, size in enumerate(spatial)]
        # each position of the smaller side meets a kernel of every channel pair in a group
        pairs = module.in_channels * module.out_channels / module.groups
        return 2.0 * batch * math.prod(spatial) * math.prod(module.kernel_size) * pairs
    return None


def _amp_caveat(name: str, training: bool) -> str:
    """What autocast does to results, with the tolerance the numerics verdict used."""
    bits = "8" if name == "bfloat16" else "11"
    text = (
        f"{name} keeps {bits} significant bits, so results change: they are compared with a "
        f"relative tolerance of {AMP_TOLERANCE:g} (torch.testing's for bfloat16) instead of "
        "float32's; losses, softmax and reductions stay float32 under autocast"
    )
    if training:
        text += (
            "; small changes add up over many steps: check the trained model's validation "
            "loss or accuracy before keeping it"
        )
    return text


def _amp_dtype(device: str) -> torch.dtype:
    """bfloat16 where the device has it (no loss scaling needed), else float16."""
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


# tf32 -----------------------------------------------------------------------------------------


class TF32Fix(Fix):
    """`torch.set_float32_matmul_precision("high")` (and cuDNN TF32 if it was off); undo puts
    back the exact previous settings."""

    check_id = "tf32"
    tolerance = TF32_TOLERANCE

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        previous = torch.get_float32_matmul_precision()
        patcher.call(
            lambda: torch.set_float32_matmul_precision("high"),
            lambda: torch.set_float32_matmul_precision(previous),
        )
        patcher.switch(torch.backends.cudnn, "allow_tf32", True)


class TF32Check(Check):
    id = "tf32"
    title = 'float32 matmuls run at full precision ("highest") on a TF32-capable GPU'
    guide = "Enable TF32 on Ampere and later"
    devices = ("cuda",)

    def not_applicable(self, obs: Observation) -> str | None:
        reason = super().not_applicable(obs)
        if reason is None and torch.cuda.get_device_capability() < (8, 0):
            return "not applicable: TF32 needs an Ampere or newer GPU (compute capability 8.0)"
        return reason

    def detect(self, obs: Observation) -> list[Detection]:
        if torch.get_float32_matmul_precision() != "highest":
            return []
        uses = [u for u in fp32_math(obs) if not isinstance(u.module, nn.modules.conv._ConvNd)]
        matmuls = _op_counts(obs, MATMUL_OPS)
        if not uses and not matmuls:
            return []
        seen = _modules_text(uses) + " ran in float32" if uses else "float32 matmuls ran"
        evidence = (
            f"{seen}; the profiler saw {matmuls} matmul ops; "
            'torch.get_float32_matmul_precision() is "highest", so none uses TF32 tensor cores'
        )
        source = obs.workload.source
        fixed = codeedit.insert_after_imports(source, 'torch.set_float32_matmul_precision("high")')
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    where=", ".join(sorted({obs.module_path(u.module) for u in uses}))
                    or "matmuls in the cell",
                    fixable=True,
                    caveat=(
                        "TF32 rounds matmul inputs to 10 mantissa bits (results compared with "
                        f"tolerance {TF32_TOLERANCE:g}); the setting is process-wide"
                    ),
                    code_change=CodeChange(
                        codeedit.unified_diff(source, fixed),
                        ["or set it once at the top of the notebook"],
                    ),
                ),
                TF32Fix(),
                fixed,
            )
        ]
