"""Find the live torch objects a cell can reach, and where they live.

Users keep models, loaders and optimizers in globals, in their own objects, in lists, in
closures and in generators. Checks and the state guard need each object once, with a path
back to where it is bound (so a fix can rebind it there and undo can put it back).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

MAX_DEPTH = 4
IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "open"})
_SKIP_TYPES = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float, bool)


@dataclass(frozen=True)
class Step:
    """One hop from a container to a value: an attribute, a key/index or a closure cell."""

    kind: str  # "name" | "attr" | "item" | "cell" | "local"
    key: Any

    def get(self, parent: Any) -> Any:
        if self.kind == "attr":
            return getattr(parent, self.key)
        if self.kind in ("name", "item"):
            return parent[self.key]
        if self.kind == "cell":
            return parent.__closure__[self.key].cell_contents
        return parent.gi_frame.f_locals[self.key]

    def set(self, parent: Any, value: Any) -> None:
        if self.kind == "attr":
            setattr(parent, self.key, value)
        elif self.kind in ("name", "item"):
            parent[self.key] = value
        elif self.kind == "cell":
            parent.__closure__[self.key].cell_contents = value
        else:
            raise TypeError("a generator's local variable cannot be rebound from outside")

    def label(self) -> str:
        if self.kind == "name":
            return str(self.key)
        if self.kind == "attr":
            return f".{self.key}"
        if self.kind == "item":
            return f"[{self.key!r}]"
        if self.kind == "cell":
            return f"<closure {self.key}>"
        return f"<generator local {self.key}>"


@dataclass(frozen=True)
class Location:
    """A path from the namespace to an object: `trainer.loader`, `models[0]`, …"""

    steps: tuple[Step, ...]

    def parent(self, namespace: dict[str, Any]) -> Any:
        obj: Any = namespace
        for step in self.steps[:-1]:
            obj = step.get(obj)
        return obj

    def get(self, namespace: dict[str, Any]) -> Any:
        return self.steps[-1].get(self.parent(namespace))

    def set(self, namespace: dict[str, Any], value: Any) -> None:
        self.steps[-1].set(self.parent(namespace), value)

    @property
    def rebindable(self) -> bool:
        return self.steps[-1].kind != "local"

    def __str__(self) -> str:
        return "".join(step.label() for step in self.steps)


@dataclass
class Found:
    """A live object and every place it was reached from."""

    obj: Any
    locations: list[Location] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.locations[0]) if self.locations else type(self.obj).__name__


def _is_user_object(value: Any) -> bool:
    module = type(value).__module__ or ""
    root = module.split(".")[0]
    # Classes exec'd without a `__name__` in their globals report module "builtins": they
    # are user classes all the same (real builtins have no instance __dict__ to search).
    return root not in {"torch", "numpy", "IPython", "ipykernel", "ipywidgets"} and (
        hasattr(value, "__dict__")
    )


def _children(value: Any) -> Iterator[tuple[Step, Any]]:
    """The values one hop below `value` worth searching."""
    if isinstance(value, dict):
        for key, item in list(value.items())[:256]:
            yield Step("item", key), item
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value[:256]):
            yield Step("item", index), item
    elif isinstance(value, types.GeneratorType):
        frame = value.gi_frame
        if frame is not None:
            for key, item in frame.f_locals.items():
                yield Step("local", key), item
    elif isinstance(value, (types.FunctionType, types.MethodType)):
        func = value.__func__ if isinstance(value, types.MethodType) else value
        if isinstance(value, types.MethodType):
            yield Step("attr", "__self__"), value.__self__
        for index, cell in enumerate(func.__closure__ or ()):
            try:
                yield Step("cell", index), cell.cell_contents
            except ValueError:  # an empty cell
                continue
    elif isinstance(value, DataLoader):
        yield Step("attr", "dataset"), value.dataset
    elif _is_user_object(value) and not isinstance(value, (torch.nn.Module, torch.Tensor)):
        for key, item in list(vars(value).items())[:256]:
            yield Step("attr", key), item


def walk(namespace: dict[str, Any]) -> dict[int, Found]:
    """Every reachable object (by id) of the kinds the tool cares about, with its locations."""
    found: dict[int, Found] = {}
    seen: set[int] = set()
    frontier: list[tuple[tuple[Step, ...], Any]] = [
        ((Step("name", name),), value)
        for name, value in list(namespace.items())
        if not name.startswith("_") and name not in IPYTHON_NAMES
    ]
    for _depth in range(MAX_DEPTH):
        next_frontier = []
        for path, value in frontier:
            if isinstance(value, _SKIP_TYPES) or value is None:
                continue
            if isinstance(value, TRACKED_TYPES):
                entry = found.setdefault(id(value), Found(value))
                entry.locations.append(Location(path))
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, (torch.nn.Module, torch.Tensor)):
                continue
            for step, child in _children(value):
                next_frontier.append(((*path, step), child))
        frontier = next_frontier
    return found


TRACKED_TYPES: tuple[type, ...] = (
    torch.nn.Module,
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.Tensor,
    DataLoader,
    torch.Generator,
    torch.amp.GradScaler,
)


def of_type(found: dict[int, Found], kind: type) -> list[Found]:
    return [entry for entry in found.values() if isinstance(entry.obj, kind)]


def top_level_modules(found: dict[int, Found]) -> list[Found]:
    """Modules that are not a submodule of another found module (the models)."""
    modules = of_type(found, torch.nn.Module)
    inner = {id(sub) for entry in modules for sub in entry.obj.modules() if sub is not entry.obj}
    return [entry for entry in modules if id(entry.obj) not in inner]
