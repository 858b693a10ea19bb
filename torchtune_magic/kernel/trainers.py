"""The Hugging Face Trainers in the namespace, and their own bookkeeping in the snapshot.

`trainer.train()` changes more than tensors on a Trainer made in an earlier cell (its
optimizer, accelerate's prepared objects, flags a stopped run leaves). The state snapshot
(`state`) keeps it so each run starts from the Trainer the user built; the probe's
framework reading (`probe/frameworks.py`) finds the same Trainers, so they are told apart
here, below both.

Frameworks are found by duck typing on their classes, so none of them is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .discovery import Location, Step

HF_MODULES = ("transformers",)
# Objects of these packages hanging off a Hugging Face Trainer hold its per-run bookkeeping
# (the accelerator's prepared models/optimizers/loaders, the callback handler, the control)
HF_STATE_MODULES = ("transformers", "accelerate")


def package_root(cls: type) -> str:
    """The top-level package a class comes from (`transformers`, `lightning`)."""
    return (cls.__module__ or "").split(".")[0]


def is_hf_trainer(value: Any) -> bool:
    """A `transformers.Trainer` or a subclass of it (Seq2SeqTrainer, TRL's trainers, a
    notebook's own `class MyTrainer(Trainer)`), told by its class hierarchy."""
    return any(
        cls.__name__ == "Trainer" and package_root(cls) in HF_MODULES for cls in type(value).__mro__
    )


@dataclass(frozen=True)
class HFTrainer:
    """A Hugging Face Trainer bound to a notebook name, and the places a fix reaches."""

    name: str
    trainer: Any

    @property
    def location(self) -> Location:
        return Location((Step("name", self.name),))

    @property
    def args_location(self) -> Location:
        return Location((Step("name", self.name), Step("attr", "args")))

    @property
    def args_class(self) -> str:
        """`TrainingArguments`, or the subclass the user built (`Seq2SeqTrainingArguments`)."""
        return type(self.trainer.args).__name__

    def call_text(self, values: dict[str, str]) -> str:
        """`TrainingArguments(..., dataloader_num_workers=2)`: the change in its terms."""
        settings = ", ".join(f"{key}={value}" for key, value in values.items())
        return f"{self.args_class}(..., {settings})"


def hf_trainers(namespace: dict[str, Any]) -> list[HFTrainer]:
    """Hugging Face Trainers bound to names in the namespace."""
    return [
        HFTrainer(name, value)
        for name, value in list(namespace.items())
        if not name.startswith("_") and is_hf_trainer(value)
    ]


# the Trainer's own bookkeeping in the state snapshot -----------------------------------------

_MISSING = object()
_NOT_STATE = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.utils.data.DataLoader)


@dataclass
class _Bindings:
    """One object's attribute bindings, and the contents of the lists, dicts and sets
    they held, put back by identity (nothing is copied deeper)."""

    obj: Any
    attributes: dict[str, Any] | None  # None: a process-wide singleton, contents only
    contents: list[tuple[Any, Any]]

    @classmethod
    def of(cls, obj: Any) -> _Bindings:
        attributes = dict(vars(obj))
        contents = [
            (value, value.copy())
            for value in attributes.values()
            if type(value) in (list, dict, set)
        ]
        # accelerate's states share one dict per class (`_shared_state`): process-wide
        # settings that Accelerators made later may reset or fill in, so only the lists
        # they keep per run (GradientState's loader references) are put back
        shared = vars(obj) is getattr(type(obj), "_shared_state", None)
        return cls(obj, None if shared else attributes, contents)

    def restore(self) -> None:
        for container, saved in self.contents:
            if container != saved:
                container.clear()
                if isinstance(container, list):
                    container.extend(saved)
                else:
                    container.update(saved)
        if self.attributes is None:
            return
        current = vars(self.obj)
        for key in [k for k in current if k not in self.attributes]:
            del current[key]
        for key, value in self.attributes.items():
            if current.get(key, _MISSING) is not value:
                current[key] = value


def _state_parts(trainer: Any) -> list[Any]:
    """The Trainer and the objects of its own packages it keeps per-run state in (its
    accelerator and that one's gradient state, callback handler and callbacks, control,
    state, memory tracker); not the model, optimizer or loaders, which the snapshot keeps
    by value, nor its arguments, which fixes swap."""
    parts = [trainer]
    queue = [v for k, v in vars(trainer).items() if k != "args"]
    accelerator = vars(trainer).get("accelerator")
    queue.append(getattr(accelerator, "gradient_state", None))
    queue.extend(getattr(vars(trainer).get("callback_handler"), "callbacks", None) or [])
    seen = {id(trainer)}
    for value in queue:
        if (
            value is None
            or id(value) in seen
            or isinstance(value, _NOT_STATE)
            or package_root(type(value)) not in HF_STATE_MODULES
            or not hasattr(value, "__dict__")
        ):
            continue
        seen.add(id(value))
        parts.append(value)
    return parts


@dataclass
class TrainerState:
    """What `trainer.train()` changes on a Trainer made in an earlier cell, beyond the
    tensors: it creates its optimizer on the first call and keeps it (a second call goes on
    with its moments), accelerate records every prepared model, optimizer and loader (and
    so keeps the loaders' worker processes alive), a run stopped at a step leaves flags
    set. Restoring puts every attribute back as it was, so each measuring run and the
    cell's complete run start from the Trainer the user built."""

    parts: list[_Bindings]

    @classmethod
    def take(cls, namespace: dict[str, Any]) -> TrainerState:
        parts: dict[int, Any] = {}
        for owner in hf_trainers(namespace):
            for part in _state_parts(owner.trainer):
                parts.setdefault(id(part), part)
        return cls([_Bindings.of(part) for part in parts.values()])

    def restore(self) -> None:
        for part in self.parts:
            part.restore()
