"""DistributedDataParallel's constructor settings that cost time every step for nothing
(guide, "Distributed optimizations"): `find_unused_parameters=True` on a model whose every
parameter gets a gradient (`ddp-find-unused`), and `gradient_as_bucket_view=False`
(`ddp-bucket-view`).

With `find_unused_parameters=True`, DDP walks the autograd graph from the forward's outputs
on every forward to find the parameters that will get no gradient, so the all-reduce need
not wait for them. The probe records which parameters each synced backward gave a gradient:
when every one got one every time, the walk found nothing; when the same ones went without
every time, the graph is static and `static_graph=True` finds them once. With
`gradient_as_bucket_view=False` each synced backward copies the gradients into DDP's
all-reduce buckets and back, and both copies stay allocated.

Both settings are read when DDP is built, so the live fix builds the wrapper again with the
setting changed and the user's others kept. A DDP the notebook held before the cell is
rebuilt around the same module (the same parameter tensors: the optimizer needs no change)
and rebound where the notebook holds it; undo rebinds the user's own. A DDP the cell builds
(its own `DistributedDataParallel(...)`, Lightning's strategy, the Hugging Face Trainer) gets
the setting at its construction in each run. Either way every rank applies it together:
the wrappers' all-reduces must pair up.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from torch.nn.parallel import DistributedDataParallel

from ..kernel.fixes import Fix, Patcher, expect, patched, replace_held
from ..probe import frameworks
from ..report import BACKWARD, FORWARD, CodeChange
from .base import Detection, size_text
from .distributed import DistributedCheck, model_name

if TYPE_CHECKING:
    from ..cell.history import CallEdit
    from ..kernel.discovery import Location
    from ..probe.observation import Observation, SyncedForwards

# the same sums over the ranks, bucketed another way
SETTINGS_TOLERANCE = 1e-5
# DDP's attributes that hold its constructor arguments, for a rebuild that keeps them (those
# this torch's DDP takes: the last two are recent)
_KEPT_ARGUMENTS = (
    "device_ids",
    "output_device",
    "dim",
    "process_group",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)
_DDP_PARAMETERS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


class DdpSettingsFix(Fix):
    """The DDP model with other constructor `settings`, kept while applied: rebuilt and
    rebound through its `WrapperPlan` (a wrapper from before the cell), or given them when
    the cell builds it (no plan)."""

    tolerance = SETTINGS_TOLERANCE

    def __init__(self, settings: dict[str, Any], plan: WrapperPlan | None):
        super().__init__()
        self.settings, self.plan = settings, plan

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        plan = self.plan
        if plan is not None:
            patcher.call(
                lambda: plan.want(self, self.settings, namespace),
                lambda: plan.drop(self, namespace, patcher.notes),
            )

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        if self.plan is not None:
            return contextlib.nullcontext()
        init = DistributedDataParallel.__init__  # another fix's, when both are applied
        return patched(
            lambda patcher: patcher.setattr(
                DistributedDataParallel, "__init__", _with_settings(init, self.settings)
            )
        )


class WrapperPlan:
    """Which applied fix wants which settings of one user DDP wrapper.

    The wrapper in place is always the one built with the union of the wanted settings (the
    user's own when none), so `ddp-find-unused` and `ddp-bucket-view` compose and undo in
    any order. A rebuilt wrapper is dropped as soon as another takes its place: its reducer
    holds gradient buckets the size of the model's gradients."""

    def __init__(self, original: DistributedDataParallel, locations: list[Location]):
        self.original, self.locations = original, locations
        self.placed = original
        self.wanted: dict[int, dict[str, Any]] = {}

    def want(self, fix: Fix, settings: dict[str, Any], namespace: dict[str, Any]) -> None:
        """Rebind to the wrapper with `fix`'s settings added. Raises `fixes.Rebound`, before
        changing anything, where a place no longer holds the plan's wrapper."""
        for location in self.locations:
            expect(namespace, location, self.placed)
        self.wanted[id(fix)] = settings
        self._place(namespace, [])

    def drop(self, fix: Fix, namespace: dict[str, Any], notes: list[str]) -> None:
        """Rebind to the wrapper without `fix`'s settings, except where the user has bound
        another object since (left there, with a note in `notes`)."""
        self.wanted.pop(id(fix), None)
        self._place(namespace, notes)

    def _place(self, namespace: dict[str, Any], notes: list[str]) -> None:
        merged = {key: value for wanted in self.wanted.values() for key, value in wanted.items()}
        target = rebuild(self.original, merged) if merged else self.original
        for location in self.locations:
            note = replace_held(namespace, location, self.placed, target)
            if note is not None:
                notes.append(note)
        self.placed = target


_PLANS: weakref.WeakValueDictionary[int, WrapperPlan] = weakref.WeakValueDictionary()


def plan_for(model: DistributedDataParallel, locations: list[Location]) -> WrapperPlan:
    """The one plan of this wrapper (shared by its fixes, so their settings merge)."""
    plan = _PLANS.get(id(model))
    if plan is None or plan.original is not model:
        plan = _PLANS[id(model)] = WrapperPlan(model, locations)
    return plan


def rebuild(model: DistributedDataParallel, settings: dict[str, Any]) -> DistributedDataParallel:
    """A new DDP around `model.module` with the user's arguments but `settings`."""
    if getattr(model, "_comm_hooks", None):
        raise ValueError(
            "the model has a communication hook registered, which a rebuilt wrapper would "
            "not have: change the DDP call instead"
        )
    arguments = {
        name: getattr(model, name)
        for name in _KEPT_ARGUMENTS
        if name in _DDP_PARAMETERS and hasattr(model, name)
    }
    arguments["bucket_cap_mb"] = model.bucket_bytes_cap / 2**20
    arguments.update(_buffer_sync(model))
    return DistributedDataParallel(model.module, **{**arguments, **settings})


def _buffer_sync(model: DistributedDataParallel) -> dict[str, Any]:
    """The user's buffer syncing, in the arguments this torch takes without a warning.

    torch 2.13 deprecates `broadcast_buffers` (a FutureWarning on every construction that
    passes it) for `forward_sync_buffers`, which syncs the buffers in each forward only: the
    sync at construction is `init_sync`'s, and it always includes the buffers. A rebuilt
    wrapper needs none: its module is the one the user's wrapper synced when it was built and
    has kept in step since, and a rank-local buffer (`broadcast_buffers=False`) must stay
    this rank's, not become rank 0's."""
    if "forward_sync_buffers" not in _DDP_PARAMETERS:
        return {"broadcast_buffers": model.broadcast_buffers}
    return {"forward_sync_buffers": model.forward_sync_buffers, "init_sync": False}


def _with_settings(init: Callable[..., None], settings: dict[str, Any]) -> Callable[..., None]:
    """DistributedDataParallel.__init__ with `settings` over whatever the caller passed."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def init_with(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.arguments.update(settings)
        init(*bound.args, **bound.kwargs)

    return init_with


class FindUnusedFix(DdpSettingsFix):
    check_id = "ddp-find-unused"


class BucketViewFix(DdpSettingsFix):
    check_id = "ddp-bucket-view"


class _DdpSettingCheck(DistributedCheck):
    """A DDP constructor setting: found per DDP model, fixed by a rebuilt wrapper."""

    fix_class: ClassVar[type[DdpSettingsFix]]
    segment: ClassVar[str]  # the part of the step the setting costs

    def detect(self, obs: Observation) -> list[Detection]:
        found = []
        for synced in obs.ddp_forwards.values():
            if not isinstance(synced.module, DistributedDataParallel) or not synced.unused:
                continue  # no synced backward seen whole: nothing to say
            detection = self._detect_one(obs, synced)
            if detection is not None:
                found.append(detection)
        return found

    def _detect_one(self, obs: Observation, synced: SyncedForwards) -> Detection | None:
        raise NotImplementedError

    def _detection(
        self,
        obs: Observation,
        synced: SyncedForwards,
        settings: dict[str, Any],
        evidence: str,
        details: str,
        caveat: str | None = None,
    ) -> Detection:
        model = synced.module
        name = model_name(obs, model)
        line = min(synced.lines) if synced.lines else None
        fix: Fix | None = None
        change, earlier = _code_change(obs, name, settings)
        if id(model) not in obs.preexisting:
            fix = self.fix_class(settings, None)
        else:
            locations = obs.lasting_locations(model)
            if locations and all(location.rebindable for location in locations):
                fix = self.fix_class(settings, plan_for(model, locations))
            else:
                details += "; not applied live: no notebook name holds the wrapper to rebind"
        return Detection(
            self.finding(
                evidence=evidence,
                details=details,
                segment=self.segment,
                where=f"`{name}`" + (f", cell line {line}" if line else ""),
                fixable=fix is not None,
                line=line,
                caveat=caveat,
                code_change=change,
            ),
            fix,
            earlier=earlier,
        )


def _code_change(
    obs: Observation, name: str, settings: dict[str, Any]
) -> tuple[CodeChange, list[CallEdit]]:
    """The setting in the terms of what builds the wrapper: the Hugging Face Trainer's
    arguments (with the edit of the earlier cell that made them, where found), Lightning's
    DDPStrategy, or the DDP call."""
    keywords = ", ".join(f"{key}={value!r}" for key, value in settings.items())
    hf_names = {"find_unused_parameters": "ddp_find_unused_parameters"}
    if all(key in hf_names for key in settings):
        values = {hf_names[key]: repr(value) for key, value in settings.items()}
        hf = frameworks.args_change(obs.workload, obs.names_before, values, "when train() starts")
        if hf is not None:
            return CodeChange(elsewhere=hf.elsewhere), hf.earlier
    trainer = frameworks.lightning_driver(obs.workload)
    if trainer is not None:
        lines = [
            f"give {trainer} `strategy=DDPStrategy({keywords})` "
            "(`from lightning.pytorch.strategies import DDPStrategy`)"
        ]
    elif frameworks.hf_driver(obs.workload, obs.names_before) is not None:
        lines = [
            "the Hugging Face Trainer builds its DDP through Accelerate, whose "
            f"`DistributedDataParallelKwargs({keywords})` sets it where you drive "
            "Accelerate yourself; TrainingArguments has no setting for it"
        ]
    else:
        lines = [f"build {name} with `DistributedDataParallel(..., {keywords})`"]
    return CodeChange(elsewhere=lines), []


class DdpFindUnusedCheck(_DdpSettingCheck):
    id = "ddp-find-unused"
    fix_class = FindUnusedFix
    segment = FORWARD  # the search runs at the end of each forward
    title = "DDP searches the graph for unused parameters every forward"
    threshold = "`find_unused_parameters=True` and the same parameters unused in every backward"

    def _detect_one(self, obs: Observation, synced: SyncedForwards) -> Detection | None:
        model = synced.module
        if not model.find_unused_parameters or model.static_graph:
            return None
        name = model_name(obs, model)
        seen = len(synced.unused)
        unused = set(synced.unused)
        if len(unused) != 1:
            return None  # other parameters go unused in other steps: the search is needed
        (left,) = unused
        trainable = sum(p.requires_grad for p in model.parameters())
        if not left:
            evidence = (
                f"`{name}` is built with `find_unused_parameters=True`, yet all {trainable} of "
                f"its trainable parameters got a gradient in each of the {seen} synced "
                "backward passes seen"
            )
            details = "the autograd-graph search DDP makes every forward found nothing"
            settings = {"find_unused_parameters": False}
            return self._detection(obs, synced, settings, evidence, details)
        shown = ", ".join(sorted(_plain(n) for n in left)[:3])
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        evidence = (
            f"`{name}` is built with `find_unused_parameters=True` and the same {len(left)} "
            f"of its {trainable} parameters ({shown}{more}) got no gradient in each of the "
            f"{seen} synced backward passes seen"
        )
        details = (
            "a static graph, which `static_graph=True` learns once instead of searching every "
            "forward"
        )
        caveat = (
            "static_graph=True holds only while the same parameters go unused in every step "
            "(no data-dependent branches that skip layers)"
        )
        return self._detection(obs, synced, {"static_graph": True}, evidence, details, caveat)


class DdpBucketViewCheck(_DdpSettingCheck):
    id = "ddp-bucket-view"
    fix_class = BucketViewFix
    segment = BACKWARD  # the copies run as the backward fills the buckets
    title = "DDP copies the gradients into its buckets and back"
    threshold = "`gradient_as_bucket_view=False` with a synced backward"

    def _detect_one(self, obs: Observation, synced: SyncedForwards) -> Detection | None:
        model = synced.module
        if model.gradient_as_bucket_view:
            return None
        name = model_name(obs, model)
        size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        evidence = (
            f"each of the {len(synced.unused)} synced backward passes of `{name}` seen copied "
            f"its {size_text(size)} of gradients into DDP's all-reduce buckets and back"
        )
        details = (
            f"`{name}` is built with `gradient_as_bucket_view=False`, and both copies stay "
            "allocated"
        )
        caveat = (
            "the gradients become views into DDP's buckets: `param.grad.detach_()` and "
            "`requires_grad_()` on them raise (`zero_grad()` and `set_to_none` are fine)"
        )
        settings = {"gradient_as_bucket_view": True}
        return self._detection(obs, synced, settings, evidence, details, caveat)


def _plain(name: str) -> str:
    """`module.0.weight` as the user names it inside the wrapper: `0.weight`."""
    return name.removeprefix("module.")
