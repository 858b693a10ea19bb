"""The bounded walk of a namespace for its plain Python state.

Breadth first from the names the cell reads, it takes each object once: a container part
(`pyparts`) for what it holds, a one-way marker (`one_way`) for what no restore can put
back, and the torch objects it finds are handed to the state guard. It stops at its bounds
(objects, references, bytes, seconds) and names what it left out.
"""

from __future__ import annotations

import array
import collections
import functools
import io
import socket
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import one_way
from .pyparts import (
    ABSENT,
    RNG_TYPES,
    AttributesPart,
    BufferPart,
    CellsPart,
    ClassAttributesPart,
    DequePart,
    DictPart,
    ListPart,
    MemoryFilePart,
    NDArrayPart,
    Part,
    RefPath,
    SetPart,
    SlotsPart,
    cell_value,
    memory_file_size,
    path_label,
    plain_name,
    random_part,
    slot_value,
)

try:  # numpy is optional: torch works without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    np = None

# Packages whose objects are not walked: torch's are kept by the state guard's own rules,
# the frameworks' by `frameworks.py`, IPython's and ours are not the user's state, and the
# standard library's machinery (threads, loggers, I/O) holds OS resources whose Python
# attributes must not be put back under them.
SKIPPED_PACKAGES = frozenset(
    {
        "torch", "numpy", "IPython", "ipykernel", "ipywidgets", "traitlets", "comm",
        "anywidget", "zmq", "jupyter_client", "tornado", "torchtune_magic", "lightning",
        "pytorch_lightning", "lightning_fabric", "transformers", "accelerate", "threading",
        "multiprocessing", "concurrent", "asyncio", "logging", "socket", "ssl", "selectors",
        "subprocess", "_io", "io", "_thread", "queue", "weakref", "_weakrefset",
    }
)  # fmt: skip
# Types whose values hold nothing to restore and nothing to walk into.
ATOMIC: frozenset[type] = frozenset(
    {
        str, bytes, int, float, complex, bool, type(None), range, slice, type(...),
        type(NotImplemented), types.CodeType, types.BuiltinFunctionType, types.ModuleType,
        types.WrapperDescriptorType, types.MethodWrapperType, types.MethodDescriptorType,
        types.GetSetDescriptorType, types.MemberDescriptorType, property, torch.dtype,
        torch.device, torch.Size, memoryview,
    }
)  # fmt: skip
# A class statement makes a heap type that is not immutable; C types are static, or heap
# types made immutable (`_csv.reader`, `functools.partial` in 3.11).
_HEAPTYPE, _IMMUTABLETYPE = 1 << 9, 1 << 8  # Py_TPFLAGS_*


@dataclass(frozen=True)
class Bounds:
    """How much a snapshot may take; what lies past a bound is named, not copied."""

    objects: int = 50_000  # objects visited
    references: int = 2_000_000  # references copied, all containers together
    nbytes: int | None = None  # bytes of numpy arrays and tensors copied (None: unbounded)
    seconds: float = 0.5  # wall time of the walk


# --- the walk ------------------------------------------------------------------------------


def _root(cls: type) -> str:
    return (getattr(cls, "__module__", None) or "").split(".")[0]


def is_python_class(cls: type) -> bool:
    return cls.__flags__ & (_HEAPTYPE | _IMMUTABLETYPE) == _HEAPTYPE


def _slot_descriptors(cls: type) -> list[Any]:
    """The descriptors of the `__slots__` Python classes in `cls`'s MRO declare (not a C
    type's members, which are often read-only)."""
    found = []
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__")
        if declared is None or not is_python_class(klass):
            continue
        for name in [declared] if isinstance(declared, str) else list(declared):
            if name.startswith("__") and not name.endswith("__"):  # private: name-mangled
                name = f"_{klass.__name__.lstrip('_')}{name}"
            descriptor = vars(klass).get(name)
            if isinstance(descriptor, types.MemberDescriptorType):
                found.append(descriptor)
    return found


