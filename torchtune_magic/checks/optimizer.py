"""Optimizers that update parameters one tensor (or one foreach batch) at a time.

Guide (GPU part, and the optimizer docs): Adam/AdamW/SGD take `fused=True`, one kernel for
the whole update instead of a kernel (or a foreach group) per parameter tensor.

The fix rebuilds the optimizer with the same param groups and `fused=True`, loads the
original's state into it, rebinds it wherever the notebook holds it and re-points LR
schedulers at it. Undo carries the state (moments, step counts, learning rates) back into
the original's own tensors and rebinds the original object itself.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ..cell import codeedit, history
from ..kernel.fixes import Fix, Patcher
from ..report import OPTIMIZER, CodeChange, count
from .base import Check, Detection

if TYPE_CHECKING:
    from ..kernel.discovery import Location
    from ..probe.observation import Observation

FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_NOT_CARRIED = ("params", "fused", "foreach")


def rebuild_fused(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer class over the same param groups, with `fused=True`."""
    groups = [
        {k: v for k, v in g.items() if k not in ("fused", "foreach")}
        for g in optimizer.param_groups
    ]
    return type(optimizer)(groups, lr=groups[0]["lr"], fused=True)


def load_fused_state(new: torch.optim.Optimizer, old: torch.optim.Optimizer) -> None:
    """`old`'s state and hyperparameters into `new`, kept fused: the fused kernels want
    float32 step counts on the parameter's device."""
    new.load_state_dict(old.state_dict())
    for group in new.param_groups:
        group["fused"], group["foreach"] = True, None
        for param in group["params"]:
            state = new.state.get(param, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.to(device=param.device, dtype=torch.float32, copy=True)


def carry_back(new: torch.optim.Optimizer, old: torch.optim.Optimizer) -> None:
    """`new`'s state into `old`, written into `old`'s own tensors where it has them."""
    for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
        for key, value in new_group.items():
            if key not in _NOT_CARRIED:
                old_group[key] = value
    for param, state in new.state.items():
        target = old.state[param]
        for key, value in state.items():
            current = target.get(key)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                if current is not value:
                    with torch.no_grad():
                        current.copy_(value)
            elif isinstance(value, torch.Tensor) and key == "step":
                target[key] = value.detach().to("cpu", torch.float32, copy=True)
            else:
                target[key] = value


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """What an LR scheduler installs on its optimizer (so it can warn when `scheduler.step()`
    comes first); a re-pointed scheduler needs it on the new optimizer too."""
    step = type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(optimizer, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


class FusedOptimizerFix(Fix):
    """Swap in the fused rebuild (cached; its state reloaded on every apply)."""

    check_id = "fused-optimizer"
    # one fused kernel sums in another order than the per-tensor path: last-bit differences
    tolerance = 1e-5

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        locations: list[Location],
        schedulers: list[Any],
    ):
        super().__init__()
        self.original = optimizer
        self.locations = locations
        self.schedulers = schedulers
        self._fused: torch.optim.Optimizer | None = None

    def fused(self) -> torch.optim.Optimizer:
        if self._fused is None:
            self._fused = rebuild_fused(self.original)
            if self.schedulers:
                _track_step_called(self._fused)
        return self._fused

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        old, new = self.original, self.fused()
        patcher.call(lambda: load_fused_state(new, old), lambda: carry_back(new, old))
        for location in self.locations:
            patcher.rebind(namespace, location, old, new)
        for scheduler in self.schedulers:
            patcher.setattr(scheduler, "optimizer", new)


class FusedOptimizerCheck(Check):
    id = "fused-optimizer"
    title = "The optimizer updates parameters tensor by tensor instead of in one fused kernel"
    guide = "Use fused optimizers"
    devices = ("cuda",)

    def detect(self, obs: Observation) -> list[Detection]:
        detections = []
        for optimizer, steps in obs.optimizer_steps.values():
            if not isinstance(optimizer, FUSABLE) or not steps:
                continue
            groups = optimizer.param_groups
            params = [p for g in groups for p in g["params"]]
            if any(g.get("fused") or g.get("differentiable") for g in groups):
                continue
            if not params or any(p.device.type != obs.device for p in params):
                continue
            detections.append(self._detection(obs, optimizer, steps, len(params)))
        return detections

    def _detection(
        self, obs: Observation, optimizer: torch.optim.Optimizer, steps: int, n_params: int
    ) -> Detection:
        cls = type(optimizer).__name__
        locations = obs.lasting_locations(optimizer)
        name = str(locations[0]) if locations else cls
        foreach = optimizer.param_groups[0].get("foreach")
        how = "the for-loop (foreach=False)" if foreach is False else "the default foreach"
        evidence = (
            f"{cls} {name} stepped {count(steps, 'time')} with {how} implementation over "
            f"{count(n_params, 'parameter tensor')}"
        )
        details = "fused=True does the whole update in one kernel per dtype"
        source = obs.workload.source
        fixed = source
        fix: Fix | None = None
        elsewhere: list[str] = []
        calls = [c for c in codeedit.calls_named(obs.tree, {cls})]
        if id(optimizer) not in obs.preexisting:
            # built by the cell: each run makes a new one, so the cell text is what changes
            if len(calls) == 1 and not any(k.arg == "foreach" for k in calls[0].keywords):
                line = calls[0].lineno
                fixed, elsewhere = codeedit.edited(
                    source, lambda s: codeedit.with_keywords(s, line, {cls}, {"fused": "True"})
                )
                fix = _SourceFused(line, cls)
            else:
                details += "; not applied live: the cell builds it in a way this tool won't edit"
        elif locations and all(loc.rebindable for loc in locations):
            schedulers = [
                found.obj
                for found in obs.found.values()
                if isinstance(found.obj, torch.optim.lr_scheduler.LRScheduler)
                and found.obj.optimizer is optimizer
            ]
            fix = FusedOptimizerFix(optimizer, locations, schedulers)
            fix.seen = [(loc, optimizer) for loc in locations]
        else:
            details += "; not applied live: no rebindable notebook name reaches it"
        earlier = None
        if id(optimizer) in obs.preexisting:
            earlier = _earlier_edit(obs, locations)
            if earlier is None:
                elsewhere.append(f"{name}: build it with torch.optim.{cls}(..., fused=True)")
        return Detection(
            self.finding(
                evidence=evidence,
                details=details,
                segment=OPTIMIZER,
                where=name,
                fixable=fix is not None,
                caveat=(
                    "the fused kernel rounds in another order (last-bit differences); it "
                    "needs floating-point parameters on one device type"
                ),
                code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
            ),
            fix,
            fixed if fixed != source else None,
            [earlier] if earlier else [],
        )


def _earlier_edit(obs: Observation, locations: list[Location]) -> history.CallEdit | None:
    """`fused=True` on the optimizer's constructor in the earlier cell that built it."""
    for location in locations:
        path = history.location_path(location)
        if path is not None:
            workload = obs.workload
            edit = history.keyword_edit(
                workload.notebook, workload.namespace, path, {"fused": "True"}
            )
            if edit is not None:
                return edit
    return None


class _SourceFused(Fix):
    """An optimizer the cell builds itself: `fused=True` added to its constructor call."""

    check_id = "fused-optimizer"
    tolerance = FusedOptimizerFix.tolerance

    def __init__(self, line: int, cls: str):
        super().__init__()
        self.line = line
        self.cls = cls

    def edit_source(self, source: str) -> str:
        def fused(text: str) -> str:
            return codeedit.with_keywords(text, self.line, {self.cls}, {"fused": "True"})

        return codeedit.edited(source, fused)[0]
