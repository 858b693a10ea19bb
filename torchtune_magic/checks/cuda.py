"""Host/device plumbing on CUDA: cuDNN autotuning, blocking copies, tensors built on the host.

Guide (GPU part): "Enable cuDNN auto-tuner", "Use non_blocking=True with pinned memory"
(the second half of "Use pinned memory buffers") and "Create tensors directly on the target
device". The evidence is the probe's: conv modules and their input shapes, and every
host-to-CUDA copy with its cell line, pinned-ness and `non_blocking` flag.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..cell import codeedit
from ..kernel.fixes import Fix, Patcher
from ..report import FORWARD, OTHER, CodeChange, count
from .base import Check, Detection, size_text
from .loader import lines_text, non_blocking_edit

if TYPE_CHECKING:
    from ..probe.observation import HostCopy, Observation


# cudnn-benchmark ------------------------------------------------------------------------------


class CudnnBenchmarkFix(Fix):
    """`torch.backends.cudnn.benchmark = True` while applied; undo puts back False. The first
    run with it autotunes each conv shape: a one-time cost, reported apart."""

    check_id = "cudnn-benchmark"
    one_time_cause = "cuDNN autotune"  # every conv shape is tuned on the first run
    one_time_guess_s = 2.0

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        patcher.switch(torch.backends.cudnn, "benchmark", True)


class CudnnBenchmarkCheck(Check):
    id = "cudnn-benchmark"
    title = "Convolutions with fixed input shapes run without the cuDNN auto-tuner"
    guide = "Enable cuDNN auto-tuner"
    devices = ("cuda",)

    def detect(self, obs: Observation) -> list[Detection]:
        if torch.backends.cudnn.benchmark:
            return []
        convs = [
            use
            for use in obs.modules.values()
            if isinstance(use.module, nn.modules.conv._ConvNd) and use.calls
        ]
        if not convs:
            return []
        varying = [use for use in convs if len(use.input_shapes) > 1]
        if varying:
            return []  # autotuning would re-run for every new shape
        calls = sum(use.calls for use in convs)
        shapes = sorted({shape for use in convs for shape in use.input_shapes})
        example = f"input shapes such as {shapes[0]}; " if shapes else ""
        source = obs.workload.source
        fixed = "torch.backends.cudnn.benchmark = True\n" + source
        return [
            Detection(
                self.finding(
                    evidence=(
                        f"{count(len(convs), 'convolution module')} ran {count(calls, 'time')} "
                        "without the cuDNN auto-tuner, each with one input shape"
                    ),
                    details=(
                        f"{example}torch.backends.cudnn.benchmark is False, so cuDNN picks "
                        "kernels by heuristics instead of timing them"
                    ),
                    segment=FORWARD,
                    where=", ".join(sorted({obs.module_path(u.module) for u in convs})[:6]),
                    fixable=True,
                    caveat=(
                        "the first run per input shape pays the autotuning (reported as "
                        "one-time); with varying shapes it re-tunes each new one; the chosen "
                        "kernels may differ between runs, so results are not bit-reproducible"
                    ),
                    code_change=CodeChange(
                        codeedit.unified_diff(source, fixed),
                        ["or set it once at the top of the notebook"],
                    ),
                ),
                CudnnBenchmarkFix(),
                fixed,
            )
        ]


# non-blocking-copy ----------------------------------------------------------------------------


class NonBlockingCopyFix(Fix):
    """The cell's `.to(...)`/`.cuda(...)` calls on the given lines get `non_blocking=True`."""

    check_id = "non-blocking-copy"

    def __init__(self, lines: set[int]):
        super().__init__()
        self.lines = set(lines)

    def edit_source(self, source: str) -> str:
        return non_blocking_edit(source, self.lines)


class NonBlockingCopyCheck(Check):
    id = "non-blocking-copy"
    title = "Pinned tensors are copied to the GPU with non_blocking=False"
    guide = "Use pinned memory buffers"
    devices = ("cuda",)

    def detect(self, obs: Observation) -> list[Detection]:
        # Pageable copies are pin-memory's finding: non_blocking only overlaps from pinned memory.
        blocking = [c for c in obs.host_copies if c.pinned and not c.non_blocking]
        if not blocking:
            return []
        lines = {c.line for c in blocking if c.line is not None}
        source = obs.workload.source
        fixed = non_blocking_edit(source, lines)
        fix = NonBlockingCopyFix(lines) if fixed != source else None
        size = size_text(sum(c.nbytes for c in blocking))
        evidence = (
            f"{count(len(blocking), 'copy', 'copies')} of pinned host tensors ({size} in all) "
            "to the GPU ran with non_blocking=False"
        )
        elsewhere = []
        if fix is None:
            elsewhere.append("pass non_blocking=True to the .to(device)/.cuda() calls that copy")
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=(
                        "the host waits for each one instead of queueing it behind the "
                        "running kernels"
                    ),
                    segment=OTHER,  # the cell's own copies, between the parts it times
                    where=f"cell {lines_text(lines)}" if lines else "code called from the cell",
                    fixable=fix is not None,
                    line=min(lines) if lines else None,
                    caveat=(
                        "the host must not overwrite a pinned source tensor until the copy "
                        "has run (reading the copy on the GPU is ordered and safe)"
                    ),
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
                ),
                fix,
                fixed if fix else None,
            )
        ]


