"""The guide's distributed part: gradient accumulation under DistributedDataParallel that
all-reduces every micro-batch (`ddp-no-sync`), and ranks that each iterate the whole
dataset (`distributed-sampler`).

Guide ("Distributed optimizations": skip unnecessary all-reduce in backward passes during
gradient accumulation): DDP all-reduces a model's gradients in every backward pass unless
the forward ran under `model.no_sync()`. With k micro-batches per optimizer step, k - 1 of
those all-reduces are wasted: only the sum at the step is used. The right form syncs on the
*last* micro-batch of each step; syncing on the first instead leaves each rank stepping with
its own local gradients for the other k - 1 (ranks drift apart), which is a finding too.

The probe records, for each DDP model, whether each forward with autograd recording would
sync (`require_backward_grad_sync`, what `no_sync()` clears), step by optimizer step. The
live fix keeps the model's own flag off for all but every k-th such forward of a run (its
count starts with the run, as the cell's micro-batches do) and puts it back after.

A DataLoader without a DistributedSampler gives every rank every batch: N ranks do N times
one epoch's work for one epoch's worth of data. The live fix rebinds the loader rebuilt
with a DistributedSampler (the loader checks' plan, so undo puts back the user's own); a
loader the cell builds, anew in every run, gets the sampler in its constructor call in the
cell text, which every run with the fix executes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler

from ..cell import codeedit
from ..kernel.fixes import Fix, Patcher
from ..report import BACKWARD, CodeChange, count
from .base import Check, Detection, size_text
from .loader.edits import class_names
from .loader.rebuild import plan_for
from .loader.target import locate

if TYPE_CHECKING:
    import ast

    from ..probe.observation import LoaderUse, Observation, SyncedForwards
    from .loader.rebuild import LoaderPlan

GUIDE = "Distributed optimizations"
# parameters after each optimizer step agree with the synced run within this: the same sums,
# added in another order
NO_SYNC_TOLERANCE = 1e-4


def _distributed_reason() -> str | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None
    return (
        "not applicable: not a distributed run (torch.distributed is not initialised with "
        "more than one process; run the script under torchrun)"
    )


class SyncLastMicroBatchFix(Fix):
    """`model` all-reduces only in the backward of every `accumulate`-th forward of a run
    (the last micro-batch of each optimizer step), as `no_sync()` on the others would."""

    check_id = "ddp-no-sync"
    tolerance = NO_SYNC_TOLERANCE

    def __init__(self, model: torch.nn.Module, accumulate: int):
        super().__init__()
        self.model, self.accumulate = model, accumulate

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        return self._syncing_last()

    @contextlib.contextmanager
    def _syncing_last(self) -> Iterator[None]:
        model, accumulate = self.model, self.accumulate
        was = model.require_backward_grad_sync
        forwards = 0

        def before_forward(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            nonlocal forwards
            if not torch.is_grad_enabled():
                return
            forwards += 1
            module.require_backward_grad_sync = forwards % accumulate == 0

        handle = model.register_forward_pre_hook(before_forward)
        try:
            yield
        finally:
            handle.remove()
            model.require_backward_grad_sync = was


class DistributedCheck(Check):
    """A check of the guide's distributed part: it applies to a run of several ranks."""

    guide = GUIDE

    def not_applicable(self, obs: Observation) -> str | None:
        return _distributed_reason() or super().not_applicable(obs)