def _instance_dict(obj: Any) -> dict[str, Any] | None:
    try:
        found = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return found if type(found) is dict else None


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor) or (np is not None and isinstance(obj, np.ndarray)):
        kind = "a tensor" if isinstance(obj, torch.Tensor) else "a numpy array"
        return f"{kind} of {_bytes_text(_nbytes(obj))}"
    try:
        return f"a {type(obj).__name__} of {len(obj):,} items"
    except TypeError:
        return f"a {type(obj).__name__}"


def _bytes_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.1f} GiB"


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        try:
            grad = obj.grad if obj.is_leaf else None
            return obj.nbytes + (grad.nbytes if grad is not None else 0)
        except (RuntimeError, NotImplementedError):
            return 0
    return int(obj.nbytes)


class Walk:
    """One bounded walk of a namespace; collects the parts, markers and torch objects."""

    def __init__(self, namespace: dict[str, Any], bounds: Bounds, known: set[int]):
        self.namespace = namespace
        self.bounds = bounds
        self.known = known  # tensors the state guard keeps already
        self.module_name = namespace.get("__name__", "builtins")
        self.parts: list[Part] = []
        self.markers: list[one_way.Marker] = []
        self.tensors: list[torch.Tensor] = []
        self.modules: list[torch.nn.Module] = []
        self.generators: list[torch.Generator] = []
        self.not_covered: list[str] = []
        self.seen: set[int] = set()
        self.slots: dict[type, list[Any]] = {}  # `_slot_descriptors`, once per class
        self.objects = self.references = self.nbytes = 0
        self.stopped: str | None = None  # the bound that stopped the walk
        self.deadline = time.perf_counter() + bounds.seconds

    def out_of_bounds(self) -> str | None:
        if self.objects >= self.bounds.objects:
            return f"its bound of {self.bounds.objects:,} objects"
        if time.perf_counter() > self.deadline:
            return f"its bound of {self.bounds.seconds:g} s"
        return None

    def walk(self, names: list[str], watched: set[str]) -> list[str]:
        """Walk what `names` reach, breadth first: every name's own container is taken
        before what it holds, so a big dataset the cell reads cannot use up the bounds
        before the small `lossi` next to it. The names whose objects a bound stopped it
        short of, if it did (`stopped` says which bound)."""
        queue = collections.deque((self.namespace[n], (None, n, "name"), n) for n in names)
        while queue:
            obj, path, root = queue.popleft()
            if id(obj) in self.seen:
                continue
            self.stopped = self.out_of_bounds()
            if self.stopped is not None:
                queue.appendleft((obj, path, root))
                return list(dict.fromkeys(root for _, _, root in queue))
            self.seen.add(id(obj))
            self.objects += 1
            try:
                children = self.visit(obj, path, root in watched)
            except Exception as error:  # a library object that cannot be read as it claims
                self.not_covered.append(
                    f"`{path_label(path)}` (a {type(obj).__name__}) was not snapshotted: reading "
                    f"it raised {type(error).__name__}: {error}"
                )
                continue
            queue.extend((child, at, root) for child, at in children)
        return []

    def fits(self, obj: Any, path: RefPath, references: int = 0, nbytes: int = 0) -> bool:
        """Count a copy against the bounds; one that does not fit is named instead."""
        bounds = self.bounds
        if self.references + references > bounds.references:
            bound = f"the bound of {bounds.references:,} references copied"
        elif bounds.nbytes is not None and self.nbytes + nbytes > bounds.nbytes:
            bound = f"the {_bytes_text(bounds.nbytes)} share of free memory for copies"
        else:
            self.references += references
            self.nbytes += nbytes
            return True
        self.not_covered.append(
            f"`{path_label(path)}` ({_describe(obj)}) was not snapshotted: copying it would pass "
            f"{bound}, so what the measuring runs change in it stays changed"
        )
        return False

    def visit(self, obj: Any, path: RefPath, watched: bool) -> Iterable[tuple[Any, RefPath]]:
        """Snapshot one object (or mark it, or hand it to the state guard); its children."""
        cls = type(obj)
        if issubclass(cls, torch.Tensor):
            self.tensor(obj, path)
        elif issubclass(cls, torch.Generator):
            self.generators.append(obj)
        elif issubclass(cls, torch.nn.Module):
            return self.module(obj, path)
        elif issubclass(cls, (types.GeneratorType, _BaseDataLoaderIter)):
            if watched:
                what = (
                    "a generator"
                    if issubclass(cls, types.GeneratorType)
                    else "a DataLoader iterator"
                )
                self.markers.append(one_way.advancing(obj, path_label(path), what))
        elif issubclass(cls, (io.BytesIO, io.StringIO)):
            if not obj.closed and self.fits(obj, path, nbytes=memory_file_size(obj)):
                self.parts.append(MemoryFilePart(obj, obj.__getstate__(), path))
        elif issubclass(cls, io.IOBase):
            if watched:
                self.markers.append(one_way.File.of(obj, path_label(path)))
        elif issubclass(cls, socket.socket):
            if watched and obj.fileno() != -1:
                self.markers.append(one_way.Socket(path_label(path)))
        elif np is not None and issubclass(cls, np.ndarray):
            return self.ndarray(obj, path)
        elif issubclass(cls, RNG_TYPES):
            part = random_part(obj, path)
            if part is not None:
                self.parts.append(part)
        elif _root(cls) not in SKIPPED_PACKAGES:
            children = self.contents(obj, cls, path, watched)
            if is_python_class(cls):  # a user's object (or container subclass): attributes
                return [*children, *self.attributes(obj, cls, path)]
            return children
        return ()

    def tensor(self, tensor: torch.Tensor, path: RefPath) -> None:
        if id(tensor) in self.known:
            return
        self.known.add(id(tensor))
        if self.fits(tensor, path, nbytes=_nbytes(tensor)):
            self.tensors.append(tensor)

    def module(self, module: torch.nn.Module, path: RefPath) -> list[tuple[Any, RefPath]]:
        """A module's submodules, parameters and buffers (through torch's public API), and
        the plain attributes of those whose class is not torch's own."""
        children = []
        for name, sub in module.named_modules():
            if sub is not module and id(sub) in self.seen:
                continue
            self.seen.add(id(sub))
            self.modules.append(sub)
            at = (path, name, "attr") if name else path
            for key, tensor in [
                *sub.named_parameters(recurse=False),
                *sub.named_buffers(recurse=False),
            ]:
                self.tensor(tensor, (at, key, "attr"))
            if _root(type(sub)) in SKIPPED_PACKAGES:
                continue
            saved = {k: v for k, v in vars(sub).items() if plain_name(k)}
            if self.fits(sub, at, references=len(saved)):
                self.parts.append(AttributesPart(sub, saved, at, plain_only=True))
                children.extend(((v, (at, k, "attr")) for k, v in saved.items()))
            children.extend(self.of_class(type(sub)))
        return children

    def ndarray(self, array_: Any, path: RefPath) -> list[tuple[Any, RefPath]]:
        if not array_.flags.writeable or not self.fits(array_, path, nbytes=array_.nbytes):
            return []
        self.parts.append(NDArrayPart(array_, array_.copy(order="K"), path))
        if array_.dtype != object or not self.fits(array_, path, references=array_.size):
            return []
        return self.items(list(array_.flat), path)

    def contents(
        self, obj: Any, cls: type, path: RefPath, watched: bool
    ) -> Iterable[tuple[Any, RefPath]]:
        """The part for a container, function or class, and what it holds."""
        if issubclass(cls, list):
            if self.fits(obj, path, references=list.__len__(obj)):
                part = ListPart(obj, list.copy(obj), path)
                self.parts.append(part)
                return self.items(part.items, path)
        elif issubclass(cls, (tuple, frozenset)):
            return self.items(obj, path)
        elif issubclass(cls, dict):
            # the namespace's bindings are the state guard's
            if obj is not self.namespace and self.fits(obj, path, references=2 * len(obj)):
                part = DictPart.of(obj, path)
                self.parts.append(part)
                keys = [(k, (path, k, "item")) for k in part.saved if type(k) not in ATOMIC]
                return [*keys, *self.items(part.saved.values(), path, part.saved)]
        elif issubclass(cls, set):
            if self.fits(obj, path, references=set.__len__(obj)):
                part = SetPart(obj, set.copy(obj), path)
                self.parts.append(part)
                return self.items(part.saved, path)
        elif issubclass(cls, collections.deque):
            if self.fits(obj, path, references=len(obj)):
                part = DequePart(obj, list(collections.deque.__iter__(obj)), path)
                self.parts.append(part)
                return self.items(part.items, path)
        elif issubclass(cls, (bytearray, array.array)):
            if self.fits(obj, path, nbytes=len(obj) * getattr(obj, "itemsize", 1)):
                copy = (
                    bytearray(obj) if issubclass(cls, bytearray) else array.array(obj.typecode, obj)
                )
                self.parts.append(BufferPart(obj, copy, path))
        elif issubclass(cls, types.FunctionType):
            return self.function(obj, path)
        elif issubclass(cls, types.MethodType):
            return [(obj.__self__, (path, "__self__", "attr")), (obj.__func__, path)]
        elif issubclass(cls, (staticmethod, classmethod)):
            return [(obj.__func__, path)]
        elif issubclass(cls, functools.partial):
            return [(obj.func, path), *self.items(obj.args, path), (obj.keywords, path)]
        elif issubclass(cls, type):
            return self.class_attributes(obj, path)
        elif watched and not is_python_class(cls) and one_way.advances(obj):
            self.markers.append(one_way.advancing(obj, path_label(path), "an iterator"))
        return ()

    def items(
        self, values: Iterable[Any], path: RefPath, keys: Iterable[Any] | None = None
    ) -> list[tuple[Any, RefPath]]:
        values = values if isinstance(values, (list, tuple)) else list(values)
        if ATOMIC.issuperset(map(type, values)):  # a list of words or numbers: nothing below
            return []
        keys = range(len(values)) if keys is None else keys
        return [
            (v, (path, k, "item"))
            for k, v in zip(keys, values, strict=True)
            if type(v) not in ATOMIC
        ]

    def attributes(self, obj: Any, cls: type, path: RefPath) -> list[tuple[Any, RefPath]]:
        children = []
        found = _instance_dict(obj)
        if found is not None and self.fits(obj, path, references=len(found)):
            saved = dict.copy(found)
            self.parts.append(AttributesPart(obj, saved, path))
            children = [(v, (path, k, "attr")) for k, v in saved.items() if type(v) not in ATOMIC]
        descriptors = self.slots.get(cls)
        if descriptors is None:
            descriptors = self.slots[cls] = _slot_descriptors(cls)
        if descriptors and self.fits(obj, path, references=len(descriptors)):
            slots = [(d, slot_value(d, obj)) for d in descriptors]
            self.parts.append(SlotsPart(obj, slots, path))
            children.extend((v, (path, d.__name__, "attr")) for d, v in slots if v is not ABSENT)
        return [*children, *self.of_class(cls)]

    def of_class(self, cls: type) -> list[tuple[Any, RefPath]]:
        """An instance's notebook class, to walk (its class-level counters) in turn."""
        return [(cls, (None, cls.__qualname__, "name"))] if self.notebook_class(cls) else []

    def notebook_class(self, cls: type) -> bool:
        return is_python_class(cls) and cls.__module__ == self.module_name

    def function(self, func: types.FunctionType, path: RefPath) -> list[tuple[Any, RefPath]]:
        """A notebook function's closure cells and attributes, and what its defaults hold;
        library functions are left alone."""
        if func.__globals__ is not self.namespace:
            return []
        cells = [(cell, cell_value(cell)) for cell in func.__closure__ or ()]
        if cells:
            self.parts.append(CellsPart(cells, path))
        children = [(v, (path, f"<closure {i}>", "name")) for i, (_, v) in enumerate(cells)]
        children = [(v, p) for v, p in children if v is not ABSENT]
        for extra in (func.__defaults__, func.__kwdefaults__):
            if extra is not None:
                children.append((extra, path))
        return [*children, *self.attributes(func, type(func), path)]

    def class_attributes(self, cls: type, path: RefPath) -> list[tuple[Any, RefPath]]:
        if not self.notebook_class(cls) or not self.fits(cls, path, references=len(vars(cls))):
            return []
        saved = dict(vars(cls))
        self.parts.append(ClassAttributesPart(cls, saved, path))
        children = [(v, (path, k, "attr")) for k, v in saved.items() if type(v) not in ATOMIC]
        return [*children, *((base, path) for base in cls.__bases__)]
