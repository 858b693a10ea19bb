"""What a training framework knows about a run that the cell's own code does not show.

`trainer.fit(model, loader)` or `trainer.train()` is one line: the epochs and batches it will
run live in the framework's settings, the DataLoader it iterates is built inside it, and
its permanent settings are keyword arguments of an object made in an earlier cell. This
module reads those settings for the step count, names the framework object that owns a
loader, phrases a fix as the framework's own argument, swaps a Hugging Face Trainer's
arguments reversibly. The Trainer's own bookkeeping in the state snapshot is
`kernel/trainers.py`'s.

Frameworks are found by duck typing on their classes, so none of them is imported here.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..cell import codeedit, history
from ..kernel import fixes
from ..kernel.trainers import HFTrainer, hf_trainers, package_root

if TYPE_CHECKING:
    from ..cell.workload import Workload
    from ..kernel.fixes import Fix

LIGHTNING_MODULES = ("lightning", "pytorch_lightning")
# Trainer methods that build a DataLoader from `self.args` on every call
HF_RUN_METHODS = frozenset({"train", "evaluate", "predict"})
LIGHTNING_RUN_METHODS = frozenset({"fit", "validate", "test", "predict"})


def lightning_trainers(namespace: dict[str, Any]) -> list[Any]:
    """PyTorch Lightning `Trainer` objects bound to names in the namespace."""
    found = []
    for name, value in namespace.items():
        cls = type(value)
        if (
            not name.startswith("_")
            and package_root(cls) in LIGHTNING_MODULES
            and cls.__name__ == "Trainer"
        ):
            found.append(value)
    return found


def lightning_driver(workload: Workload) -> str | None:
    """The name of the Lightning Trainer the cell runs (`trainer.fit(...)`, `.validate`,
    `.test`, `.predict`), built before the cell or by it; None when it runs none."""
    trainers = {id(t) for t in lightning_trainers(workload.namespace)}
    for node in ast.walk(workload.tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        target = node.func.value
        if (
            node.func.attr in LIGHTNING_RUN_METHODS
            and isinstance(target, ast.Name)
            and id(workload.namespace.get(target.id)) in trainers
        ):
            return target.id
    return None


def lightning_total_batches(trainer: Any) -> tuple[int, str] | None:
    """Training batches one `fit` will draw, known once the fit has set its loop up, with
    how it was worked out; None before that, or when the run is bounded by time or early
    stopping rather than by epochs and steps."""
    per_epoch = getattr(trainer, "num_training_batches", math.inf)
    epochs = getattr(trainer, "max_epochs", None)
    if not isinstance(per_epoch, int) or not isinstance(epochs, int) or epochs < 1:
        return None
    total = epochs * per_epoch
    detail = f"Lightning Trainer: max_epochs={epochs} x {per_epoch} training batches"
    max_steps = getattr(trainer, "max_steps", -1)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1) or 1
    if isinstance(max_steps, int) and 0 < max_steps * accumulate < total:
        total = max_steps * accumulate
        detail = f"Lightning Trainer: max_steps={max_steps} x {accumulate} batches per step"
    return total, detail


def total_batches(namespace: dict[str, Any], loader: Any) -> tuple[int, str] | None:
    """Batches one run of the cell draws from `loader` according to the framework that
    iterates it (a Hugging Face Trainer training on its dataset, a Lightning Trainer), with
    how it was worked out; None when no framework tells."""
    for owner in hf_trainers(namespace):
        if owner.trainer.train_dataset is getattr(loader, "dataset", None):
            known = hf_total_batches(owner.trainer, loader)
            if known is not None:
                return known
    for trainer in lightning_trainers(namespace):
        known = lightning_total_batches(trainer)
        if known is not None:
            return known
    return None


# Hugging Face Trainer ----------------------------------------------------------------------


def _datasets(trainer: Any) -> list[Any]:
    """The datasets a Trainer builds loaders over: training, evaluation (one or a dict)."""
    found = [getattr(trainer, "train_dataset", None)]
    evaluation = getattr(trainer, "eval_dataset", None)
    found.extend(evaluation.values() if isinstance(evaluation, dict) else [evaluation])
    return [dataset for dataset in found if dataset is not None]


def hf_owner(
    namespace: dict[str, Any], names_before: frozenset[str], loader: Any
) -> HFTrainer | None:
    """The Trainer (bound before the cell ran) that built `loader` from its arguments: its
    training or evaluation dataset is the loader's own. With several, the one the cell
    calls wins."""
    dataset = getattr(loader, "dataset", None)
    owners = [
        owner
        for owner in hf_trainers(namespace)
        if owner.name in names_before and any(d is dataset for d in _datasets(owner.trainer))
    ]
    return owners[0] if owners else None


def hf_driver(workload: Workload, names_before: frozenset[str]) -> HFTrainer | None:
    """The Hugging Face Trainer the cell runs (`trainer.train()`, `.evaluate()`,
    `.predict()` on a name bound before the cell), or None."""
    owners = {owner.name: owner for owner in hf_trainers(workload.namespace)}
    for node in ast.walk(workload.tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        target = node.func.value
        if node.func.attr in HF_RUN_METHODS and isinstance(target, ast.Name):
            owner = owners.get(target.id)
            if owner is not None and owner.name in names_before:
                return owner
    return None


def hf_total_batches(trainer: Any, loader: Any) -> tuple[int, str] | None:
    """Batches `trainer.train()` draws from its training loader `loader`, from its
    arguments as the Trainer works them out: optimizer steps = `max_steps`, else
    `num_train_epochs` x steps per epoch (a step takes `gradient_accumulation_steps`
    batches, the last of an epoch what is left); training stops after the last step.
    accelerate's loader draws one batch ahead, so an epoch stopped part-way has drawn one
    more batch than it trained on."""
    args = getattr(trainer, "args", None)
    try:
        per_epoch = len(loader)
    except TypeError:  # an IterableDataset's loader
        return None
    accumulate = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
    max_steps = getattr(args, "max_steps", -1)
    epochs = getattr(args, "num_train_epochs", 0)
    if per_epoch < 1:
        return None
    steps_per_epoch = math.ceil(per_epoch / accumulate)
    if isinstance(max_steps, int) and max_steps > 0:
        updates = max_steps
        detail = f"max_steps={max_steps} x {accumulate} batches per step"
    elif isinstance(epochs, (int, float)) and epochs > 0:
        updates = math.ceil(epochs * steps_per_epoch)
        detail = f"num_train_epochs={epochs:g} x {per_epoch} batches"
    else:
        return None
    full, rest = divmod(updates, steps_per_epoch)
    total = full * per_epoch + (min(per_epoch, rest * accumulate + 1) if rest else 0)
    if accumulate > 1 and not (isinstance(max_steps, int) and max_steps > 0):
        detail += f" (gradient_accumulation_steps={accumulate})"
    if rest:
        detail += (
            f", {per_epoch} batches per epoch, stopping after optimizer step {updates} "
            "part-way through an epoch (one batch drawn ahead)"
        )
    return total, f"Hugging Face Trainer: {detail}"


def checkpointing_argument(args: Any) -> str:
    """The argument that turns activation checkpointing on: `activation_checkpointing` in
    the transformers releases that renamed it, `gradient_checkpointing` before."""
    names = {f.name for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else set()
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )


def args_edit(
    workload: Workload, owner: HFTrainer, values: dict[str, str]
) -> history.CallEdit | None:
    """The edit giving `values` to the `TrainingArguments(...)` call that built the
    trainer's arguments in an earlier cell: bound to a name of its own
    (`args = TrainingArguments(...)`), or written inside `Trainer(..., args=...)`."""
    namespace, notebook = workload.namespace, workload.notebook
    args = owner.trainer.args
    for name in [n for n, v in list(namespace.items()) if v is args and not n.startswith("_")]:
        edit = history.keyword_edit(notebook, namespace, [name], values)
        if edit is not None:
            return edit
    built = history.keyword_edit(notebook, namespace, [owner.name], {})
    if built is None or notebook is None or notebook.inputs is None:
        return None
    tree = ast.parse(notebook.inputs.cell(built.execution_count)[1])
    call = next(
        (
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and node.lineno == built.line
            and node.col_offset == built.col
        ),
        None,
    )
    if call is None:
        return None
    given = [k.value for k in call.keywords if k.arg == "args"] + call.args[1:2]
    inner = given[0] if given else None
    if not isinstance(inner, ast.Call):
        return None
    if codeedit.dotted_name(inner.func).rsplit(".", 1)[-1] != type(args).__name__:
        return None
    return history.CallEdit(
        built.execution_count,
        inner.lineno,
        inner.col_offset,
        type(args).__name__,
        tuple(values.items()),
    )


@dataclass
class ArgsChange:
    """A setting of the Trainer the cell runs, as the permanent change: the edit of the
    earlier cell's `TrainingArguments(...)` call where it can be found, else a line saying
    what to set."""

    owner: HFTrainer
    elsewhere: list[str]
    earlier: list[history.CallEdit]


def args_change(
    workload: Workload, names_before: frozenset[str], values: dict[str, str], when: str
) -> ArgsChange | None:
    """`values` as a change of the arguments of the Hugging Face Trainer the cell runs
    (None when it runs none). `when` says when the Trainer reads them ("when it is built"):
    a setting read in `Trainer.__init__` needs the Trainer made again."""
    owner = hf_driver(workload, names_before)
    if owner is None:
        return None
    edit = args_edit(workload, owner, values)
    text = f"{owner.name}'s arguments: {owner.call_text(values)} (read {when})"
    return ArgsChange(owner, [] if edit else [text], [edit] if edit else [])


class ArgsPlan:
    """The copies of one Trainer's arguments that its applied fixes want, merged.

    The Trainer reads `self.args` whenever it builds a DataLoader (each `train()`,
    `evaluate()`), so a fix swaps `trainer.args` for a copy with its settings. Several
    fixes (workers, pinned memory) change the same object: the plan puts the copy with the
    union of the wanted settings in place (the user's own arguments when none), so they
    compose and undo in any order, and undo puts back the very object the user built.
    """

    def __init__(self, owner: HFTrainer):
        self.owner = owner
        self.original = owner.trainer.args
        self.copies: dict[tuple[tuple[str, Any], ...], Any] = {}
        self.wanted: dict[int, dict[str, Any]] = {}

    def args_for(self, overrides: dict[str, Any]) -> Any:
        if not overrides:
            return self.original
        key = tuple(sorted(overrides.items()))
        if key not in self.copies:
            self.copies[key] = _args_with(self.original, overrides)
        return self.copies[key]

    def _current(self) -> Any:
        merged: dict[str, Any] = {}
        for overrides in self.wanted.values():
            merged.update(overrides)
        return self.args_for(merged)

    def want(self, fix: Fix, overrides: dict[str, Any], namespace: dict[str, Any]) -> None:
        """Put the arguments with `fix`'s settings added in place. Raises `fixes.Rebound`,
        before changing anything, when `trainer.args` no longer holds what the plan put
        there (the user assigned arguments of their own since the probe ran)."""
        current = self._current()
        fixes.expect(namespace, self.owner.args_location, current)
        self.wanted[id(fix)] = overrides
        self.owner.args_location.set(namespace, self._current())

    def drop(self, fix: Fix, namespace: dict[str, Any], notes: list[str]) -> None:
        """Put the arguments without `fix`'s settings in place, except where the user has
        assigned others since (left there, with a note in `notes`)."""
        current = self._current()
        self.wanted.pop(id(fix), None)
        note = fixes.replace_held(namespace, self.owner.args_location, current, self._current())
        if note is not None:
            notes.append(note)


def _args_with(args: Any, overrides: dict[str, Any]) -> Any:
    """A shallow copy of the arguments with `overrides` set. Not `dataclasses.replace`: that
    runs `__post_init__` again, which sets up devices afresh and so resets accelerate's
    process-wide state under the Accelerator the Trainer already holds (its next
    `prepare` fails); the copy keeps the device setup the original made."""
    names = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"{type(args).__name__} has no argument {', '.join(unknown)}")
    copied = copy.copy(args)
    vars(copied).update(overrides)
    return copied


_ARGS_PLANS: dict[int, ArgsPlan] = {}


def args_plan(owner: HFTrainer) -> ArgsPlan:
    """The one plan of this Trainer's arguments (shared by its fixes, so they merge)."""
    plan = _ARGS_PLANS.get(id(owner.trainer))
    if (
        plan is None
        or plan.owner.trainer is not owner.trainer
        or plan.original is not owner.trainer.args
    ):
        plan = _ARGS_PLANS[id(owner.trainer)] = ArgsPlan(owner)
    return plan