class DdpNoSyncCheck(DistributedCheck):
    id = "ddp-no-sync"
    title = "Gradient accumulation all-reduces on every micro-batch"
    threshold = "two or more backward passes per optimizer step"

    def detect(self, obs: Observation) -> list[Detection]:
        found = []
        for synced in obs.ddp_forwards.values():
            detection = self._detect_one(obs, synced)
            if detection is not None:
                found.append(detection)
        return found

    def _detect_one(self, obs: Observation, synced: SyncedForwards) -> Detection | None:
        steps = synced.steps
        sizes = {len(step) for step in steps}
        if not steps or len(sizes) != 1:
            return None
        (accumulate,) = sizes
        if accumulate < 2:
            return None
        last_only = [False] * (accumulate - 1) + [True]
        if all(step == last_only for step in steps):
            return None  # the right form: the last micro-batch syncs
        name = model_name(obs, synced.module)
        grads = sum(
            p.numel() * p.element_size() for p in synced.module.parameters() if p.requires_grad
        )
        syncs = sum(sum(step) for step in steps)
        line = min(synced.lines) if synced.lines else None
        per_step = syncs / len(steps)
        if all(all(step) for step in steps):
            evidence = (
                f"`{name}` ran {accumulate} forwards with backward per optimizer step and "
                f"all-reduced {size_text(grads)} of gradients after each"
            )
            details = (
                f"{count(syncs, 'all-reduce')} over {count(len(steps), 'optimizer step')}; "
                "only the last of each step is used"
            )
            caveat = None
        else:
            where_synced = sorted({i + 1 for step in steps for i, s in enumerate(step) if s})
            micro = "micro-batch" if len(where_synced) == 1 else "micro-batches"
            evidence = (
                f"`{name}` all-reduced {per_step:g} {'time' if per_step == 1 else 'times'} "
                f"per optimizer step of {accumulate} micro-batches, on {micro} "
                f"{', '.join(map(str, where_synced))} of each, not on the last"
            )
            details = (
                "the gradients of the micro-batches after the sync stay each rank's own, so "
                "the ranks step with different gradients and drift apart"
            )
            caveat = (
                "the fix changes results on purpose: every rank then steps with the "
                "averaged gradients of all its micro-batches"
            )
        return Detection(
            self.finding(
                evidence=evidence,
                details=details,
                segment=BACKWARD,  # DDP all-reduces as the backward fills its buckets
                where=f"`{name}`" + (f", cell line {line}" if line else ""),
                fixable=True,
                line=line,
                caveat=caveat,
                code_change=CodeChange(elsewhere=[_no_sync_form(name, accumulate)]),
            ),
            SyncLastMicroBatchFix(synced.module, accumulate),
        )


def model_name(obs: Observation, module: torch.nn.Module) -> str:
    entry = obs.found.get(id(module))
    return entry.name if entry is not None else type(module).__name__


def _no_sync_form(name: str, accumulate: int) -> str:
    return (
        f"skip the all-reduce on all but the last micro-batch of each optimizer step: "
        f"`sync = (i + 1) % {accumulate} == 0` and "
        f"`with contextlib.nullcontext() if sync else {name}.no_sync():` around the forward "
        "and backward of micro-batch i (Lightning's `accumulate_grad_batches` and "
        "Accelerate's `accumulate()` / the HF Trainer's `gradient_accumulation_steps` do "
        "this already)"
    )


class DistributedSamplerFix(Fix):
    """The loader rebuilt with a DistributedSampler over its dataset (its other settings
    kept), rebound wherever the notebook holds it; undo rebinds the user's own loader. A
    loader the cell builds gets the sampler in its constructor call instead (`cell_edit`,
    no plan): each run with the fix builds it so."""

    check_id = "distributed-sampler"

    def __init__(
        self,
        plan: LoaderPlan | None,
        sampler: DistributedSampler | None,
        cell_edit: Callable[[str], str] | None = None,
    ):
        super().__init__()
        self.plan, self.sampler, self.cell_edit = plan, sampler, cell_edit
        replicas = sampler.num_replicas if sampler else torch.distributed.get_world_size()
        self.steps_share = 1 / replicas

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        plan = self.plan
        if plan is None:
            return
        overrides = {"sampler": self.sampler}
        patcher.call(
            lambda: plan.want(self, overrides, namespace),
            lambda: plan.drop(self, namespace, patcher.notes),
        )

    def edit_source(self, source: str) -> str:
        if self.cell_edit is None:
            return source
        return codeedit.edited(source, self.cell_edit)[0]  # a cell changed past editing


