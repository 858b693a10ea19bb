"""A convolution bias that the BatchNorm right after it cancels.

Guide section: "Disable bias for convolutions directly followed by a batch norm". BatchNorm
subtracts the per-channel mean, so a per-channel conv bias before it changes nothing but
costs an add (and its gradient) on every call. Evidence is the probe's tensor-identity
edges: the conv's output object was the BatchNorm's input, on every call of the conv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..cell import history
from ..kernel import discovery
from ..kernel.fixes import Fix, Patcher
from ..report import FORWARD, CodeChange, count
from . import bounds
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import Observation

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
BIAS_POSITION = 7  # Conv1d/2d/3d(in, out, kernel_size, stride, padding, dilation, groups, bias)
SHOWN = 4  # pairs named in the evidence before "and N more"


@dataclass
class _Pair:
    """A conv with bias whose every output went straight into these BatchNorms."""

    conv: nn.Module
    norms: list[_BatchNorm]
    calls: int


def conv_bn_pairs(obs: Observation) -> list[_Pair]:
    """Convs with a bias whose outputs all fed, by tensor identity, a BatchNorm over the
    conv's channels that no other module feeds."""
    consumers: dict[int, dict[int, int]] = {}
    producers: dict[int, set[int]] = {}
    for (src, dst), calls in obs.edges.items():
        consumers.setdefault(src, {})[dst] = calls
        producers.setdefault(dst, set()).add(src)
    pairs = []
    for use in obs.modules.values():
        conv = use.module
        if not isinstance(conv, CONVS) or conv.bias is None:
            continue
        fed = consumers.get(id(conv), {})
        norms = [obs.modules[dst].module for dst in fed if dst in obs.modules]
        if not fed or len(norms) != len(fed) or sum(fed.values()) < use.calls:
            continue  # some outputs went to other code (a functional op, a residual add)
        if all(
            isinstance(norm, _BatchNorm)
            and norm.num_features == conv.out_channels
            and producers.get(id(norm)) == {id(conv)}
            for norm in norms
        ):
            pairs.append(_Pair(conv, norms, use.calls))  # type: ignore[arg-type]
    return pairs


