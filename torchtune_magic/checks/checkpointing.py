"""Activation checkpointing for repeated blocks when memory is what limits the run.

Guide: "Use activation checkpointing" (memory part) — instead of keeping every block's
activations for backward, keep only each block's input and recompute the rest during
backward. Peak memory drops by roughly the number of blocks; the cell gets slower (one more
forward per block), so this is a memory fix and is offered only when memory is the
constraint: the user asked (`--memory`) or the peak is a large share of the device's memory.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.checkpoint import checkpoint

from ..cell.history import CallEdit
from ..kernel.fixes import Patcher
from ..kernel.state import available_memory_bytes
from ..probe import construction, frameworks
from ..report import CodeChange
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import Observation

MIN_BLOCKS = 3
DEVICE_SHARE = 0.5  # peak above this share of the device's (free) memory: memory-bound
CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList)


def _checkpointed(forward: Any) -> Any:
    """A forward that checkpoints itself while autograd records (plain call otherwise)."""

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


class CheckpointFix(construction.BuiltObjectsFix):
    """Each block's instance `forward` becomes a checkpointed call of its own forward; undo
    deletes the instance attribute (or puts back one the user had set), unless the user
    has set a `forward` of their own on the block meanwhile."""

    check_id = "activation-checkpointing"
    saves_memory = True
    cuts_memory_on = frozenset({"cpu", "cuda"})

    def __init__(
        self,
        blocks: dict[str, torch.nn.Module],
        built: construction.AtConstruction | None = None,
    ):
        super().__init__()
        self.blocks = blocks  # by module path, e.g. "model.blocks.0"
        # blocks the checked code builds: the same change given to each run's new blocks
        self.built = built

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for path, block in self.blocks.items():
            patcher.assign(block, "forward", _checkpointed(block.forward), f"{path}.forward")


def _is_block(module: torch.nn.Module) -> bool:
    """Worth checkpointing: a composite (has children), not a single built-in layer, and
    not checkpointed already (a Hugging Face layer after `gradient_checkpointing_enable()`
    or the Trainer's `activation_checkpointing=True` carries `gradient_checkpointing`)."""
    return (
        any(True for _ in module.children())
        and getattr(module, "gradient_checkpointing", False) is not True
    )


def repeated_blocks(obs: Observation) -> list[tuple[torch.nn.Module, list[torch.nn.Module]]]:
    """(container, blocks): Sequential/ModuleList children of one type, ≥ MIN_BLOCKS of them,
    that ran with autograd recording. Containers inside an already chosen block are skipped."""
    chosen: list[tuple[torch.nn.Module, list[torch.nn.Module]]] = []
    covered: set[int] = set()
    containers = [u.module for u in obs.modules.values() if isinstance(u.module, CONTAINERS)]
    containers += [
        m
        for use in obs.modules.values()
        for m in use.module.modules()
        if isinstance(m, torch.nn.ModuleList)  # never called itself: its blocks are
    ]
    by_size = sorted({id(c): c for c in containers}.values(), key=lambda c: -len(list(c.modules())))
    for container in by_size:
        if id(container) in covered:
            continue
        children = list(container.children())
        kinds = Counter(type(child) for child in children)
        kind, count = kinds.most_common(1)[0] if kinds else (None, 0)
        blocks = [
            c
            for c in children
            if type(c) is kind
            and _is_block(c)
            and (use := obs.modules.get(id(c))) is not None
            and use.grad_calls
        ]
        if count >= MIN_BLOCKS and len(blocks) >= MIN_BLOCKS:
            chosen.append((container, blocks))
            covered.update(id(m) for block in blocks for m in block.modules())
    return chosen


def _checkpoint_fix(obs: Observation, blocks: list[torch.nn.Module]) -> CheckpointFix | None:
    """The fix for these blocks: on the blocks themselves where they were built before the
    cell (refused later if their model was replaced since the probe), on each run's new
    blocks, as the model holding them is first called, where the checked code builds them;
    None where no construction in the checked code shows how each run makes one of them."""
    paths = [obs.module_path(block) for block in blocks]
    keys = [obs.constructed.get(id(block)) for block in blocks]
    pairs = zip(keys, blocks, strict=True)
    if any(key is None and obs.built_by_cell(block) for key, block in pairs):
        return None
    if not any(keys):
        fix = CheckpointFix(dict(zip(paths, blocks, strict=True)))
        fix.seen = obs.places_of(*blocks)
        return fix
    built = [(path, key) for path, key in zip(paths, keys, strict=True) if key is not None]
    kept = {
        path: block for path, block, key in zip(paths, blocks, keys, strict=True) if key is None
    }
    built_blocks = [block for block, key in zip(blocks, keys, strict=True) if key is not None]
    trigger = obs.constructed[id(obs.first_called(built_blocks))]

    def make(run_blocks: list[Any]) -> CheckpointFix:
        return CheckpointFix(
            {path: block for (path, _), block in zip(built, run_blocks, strict=True)}
        )

    at = construction.AtConstruction(
        obs.workload, [key for _, key in built], trigger, make, built_blocks
    )
    fix = CheckpointFix(kept, at)
    fix.seen = obs.places_of(*kept.values())
    return fix


def _device_memory(obs: Observation) -> tuple[int | None, str]:
    if obs.device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "of the GPU's memory"
    return available_memory_bytes(), "of the host's available memory"


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


class ActivationCheckpointingCheck(Check):
    id = "activation-checkpointing"
    title = "Repeated blocks keep all their activations for backward"
    guide = "Use activation checkpointing"

    def detect(self, obs: Observation) -> list[Detection]:
        if not obs.backward_calls and not obs.out_of_memory:
            return []  # activations are only kept for a backward pass (one it did not reach)
        peak = obs.peak_memory.bytes if obs.peak_memory else None
        device_bytes, device_label = _device_memory(obs)
        share = peak / device_bytes if peak and device_bytes else None
        memory_bound = share is not None and share >= DEVICE_SHARE
        if not (obs.memory_asked or memory_bound):
            return []
        found = repeated_blocks(obs)
        if not found:
            return []
        blocks = [block for _, group in found for block in group]
        groups = ", ".join(
            f"{obs.module_path(container)}: {len(group)} × {type(group[0]).__name__}"
            for container, group in found
        )
        why = "--memory asked" if obs.memory_asked else "memory-bound"
        if obs.out_of_memory:
            why = "out of memory"
        evidence = f"{why}: repeated blocks ran with autograd recording ({groups})"
        if peak is not None:
            evidence += f", peak memory {_mib(peak)}"
            if share is not None:
                evidence += f" ({share:.0%} {device_label})"
        details = None
        first = obs.module_path(found[0][0])
        fix = _checkpoint_fix(obs, blocks)
        if fix is None:
            details = f"not applied live: the blocks are {construction.UNREACHED}"
        elsewhere = [
            f"in the forward that loops over {first}: "
            "x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)"
            " instead of x = block(x)",
        ]
        earlier: list[CallEdit] = []
        owner = frameworks.hf_driver(obs.workload, obs.names_before)
        if owner is not None:  # the Trainer's own switch: it checkpoints its model's layers
            setting = frameworks.checkpointing_argument(owner.trainer.args)
            change = frameworks.args_change(
                obs.workload, obs.names_before, {setting: "True"}, "when train() starts"
            )
            if change is not None:
                elsewhere, earlier = change.elsewhere, change.earlier
            # train() would switch the model's layers to checkpointing for good (nothing in
            # the Trainer switches them back), so the live fix wraps the blocks itself
            details = details or (
                f"live fix: the blocks checkpointed directly ({setting}=True would switch "
                "the model's layers for good, beyond an exact undo)"
            )
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,  # no segment: a memory fix, paid for in time
                    where=", ".join(obs.module_path(c) for c, _ in found),
                    fixable=fix is not None,
                    caveat=(
                        "a memory fix: each block's forward runs again during backward, so "
                        "the cell usually gets slower; compare the peak memory before/after"
                    ),
                    code_change=CodeChange("", elsewhere),
                ),
                fix,
                None,
                earlier,
            )
        ]
