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

from ..cell import codeedit, history
from ..kernel import discovery
from ..kernel.fixes import Patcher
from ..probe import construction
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


class DropConvBiasFix(construction.BuiltObjectsFix):
    """Remove each conv's bias (kept, to put back) and fold it into the BatchNorms'
    running_mean, which keeps eval-mode outputs equal: (y + b - m) == (y - (m - b)).

    Train mode needs no fold (the batch mean absorbs the bias), and the fold stays right
    through training: the running-mean update is linear, so `m_fixed = m - b` holds after
    every step. While applied, `state_dict()` presents the model as the user built it (the
    bias at its kept value, running_mean + bias), so checkpoints and the numerics
    comparison see the same parametrization with and without the fix.
    """

    check_id = "conv-bias-bn"
    # float rounding moves when the add goes away: close, not bit-exact. BatchNorm's sums
    # over N·H·W values round differently once the per-channel offset is gone, and a
    # parameter still near zero reads that large: BatchNorm biases after two SGD steps on
    # 32×16×64×64 maps differed by 1e-4 to 4e-4 of their largest value
    tolerance = 1e-3

    def __init__(self, pairs: list[_Pair], built: construction.AtConstruction | None = None):
        super().__init__()
        self.pairs = pairs
        # the pairs the checked code builds: the same fix given to each run's new modules
        self.built = built

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for pair in self.pairs:
            bias = pair.conv.bias
            if bias is None:  # a run that built this conv without one: nothing to drop
                continue
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


def _names(obs: Observation, pairs: list[_Pair]) -> list[str]:
    return [obs.module_path(pair.conv) for pair in pairs]


def _at_construction(
    obs: Observation, pairs: list[_Pair]
) -> tuple[construction.AtConstruction | None, list[str]]:
    """The fix for pairs the checked code builds, given to each run's new convs and
    BatchNorms by where and in which order they are built (`probe/construction`); or the
    paths of the modules no construction key identifies (built outside the checked code)."""
    if not pairs:
        return None, []
    keys = obs.constructed
    objects = [module for pair in pairs for module in (pair.conv, *pair.norms)]
    unkeyed = [obs.module_path(module) for module in objects if id(module) not in keys]
    if unkeyed:
        return None, unkeyed
    layout = [(len(pair.norms), pair.calls) for pair in pairs]

    def make(built: list[Any]) -> DropConvBiasFix:
        modules = iter(built)
        made = []
        for norms, calls in layout:
            conv = next(modules)
            made.append(_Pair(conv, [next(modules) for _ in range(norms)], calls))
        return DropConvBiasFix(made)

    trigger = obs.first_called(objects)
    return (
        construction.AtConstruction(
            obs.workload,
            [keys[id(module)] for module in objects],
            keys[id(trigger)],
            make,
            objects,
        ),
        [],
    )


def _constructor_edits(
    obs: Observation, pairs: list[_Pair]
) -> tuple[str | None, set[str], list[str]]:
    """The checked code with `bias=False` on the constructor call that built each paired
    conv it builds; the module paths that edit covers; and the paths of convs built by
    library code the cell calls (no conv constructor at their site in the checked code).
    A call that also built convs outside the pairs (a loop whose other convs feed no
    BatchNorm) is left alone: the advice names those convs instead."""
    keys = obs.constructed
    paired = {keys[id(pair.conv)] for pair in pairs if id(pair.conv) in keys}
    sites: dict[tuple[int, int | None], set[str]] = {}
    covered: set[str] = set()
    outside: list[str] = []
    for pair in pairs:
        key = keys.get(id(pair.conv))
        if key is None:
            continue
        path, names = obs.module_path(pair.conv), {type(pair.conv).__name__}
        if codeedit.call_at(obs.tree, key.line, names, key.col) is None:
            outside.append(path)
            continue
        same_call = [
            k for k in keys.values() if (k.kind, k.line, k.col) == (key.kind, key.line, key.col)
        ]
        if all(k in paired for k in same_call):
            sites.setdefault((key.line, key.col), set()).update(names)
            covered.add(path)
    if not sites:
        return None, set(), outside
    source = obs.workload.source
    for (line, col), names in sorted(
        sites.items(), key=lambda item: (item[0][0], item[0][1] or 0), reverse=True
    ):

        def bias_off(
            text: str, line: int = line, col: int | None = col, names: set[str] = names
        ) -> str:
            return codeedit.with_keywords(
                text, line, names, {"bias": "False"}, {"bias": BIAS_POSITION}, col
            )

        source, notes = codeedit.edited(source, bias_off)
        if notes:
            return None, set(), outside
    return source, covered, outside


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
        built = [pair for pair in pairs if obs.built_by_cell(pair.conv)]
        kept = [pair for pair in pairs if not obs.built_by_cell(pair.conv)]
        at_construction, unkeyed = _at_construction(obs, built)
        fix = None
        if unkeyed:
            details += (
                f"; not applied live: {', '.join(unkeyed)} "
                f"{'is' if len(unkeyed) == 1 else 'are'} {construction.UNREACHED}"
            )
        else:
            fix = DropConvBiasFix(kept, at_construction).bounded_by(saved_share(obs, pairs))
            fix.seen = obs.places_of(*(pair.conv for pair in kept))
        if built and not unkeyed:
            details += (
                f"; the checked code builds {', '.join(_names(obs, built))} on every run: the "
                "live fix drops their bias as each run builds them"
            )
        fixed_source, in_code, outside = _constructor_edits(obs, built)
        if outside:
            details += (
                f"; {', '.join(outside)} "
                f"{'is' if len(outside) == 1 else 'are'} built by library code the cell "
                "calls, whose constructor is not in the checked code"
            )
        earlier = _earlier_edits(obs, kept)  # the convs the cell builds: edited in it
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
                        + (
                            "; built with bias=False, the convs draw no random numbers "
                            "for a bias, so the layers built after them start from other "
                            "random weights than this run's"
                            if fixed_source is not None
                            else ""
                        )
                    ),
                    code_change=CodeChange(
                        codeedit.unified_diff(obs.workload.source, fixed_source)
                        if fixed_source is not None
                        else "",
                        [
                            f"{path}: {_constructor(pair.conv)}"
                            for path, pair in zip(paths, pairs, strict=True)
                            if path not in edited and path not in in_code
                        ],
                    ),
                ),
                fix,
                fixed_source,
                list(dict.fromkeys(edit for _, edit in earlier)),
            )
        ]