class DropConvBiasFix(Fix):
    """Remove each conv's bias (kept, to put back) and fold it into the BatchNorms'
    running_mean, which keeps eval-mode outputs equal: (y + b - m) == (y - (m - b)).

    Train mode needs no fold (the batch mean absorbs the bias), and the fold stays right
    through training: the running-mean update is linear, so `m_fixed = m - b` holds after
    every step. While applied, `state_dict()` presents the model as the user built it (the
    bias at its kept value, running_mean + bias), so checkpoints and the numerics
    comparison see the same parametrization with and without the fix.
    """

    check_id = "conv-bias-bn"
    tolerance = 1e-4  # float rounding moves when the add goes away: close, not bit-exact

    def __init__(self, pairs: list[_Pair]):
        super().__init__()
        self.pairs = pairs

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for pair in self.pairs:
            bias = pair.conv.bias
            assert bias is not None
            for norm in pair.norms:
                self._fold(patcher, norm, bias)
            self._remove(patcher, pair.conv, bias)

    @staticmethod
    def _remove(patcher: Patcher, conv: nn.Module, bias: torch.Tensor) -> None:
        grad = bias.grad

        def remove() -> None:
            conv.bias = None
            bias.grad = None  # optimizers holding it skip a param whose grad is None

        def restore() -> None:
            conv.bias = bias
            bias.grad = grad

        patcher.call(remove, restore)

        def present(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
            state[prefix + "bias"] = bias.detach()

        handle = conv.register_state_dict_post_hook(present)
        patcher.call(lambda: None, handle.remove)

    @staticmethod
    def _fold(patcher: Patcher, norm: _BatchNorm, bias: torch.Tensor) -> None:
        mean = norm.running_mean
        if mean is None:  # batch statistics only: the bias always cancels
            return
        shift = bias.detach().to(mean)
        saved = mean.detach().clone()
        folded: list[torch.Tensor] = []

        def fold() -> None:
            with torch.no_grad():
                mean.sub_(shift)
            folded.append(mean.detach().clone())

        def unfold() -> None:
            with torch.no_grad():
                if torch.equal(mean, folded[0]):
                    mean.copy_(saved)  # untouched since: put back the exact bits
                else:
                    mean.add_(shift)  # trained since: keep what it learned

        patcher.call(fold, unfold)

        def present(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
            key = prefix + "running_mean"
            if key in state:
                exact = torch.equal(mean, folded[0])
                state[key] = saved.clone() if exact else mean.detach() + shift

        handle = norm.register_state_dict_post_hook(present)
        patcher.call(lambda: None, handle.remove)


def _output_elements(conv: nn.Module, shape: tuple[int, ...] | None) -> int | None:
    """Values in one output of `conv` for an input of `shape`, worked out on the meta
    device (no compute); None where the shape is unknown or does not fit the conv."""
    if shape is None:
        return None
    try:
        meta = torch.empty(shape, device="meta", dtype=conv.weight.dtype)
        return conv._conv_forward(meta, conv.weight.to("meta"), None).numel()
    except (RuntimeError, ValueError, TypeError):
        return None


def saved_share(obs: Observation, pairs: list[_Pair]) -> float | None:
    """The largest share of a plain run the fix can save: each call's bias add over the
    conv's output and, for calls that record grads, the bias gradient's reduction over it
    (`bounds`); None where a conv's output size is unknown."""
    saved_s = 0.0
    for pair in pairs:
        use = obs.modules.get(id(pair.conv))
        elements = _output_elements(pair.conv, use.input_shape if use else None)
        if use is None or elements is None:
            return None
        passes = use.calls + use.grad_calls
        saved_s += bounds.passes_s(elements, passes, pair.conv.weight.dtype)
    return bounds.share_of_run(saved_s, obs.wall_s)


def _constructor(conv: nn.Module) -> str:
    return f"nn.{type(conv).__name__}({conv.extra_repr()}, bias=False)"


def _built_in_cell(obs: Observation, module: nn.Module) -> bool:
    """True when no model that existed before the cell contains `module` (the cell builds
    its model, so every run makes new modules a live fix cannot reach)."""
    return not any(
        key in obs.preexisting
        and isinstance(entry.obj, nn.Module)
        and any(sub is module for sub in entry.obj.modules())
        for key, entry in obs.found.items()
    )


def _earlier_edits(obs: Observation, pairs: list[_Pair]) -> list[tuple[str, history.CallEdit]]:
    """`bias=False` on the constructor call of each paired conv, in the earlier cell that
    built it: (module path, edit). A call that also built a conv outside the pairs (one
    `self.conv1 = ...` in a block class whose other uses feed no BatchNorm) is left alone."""
    workload = obs.workload

    def edit_of(path: str) -> history.CallEdit | None:
        return history.keyword_edit(
            workload.notebook,
            workload.namespace,
            history.module_path(path),
            {"bias": "False"},
            {"bias": BIAS_POSITION},
        )

    paired = {id(pair.conv) for pair in pairs}
    found = [(obs.module_path(pair.conv), edit_of(obs.module_path(pair.conv))) for pair in pairs]
    wanted = [(path, edit) for path, edit in found if edit is not None]
    if not wanted:
        return []
    models = {id(entry.obj): entry.obj for entry in discovery.top_level_modules(obs.found)}
    others = [
        module
        for model in models.values()
        for module in model.modules()
        if isinstance(module, CONVS) and module.bias is not None and id(module) not in paired
    ]
    shared = {_site(edit_of(obs.module_path(conv))) for conv in others} - {None}
    return [(path, edit) for path, edit in wanted if _site(edit) not in shared]


def _site(edit: history.CallEdit | None) -> tuple[int, int, int] | None:
    return (edit.execution_count, edit.line, edit.col) if edit is not None else None


class ConvBiasBNCheck(Check):
    id = "conv-bias-bn"
    title = "A convolution's bias is cancelled by the BatchNorm right after it"
    guide = "Disable bias for convolutions directly followed by a batch norm"

    def detect(self, obs: Observation) -> list[Detection]:
        pairs = conv_bn_pairs(obs)
        if not pairs:
            return []
        paths = [obs.module_path(pair.conv) for pair in pairs]
        described = [
            f"{path} ({type(pair.conv).__name__}, {pair.conv.out_channels} channels) fed "
            f"{' and '.join(obs.module_path(n) for n in pair.norms)} on all {pair.calls} calls"
            for path, pair in zip(paths, pairs, strict=True)
        ]
        details = "; ".join(described[:SHOWN])
        if len(described) > SHOWN:
            details += f"; and {len(described) - SHOWN} more"
        params = sum(pair.conv.out_channels for pair in pairs)
        evidence = (
            f"{count(params, 'bias value')} of {count(len(pairs), 'convolution')} "
            f"{'was' if params == 1 else 'were'} added and then subtracted again by the "
            "BatchNorm's mean"
        )
        in_cell = [
            path for path, pair in zip(paths, pairs, strict=True) if _built_in_cell(obs, pair.conv)
        ]
        fix = None
        if in_cell:
            details += (
                f"; not applied live: the cell builds {', '.join(in_cell)} itself, so every "
                "run makes new modules: change the constructors"
            )
        else:
            fix = DropConvBiasFix(pairs).bounded_by(saved_share(obs, pairs))
            fix.seen = obs.places_of(*(pair.conv for pair in pairs))
        earlier = _earlier_edits(obs, pairs)
        edited = {path for path, _ in earlier}
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,
                    segment=FORWARD,
                    where=", ".join(paths),
                    fixable=fix is not None,
                    caveat=(
                        "outputs stay equal up to float rounding; the bias stays in the "
                        "optimizer without a gradient (skipped); while the fix is on, "
                        "state_dict() still shows the bias and the unfolded running_mean, "
                        "but load_state_dict() of a checkpoint with the bias fails until "
                        "it is undone"
                    ),
                    code_change=CodeChange(
                        "",
                        [
                            f"{path}: {_constructor(pair.conv)}"
                            for path, pair in zip(paths, pairs, strict=True)
                            if path not in edited
                        ],
                    ),
                ),
                fix,
                None,
                list(dict.fromkeys(edit for _, edit in earlier)),
            )
        ]