# tensor-on-device -----------------------------------------------------------------------------

FACTORIES = frozenset(
    {
        "randn", "rand", "randint", "randperm", "zeros", "ones", "empty", "full", "arange",
        "linspace", "logspace", "eye", "tensor", "zeros_like", "ones_like", "empty_like",
        "full_like", "rand_like", "randn_like", "randint_like",
    }
)  # fmt: skip
RANDOM_FACTORIES = frozenset(name for name in FACTORIES if name.startswith("rand"))


def _device_text(source: str, move: ast.Call) -> str | None:
    """The device a `.to(...)` / `.cuda()` call moves to, as source text, or None when the
    call does more than move (a dtype, copy=..., a device index)."""
    method = move.func.attr if isinstance(move.func, ast.Attribute) else ""
    extra = [k for k in move.keywords if k.arg not in ("non_blocking", "device")]
    if extra:
        return None
    device_kw = next((k.value for k in move.keywords if k.arg == "device"), None)
    if method == "cuda":
        return '"cuda"' if not move.args and device_kw is None else None
    if len(move.args) == 1 and device_kw is None:
        arg = move.args[0]
        dotted = codeedit.dotted_name(arg)
        if dotted.startswith("torch.") and not dotted.startswith("torch.device"):
            return None  # torch.float16 & co: a dtype, not a device
        return ast.get_source_segment(source, arg)
    if not move.args and device_kw is not None:
        return ast.get_source_segment(source, device_kw)
    return None


def factory_moves(source: str, lines: set[int]) -> list[tuple[ast.Call, str, str]]:
    """`torch.<factory>(...).to(dev)` / `.cuda()` calls on these lines, each with the
    replacement text `torch.<factory>(..., device=dev)` and the factory's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("to", "cuda")
            and node.lineno in lines
            and isinstance(node.func.value, ast.Call)
        ):
            continue
        factory = node.func.value
        name = codeedit.dotted_name(factory.func).rsplit(".", 1)[-1]
        device = _device_text(source, node)
        if name not in FACTORIES or device is None:
            continue
        if any(k.arg == "device" for k in factory.keywords):
            continue
        inner = ast.get_source_segment(source, factory) or ""
        # the factory call alone, given device= in its own layout (comments stay)
        keyword = {"device": device}
        moved = codeedit.edited(
            inner, lambda s, n={name}, k=keyword: codeedit.with_keywords(s, 1, n, k, col=0)
        )[0]
        if moved != inner:
            found.append((node, moved, name))
    return found


class TensorOnDeviceFix(Fix):
    """The cell's `torch.<factory>(...).to(dev)` become `torch.<factory>(..., device=dev)`."""

    check_id = "tensor-on-device"

    def __init__(self, lines: set[int]):
        super().__init__()
        self.lines = set(lines)

    def edit_source(self, source: str) -> str:
        moves = [(node, text) for node, text, _ in factory_moves(source, self.lines)]
        return codeedit.edited(source, lambda s: codeedit.replace_nodes(s, moves))[0]


class TensorOnDeviceCheck(Check):
    id = "tensor-on-device"
    title = "Tensors are built on the CPU and then copied to the GPU"
    guide = "Create tensors directly on the target device"
    devices = ("cuda",)

    def detect(self, obs: Observation) -> list[Detection]:
        copies: list[HostCopy] = [
            c for c in obs.host_copies if not c.from_loader and c.line is not None
        ]
        lines = {c.line for c in copies if c.line is not None}
        moves = factory_moves(obs.workload.source, lines)
        if not moves:
            return []
        move_lines = {node.lineno for node, _, _ in moves}
        moved = [c for c in copies if c.line in move_lines]
        fix = TensorOnDeviceFix(move_lines)
        source = obs.workload.source
        fixed = fix.edit_source(source)
        random = sorted({name for _, _, name in moves if name in RANDOM_FACTORIES})
        caveat = "the tensors are made by the device's kernels: no host buffer, no copy"
        if random:
            caveat = (
                f"{', '.join(random)} on the GPU draws from the CUDA generator, not the CPU "
                "one: the random values change (same distribution), so numerics say 'changed'"
            )
        return [
            Detection(
                self.finding(
                    evidence=(
                        f"{count(len(moved), 'tensor')} "
                        f"({size_text(sum(c.nbytes for c in moved))}) "
                        f"{'was' if len(moved) == 1 else 'were'} built on the CPU and copied "
                        f"to the GPU at cell {lines_text(move_lines)}"
                    ),
                    segment=OTHER,  # built by the cell's own code
                    where=f"cell {lines_text(move_lines)}",
                    fixable=True,
                    line=min(move_lines),
                    caveat=caveat,
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), []),
                ),
                fix,
                fixed,
            )
        ]