class DistributedSamplerCheck(DistributedCheck):
    id = "distributed-sampler"
    title = "Every rank iterates the whole dataset"
    threshold = "a DataLoader without a DistributedSampler, in a run of two or more ranks"

    def detect(self, obs: Observation) -> list[Detection]:
        world = torch.distributed.get_world_size()
        rank = torch.distributed.get_rank()
        found = []
        for use in obs.loaders.values():
            loader = use.loader
            sampler = loader.sampler
            if isinstance(sampler, DistributedSampler) or isinstance(
                loader.batch_sampler and loader.batch_sampler.sampler, DistributedSampler
            ):
                continue
            if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
                continue  # the dataset or the user's batch sampler splits it, if anything
            target = locate(obs, use)
            shuffle = isinstance(sampler, RandomSampler)
            evidence = (
                f"each of the {world} ranks iterates all {len(loader)} batches of "
                f"{target.name} an epoch"
            )
            details = (
                f"{target.name} has a {type(sampler).__name__}: every rank trains on the same "
                f"data, {world}x the work of one epoch split across the ranks"
            )
            caveat = (
                f"with the fix each rank sees 1/{world} of the dataset an epoch, so results "
                "change by design (and each epoch takes 1/{world} of the steps); with "
                "shuffling, call `sampler.set_epoch(epoch)` at the start of every epoch, or "
                "each epoch repeats the first one's order"
            ).replace("{world}", str(world))
            fix, fixed, reason = None, None, target.unreachable or "not reachable"
            if target.cell_call is not None:  # built by each run: its call in the cell
                fixed, cell_edit, reason = _cell_form(obs, use, target.cell_call, shuffle)
                if cell_edit is not None:
                    fix = DistributedSamplerFix(None, None, cell_edit)
            elif target.unreachable is None and target.locations:
                distributed_sampler = DistributedSampler(
                    loader.dataset, num_replicas=world, rank=rank, shuffle=shuffle
                )
                plan = plan_for(loader, target.locations)
                fix = DistributedSamplerFix(plan, distributed_sampler)
            if fix is None:
                details += f"; not applied live: {reason}"
            source = obs.workload.source
            line = min(use.lines) if use.lines else None
            found.append(
                Detection(
                    self.finding(
                        evidence=evidence,
                        details=details,  # no segment: the fix cuts whole steps
                        where=target.name,
                        fixable=fix is not None,
                        line=line,
                        caveat=caveat,
                        code_change=CodeChange(
                            codeedit.unified_diff(source, fixed) if fixed else "",
                            [] if fixed else [_sampler_form(target.name, shuffle)],
                        ),
                    ),
                    fix,
                    fixed,
                )
            )
        return found


def _cell_form(
    obs: Observation, use: LoaderUse, call: ast.Call, shuffle: bool
) -> tuple[str | None, Callable[[str], str] | None, str]:
    """The cell with the loader's constructor call given
    `sampler=torch.utils.data.DistributedSampler(dataset, shuffle=…)` (in the place of its
    `shuffle=`, which a sampler excludes), and the edit making it; (None, None, why not)
    where the cell cannot say it."""
    dataset = call.args[0] if call.args else None
    dataset = next((k.value for k in call.keywords if k.arg == "dataset"), dataset)
    name = codeedit.dotted_name(dataset) if dataset is not None else ""
    if not name:
        return (
            None,
            None,
            (
                "the dataset is made inside the DataLoader call, so the sampler has no name for "
                "it: bind it to a name first"
            ),
        )
    if len(call.args) > 2 or any(k.arg is None for k in call.keywords):
        return None, None, "the call gives shuffle or a sampler by position or by **kwargs"
    line, names = call.lineno, class_names(use.loader)
    sampler = f"torch.utils.data.DistributedSampler({name}, shuffle={shuffle})"

    def cell_edit(text: str) -> str:
        return codeedit.with_keyword_renamed(text, line, names, "shuffle", "sampler", sampler)

    fixed, notes = codeedit.edited(obs.workload.source, cell_edit)
    if notes:
        return None, None, notes[0]
    if obs.workload.namespace.get("torch") is not torch:
        return fixed, None, "`torch` is not the torch module in the cell's namespace"
    return fixed, cell_edit, ""


def _sampler_form(name: str, shuffle: bool) -> str:
    return (
        f"build {name} with `sampler=DistributedSampler(dataset, shuffle={shuffle})` (and "
        "no `shuffle=`), and call `sampler.set_epoch(epoch)` before each epoch (Lightning "
        "adds it itself unless `use_distributed_sampler=False`; Accelerate's `prepare()` "
        "and the HF Trainer shard the loader themselves)"
    )
