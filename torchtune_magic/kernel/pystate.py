"""Plain Python state a cell changes in place: snapshot it, put it back exactly, and name
what cannot be put back.

A training cell appends to a `lossi` list made in an earlier cell, a hand-written layer
rebinds `self.out` and its running statistics as attributes, a closure counts its calls.
None of that rebinds a name in the namespace, so restoring the bindings alone left six
runs' worth of entries behind after %%perfcheck (18,000 losses for 3,000 steps). This
module walks the objects the namespace reaches, keeps a shallow copy of each one's contents
(the references it holds: every object reached is copied in its own right, so nothing is
deep-copied twice) and writes them back *into the same objects*, so references the user
holds elsewhere stay valid.

The walk is bounded (objects, references copied, bytes of arrays and tensors, seconds) and
takes the names the cell reads first, so that what the cell can reach is covered before a
bound is hit; what a bound left out is named (`PyState.not_covered`). It never enters
torch's own objects (the state guard keeps parameters, optimizers and RNGs by their own
rules: tensors and `torch.Generator`s found here are handed to it), IPython's, modules, or
C objects without a `__dict__`.

Some state has no way back: a generator advanced, a file read or written, a socket used.
Those reachable from the names the cell reads are marked when the snapshot is taken
(`one_way`) and compared after a run (`PyState.unrestorable_changes`), so that the session
can refuse to re-run a cell whose re-runs would change what the user sees.
"""

from __future__ import annotations

import array
import ast
import collections
import functools
import io
import operator
import random
import reprlib
import socket
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import one_way
from .discovery import IPYTHON_NAMES

try:  # numpy is optional: torch works without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    np = None

# What a snapshot takes of free host memory for copies of arrays and tensors it finds
# (beyond those the state guard found itself), as the session does for the whole snapshot.
SHARE_OF_FREE_MEMORY = 0.25

# Containers up to this many references (or bytes) are written back on every restore: as
# cheap as reading a mark, and exact. Bigger ones the probe's run left as they were are
# passed over between runs while their mark is unchanged (`PyState.note_unwritten`).
SKIP_ABOVE = 256

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
_ATOMIC: frozenset[type] = frozenset(
    {
        str, bytes, int, float, complex, bool, type(None), range, slice, type(...),
        type(NotImplemented), types.CodeType, types.BuiltinFunctionType, types.ModuleType,
        types.WrapperDescriptorType, types.MethodWrapperType, types.MethodDescriptorType,
        types.GetSetDescriptorType, types.MemberDescriptorType, property, torch.dtype,
        torch.device, torch.Size, memoryview,
    }
)  # fmt: skip
_ABSENT = object()  # an attribute, slot or closure cell that holds nothing
# A class statement makes a heap type that is not immutable; C types are static, or heap
# types made immutable (`_csv.reader`, `functools.partial` in 3.11).
_HEAPTYPE, _IMMUTABLETYPE = 1 << 9, 1 << 8  # Py_TPFLAGS_*
_MODULE_ATTRIBUTES = frozenset({"training"})  # set by torch's Module, restored elsewhere


# A path from a namespace name to an object, built as a linked list while walking and
# written out only to name what was left out: (parent path or None, key, kind).
_Path = tuple[Any, Any, str]


@dataclass(frozen=True)
class Bounds:
    """How much a snapshot may take; what lies past a bound is named, not copied."""

    objects: int = 50_000  # objects visited
    references: int = 2_000_000  # references copied, all containers together
    nbytes: int | None = None  # bytes of numpy arrays and tensors copied (None: unbounded)
    seconds: float = 0.5  # wall time of the walk


# --- parts: one object's contents each, written back into that object --------------------


class _Part:
    """One object's saved contents. `write` puts them back into the object itself;
    `restore` does where `holds_start` says, exactly, that the object no longer holds them
    (parts whose writing is cheaper than comparing write unconditionally); `mark` is a
    cheap reading (a length, the ends) that the usual writes to a big container change, or
    None where restoring costs no more than reading one."""

    path: _Path  # where it is bound, written out only to name it (`label`)
    size: int = 0  # references held
    nbytes: int = 0  # bytes of array copies held

    def holds_start(self) -> bool:
        raise NotImplementedError

    def write(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        # an unchanged dict or instance dict is not rebuilt (rehashed, its keys unshared)
        if not self.holds_start():
            self.write()

    def mark(self) -> Any:
        return None

    @property
    def label(self) -> str:
        return _label(self.path)


def _same_refs(now: Iterable[Any], saved: Iterable[Any]) -> bool:
    return not any(map(operator.is_not, now, saved))


@dataclass
class _List(_Part):
    obj: list[Any]
    items: list[Any]
    path: _Path

    def __post_init__(self) -> None:
        self.size = len(self.items)

    def holds_start(self) -> bool:
        obj = self.obj
        return list.__len__(obj) == self.size and _same_refs(list.__iter__(obj), self.items)

    def write(self) -> None:
        list.__setitem__(self.obj, slice(None), self.items)

    restore = write  # ~8x cheaper than comparing item by item first (a C loop, no calls)

    def mark(self) -> Any:
        obj = self.obj
        if self.size <= SKIP_ABOVE:
            return None
        return (list.__len__(obj), id(obj[0]), id(obj[-1])) if obj else 0


@dataclass
class _Deque(_Part):
    obj: collections.deque[Any]
    items: list[Any]
    path: _Path

    def __post_init__(self) -> None:
        self.size = len(self.items)

    def holds_start(self) -> bool:
        obj = self.obj
        return len(obj) == self.size and _same_refs(collections.deque.__iter__(obj), self.items)

    def write(self) -> None:  # its maxlen is read-only: a run cannot have changed it
        collections.deque.clear(self.obj)
        collections.deque.extend(self.obj, self.items)

    restore = write

    def mark(self) -> Any:
        obj = self.obj
        if self.size <= SKIP_ABOVE:
            return None
        return (len(obj), id(obj[0]), id(obj[-1])) if obj else 0


@dataclass
class _Dict(_Part):
    """A dict or a subclass, written through the base class's own methods (a Counter's
    `update` adds counts, a user subclass's `__setitem__` may do anything). An OrderedDict
    keeps an order of its own, written through its methods; a defaultdict's
    `default_factory` is kept too."""

    obj: dict[Any, Any]
    saved: dict[Any, Any]
    path: _Path
    factory: Any = _ABSENT

    def __post_init__(self) -> None:
        ordered = isinstance(self.obj, collections.OrderedDict)
        self.base: type[dict[Any, Any]] = collections.OrderedDict if ordered else dict
        self.size = 2 * len(self.saved)

    @classmethod
    def of(cls, obj: dict[Any, Any], path: _Path) -> _Dict:
        ordered = isinstance(obj, collections.OrderedDict)
        saved = dict(collections.OrderedDict.items(obj)) if ordered else dict.copy(obj)
        factory = obj.default_factory if isinstance(obj, collections.defaultdict) else _ABSENT
        return cls(obj, saved, path, factory)

    def holds_start(self) -> bool:
        obj, saved, base = self.obj, self.saved, self.base
        return (
            (self.factory is _ABSENT or obj.default_factory is self.factory)
            and dict.__len__(obj) == len(saved)
            and _same_refs(base.keys(obj), saved)
            and _same_refs(base.values(obj), saved.values())
        )

    def write(self) -> None:
        obj = self.obj
        if self.base is dict:
            dict.clear(obj)
            dict.update(obj, self.saved)  # from a dict: its stored hashes, no __hash__ calls
        else:
            collections.OrderedDict.clear(obj)
            for key, value in self.saved.items():
                collections.OrderedDict.__setitem__(obj, key, value)
        if self.factory is not _ABSENT:
            obj.default_factory = self.factory

    def mark(self) -> Any:
        return dict.__len__(self.obj) if self.size > SKIP_ABOVE else None


@dataclass
class _Set(_Part):
    obj: set[Any]
    saved: set[Any]
    path: _Path

    def __post_init__(self) -> None:
        self.size = len(self.saved)

    def holds_start(self) -> bool:
        try:
            return set.__len__(self.obj) == self.size and set.issuperset(self.obj, self.saved)
        except Exception:  # an element's __eq__ raised: call it changed
            return False

    def write(self) -> None:
        set.clear(self.obj)
        set.update(self.obj, self.saved)

    def mark(self) -> Any:
        return set.__len__(self.obj) if self.size > SKIP_ABOVE else None


@dataclass
class _Buffer(_Part):
    """A bytearray or an array.array: its bytes, copied back whole (a memcpy)."""

    obj: bytearray | array.array[Any]
    saved: bytearray | array.array[Any]
    path: _Path

    def __post_init__(self) -> None:
        self.nbytes = len(self.saved) * getattr(self.saved, "itemsize", 1)

    def holds_start(self) -> bool:
        # bytes, not values: array('d') compares -0.0 equal to 0.0 and NaN unequal to itself
        return bytes(self.obj) == bytes(self.saved)

    def write(self) -> None:
        type(self.saved).__setitem__(self.obj, slice(None), self.saved)

    restore = write  # copying bytes back costs what comparing them would

    def mark(self) -> Any:
        return len(self.obj) if self.nbytes > SKIP_ABOVE else None


@dataclass
class _NDArray(_Part):
    """A numpy array's values (references, for object arrays), shape and dtype, copied back
    whole. An array resized in place (`ndarray.resize`) keeps its new size: its old memory
    is gone."""

    obj: Any
    saved: Any
    path: _Path

    def __post_init__(self) -> None:
        self.nbytes = self.saved.nbytes

    def holds_start(self) -> bool:
        obj, saved = self.obj, self.saved
        if obj.shape != saved.shape or obj.dtype != saved.dtype:
            return False
        if obj.dtype.hasobject:
            return _same_refs(obj.flat, saved.flat)
        contiguous = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        return bool(np.array_equal(contiguous, saved.reshape(-1).view(np.uint8)))

    def write(self) -> None:
        obj, saved = self.obj, self.saved
        if obj.dtype != saved.dtype and obj.itemsize == saved.itemsize:
            obj.dtype = saved.dtype  # `arr.dtype = ...` reinterprets in place
        if obj.shape != saved.shape and obj.size == saved.size:
            obj.shape = saved.shape  # a view of other memory refuses, and is named
        np.copyto(obj, saved, casting="no")

    restore = write

    def mark(self) -> Any:
        # a write through numpy leaves no mark: passed over between runs, it is said
        # (`PyState.written_unseen`) and put back by the full restore at the end
        if self.nbytes <= SKIP_ABOVE:
            return None
        return (self.obj.shape, self.obj.dtype, self.obj.__array_interface__["data"][0])


@dataclass
class _MemoryFile(_Part):
    """An io.BytesIO or io.StringIO: contents and position, through the state its pickling
    reads and sets in place (a file on disk cannot be put back; one in memory can)."""

    obj: io.BytesIO | io.StringIO
    saved: tuple[Any, ...]
    path: _Path

    def __post_init__(self) -> None:
        self.nbytes = len(self.saved[0])

    def write(self) -> None:
        if not self.obj.closed:  # a run that closed it: closed it stays
            self.obj.__setstate__(self.saved)

    restore = write


def _memory_file_size(file: io.BytesIO | io.StringIO) -> int:
    if isinstance(file, io.BytesIO):
        with file.getbuffer() as view:  # no copy; released at once (it blocks resizing)
            return view.nbytes
    return len(file.getvalue())


@dataclass
class _Attributes(_Part):
    """An object's `__dict__`: attributes a run added are removed, changed ones put back,
    written into the dict itself (no `__setattr__`, no properties). For an nn.Module only
    its plain attributes (`self.out`, a counter): torch's own (`_parameters`, `_modules`,
    hooks, `training`) are the state guard's."""

    obj: Any
    saved: dict[str, Any]
    path: _Path
    plain_only: bool = False

    def __post_init__(self) -> None:
        self.size = len(self.saved)

    def _now(self) -> dict[str, Any]:
        now = object.__getattribute__(self.obj, "__dict__")
        return {k: v for k, v in now.items() if _plain(k)} if self.plain_only else now

    def holds_start(self) -> bool:
        now, saved = self._now(), self.saved
        return len(now) == len(saved) and all(now.get(k, _ABSENT) is v for k, v in saved.items())

    def write(self) -> None:
        # key by key: rebinding `self.out` leaves the dict as it is shaped (CPython shares
        # the keys of instances' dicts; a rebuilt dict would slow attribute reads down)
        current = object.__getattribute__(self.obj, "__dict__")
        ours = _plain if self.plain_only else _any
        for key in [k for k in current if ours(k) and k not in self.saved]:
            del current[key]
        for key, value in self.saved.items():
            if current.get(key, _ABSENT) is not value:
                current[key] = value
        if not self.plain_only and list(current) != list(self.saved):  # deleted, re-added
            dict.clear(current)
            dict.update(current, self.saved)


def _any(name: Any) -> bool:
    return True


def _plain(name: Any) -> bool:
    return isinstance(name, str) and not name.startswith("_") and name not in _MODULE_ATTRIBUTES


@dataclass
class _Slots(_Part):
    obj: Any
    slots: list[tuple[Any, Any]]  # (member descriptor, value or _ABSENT)
    path: _Path

    def __post_init__(self) -> None:
        self.size = len(self.slots)

    def holds_start(self) -> bool:
        return all(_slot_value(d, self.obj) is v for d, v in self.slots)

    def write(self) -> None:
        for descriptor, value in self.slots:
            if _slot_value(descriptor, self.obj) is value:
                continue
            if value is _ABSENT:
                descriptor.__delete__(self.obj)
            else:
                descriptor.__set__(self.obj, value)


def _slot_value(descriptor: Any, obj: Any) -> Any:
    try:
        return descriptor.__get__(obj, type(obj))
    except AttributeError:
        return _ABSENT


@dataclass
class _Cells(_Part):
    """A notebook function's closure cells: a `nonlocal` counter lives there."""

    cells: list[tuple[types.CellType, Any]]  # (cell, contents or _ABSENT)
    path: _Path

    def __post_init__(self) -> None:
        self.size = len(self.cells)

    def holds_start(self) -> bool:
        return all(_cell_value(c) is v for c, v in self.cells)

    def write(self) -> None:
        for cell, value in self.cells:
            if _cell_value(cell) is value:
                continue
            if value is _ABSENT:
                del cell.cell_contents
            else:
                cell.cell_contents = value


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _ABSENT


@dataclass
class _ClassAttributes(_Part):
    """A notebook class's own attributes (a class-level counter, a registry list). Dunder
    names Python adds by itself (`__annotations__`, `__slotnames__`: lazily built caches)
    are left when a run added them."""

    cls: type
    saved: dict[str, Any]
    path: _Path

    def __post_init__(self) -> None:
        self.size = len(self.saved)

    def _added(self) -> list[str]:
        return [k for k in vars(self.cls) if k not in self.saved and not k.startswith("__")]

    def holds_start(self) -> bool:
        now = vars(self.cls)
        return not self._added() and all(now.get(k, _ABSENT) is v for k, v in self.saved.items())

    def write(self) -> None:
        for key in self._added():
            type.__delattr__(self.cls, key)
        now = vars(self.cls)
        for key, value in self.saved.items():
            if now.get(key, _ABSENT) is not value:
                type.__setattr__(self.cls, key, value)


@dataclass
class _RandomState(_Part):
    """A random number generator of its own (`random.Random`, numpy's Generator,
    RandomState or bit generator): its state, set back on every restore (microseconds)."""

    set: Callable[[Any], None]
    saved: Any
    path: _Path

    def write(self) -> None:
        self.set(self.saved)

    restore = write  # setting a state costs microseconds


def _random_part(obj: Any, path: _Path) -> _RandomState | None:
    """The state part of a generator of `_RNG_TYPES`; None for one without a state to read
    (`random.SystemRandom` draws from the OS)."""
    try:
        if isinstance(obj, random.Random):
            return _RandomState(obj.setstate, obj.getstate(), path)
        if isinstance(obj, np.random.RandomState):
            return _RandomState(obj.set_state, obj.get_state(), path)
    except NotImplementedError:
        return None
    bit_generator = obj.bit_generator if isinstance(obj, np.random.Generator) else obj

    def set_state(state: Any) -> None:
        bit_generator.state = state

    return _RandomState(set_state, bit_generator.state, path)


_RNG_TYPES: tuple[type, ...] = (random.Random,) + (
    () if np is None else (np.random.RandomState, np.random.Generator, np.random.BitGenerator)
)


# --- the walk ------------------------------------------------------------------------------


def _label(path: _Path) -> str:
    """`layers[3].out`: where an object is bound, as the user would write it."""
    steps = []
    node: Any = path
    while node is not None:
        node, key, kind = node
        # a user's key: reprlib keeps a long one short, and one whose repr raises readable
        index = f"[{reprlib.repr(key)}]"
        steps.append(key if kind == "name" else f".{key}" if kind == "attr" else index)
    return "".join(reversed(steps))


def _root(cls: type) -> str:
    return (getattr(cls, "__module__", None) or "").split(".")[0]


def _is_python_class(cls: type) -> bool:
    return cls.__flags__ & (_HEAPTYPE | _IMMUTABLETYPE) == _HEAPTYPE


def _slot_descriptors(cls: type) -> list[Any]:
    """The descriptors of the `__slots__` Python classes in `cls`'s MRO declare (not a C
    type's members, which are often read-only)."""
    found = []
    for klass in cls.__mro__:
        declared = vars(klass).get("__slots__")
        if declared is None or not _is_python_class(klass):
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


class _Walk:
    """One bounded walk of a namespace; collects the parts, markers and torch objects."""

    def __init__(self, namespace: dict[str, Any], bounds: Bounds, known: set[int]):
        self.namespace = namespace
        self.bounds = bounds
        self.known = known  # tensors the state guard keeps already
        self.module_name = namespace.get("__name__", "builtins")
        self.parts: list[_Part] = []
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
                    f"`{_label(path)}` (a {type(obj).__name__}) was not snapshotted: reading "
                    f"it raised {type(error).__name__}: {error}"
                )
                continue
            queue.extend((child, at, root) for child, at in children)
        return []

    def fits(self, obj: Any, path: _Path, references: int = 0, nbytes: int = 0) -> bool:
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
            f"`{_label(path)}` ({_describe(obj)}) was not snapshotted: copying it would pass "
            f"{bound}, so what the measuring runs change in it stays changed"
        )
        return False

    def visit(self, obj: Any, path: _Path, watched: bool) -> Iterable[tuple[Any, _Path]]:
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
                self.markers.append(one_way.advancing(obj, _label(path), what))
        elif issubclass(cls, (io.BytesIO, io.StringIO)):
            if not obj.closed and self.fits(obj, path, nbytes=_memory_file_size(obj)):
                self.parts.append(_MemoryFile(obj, obj.__getstate__(), path))
        elif issubclass(cls, io.IOBase):
            if watched:
                self.markers.append(one_way.File.of(obj, _label(path)))
        elif issubclass(cls, socket.socket):
            if watched and obj.fileno() != -1:
                self.markers.append(one_way.Socket(_label(path)))
        elif np is not None and issubclass(cls, np.ndarray):
            return self.ndarray(obj, path)
        elif issubclass(cls, _RNG_TYPES):
            part = _random_part(obj, path)
            if part is not None:
                self.parts.append(part)
        elif _root(cls) not in SKIPPED_PACKAGES:
            children = self.contents(obj, cls, path, watched)
            if _is_python_class(cls):  # a user's object (or container subclass): attributes
                return [*children, *self.attributes(obj, cls, path)]
            return children
        return ()

    def tensor(self, tensor: torch.Tensor, path: _Path) -> None:
        if id(tensor) in self.known:
            return
        self.known.add(id(tensor))
        if self.fits(tensor, path, nbytes=_nbytes(tensor)):
            self.tensors.append(tensor)

    def module(self, module: torch.nn.Module, path: _Path) -> list[tuple[Any, _Path]]:
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
            saved = {k: v for k, v in vars(sub).items() if _plain(k)}
            if self.fits(sub, at, references=len(saved)):
                self.parts.append(_Attributes(sub, saved, at, plain_only=True))
                children.extend(((v, (at, k, "attr")) for k, v in saved.items()))
            children.extend(self.of_class(type(sub)))
        return children

    def ndarray(self, array_: Any, path: _Path) -> list[tuple[Any, _Path]]:
        if not array_.flags.writeable or not self.fits(array_, path, nbytes=array_.nbytes):
            return []
        self.parts.append(_NDArray(array_, array_.copy(order="K"), path))
        if array_.dtype != object or not self.fits(array_, path, references=array_.size):
            return []
        return self.items(list(array_.flat), path)

    def contents(
        self, obj: Any, cls: type, path: _Path, watched: bool
    ) -> Iterable[tuple[Any, _Path]]:
        """The part for a container, function or class, and what it holds."""
        if issubclass(cls, list):
            if self.fits(obj, path, references=list.__len__(obj)):
                part = _List(obj, list.copy(obj), path)
                self.parts.append(part)
                return self.items(part.items, path)
        elif issubclass(cls, (tuple, frozenset)):
            return self.items(obj, path)
        elif issubclass(cls, dict):
            # the namespace's bindings are the state guard's
            if obj is not self.namespace and self.fits(obj, path, references=2 * len(obj)):
                part = _Dict.of(obj, path)
                self.parts.append(part)
                keys = [(k, (path, k, "item")) for k in part.saved if type(k) not in _ATOMIC]
                return [*keys, *self.items(part.saved.values(), path, part.saved)]
        elif issubclass(cls, set):
            if self.fits(obj, path, references=set.__len__(obj)):
                part = _Set(obj, set.copy(obj), path)
                self.parts.append(part)
                return self.items(part.saved, path)
        elif issubclass(cls, collections.deque):
            if self.fits(obj, path, references=len(obj)):
                part = _Deque(obj, list(collections.deque.__iter__(obj)), path)
                self.parts.append(part)
                return self.items(part.items, path)
        elif issubclass(cls, (bytearray, array.array)):
            if self.fits(obj, path, nbytes=len(obj) * getattr(obj, "itemsize", 1)):
                copy = (
                    bytearray(obj) if issubclass(cls, bytearray) else array.array(obj.typecode, obj)
                )
                self.parts.append(_Buffer(obj, copy, path))
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
        elif watched and not _is_python_class(cls) and one_way.advances(obj):
            self.markers.append(one_way.advancing(obj, _label(path), "an iterator"))
        return ()

    def items(
        self, values: Iterable[Any], path: _Path, keys: Iterable[Any] | None = None
    ) -> list[tuple[Any, _Path]]:
        values = values if isinstance(values, (list, tuple)) else list(values)
        if _ATOMIC.issuperset(map(type, values)):  # a list of words or numbers: nothing below
            return []
        keys = range(len(values)) if keys is None else keys
        return [
            (v, (path, k, "item"))
            for k, v in zip(keys, values, strict=True)
            if type(v) not in _ATOMIC
        ]

    def attributes(self, obj: Any, cls: type, path: _Path) -> list[tuple[Any, _Path]]:
        children = []
        found = _instance_dict(obj)
        if found is not None and self.fits(obj, path, references=len(found)):
            saved = dict.copy(found)
            self.parts.append(_Attributes(obj, saved, path))
            children = [(v, (path, k, "attr")) for k, v in saved.items() if type(v) not in _ATOMIC]
        descriptors = self.slots.get(cls)
        if descriptors is None:
            descriptors = self.slots[cls] = _slot_descriptors(cls)
        if descriptors and self.fits(obj, path, references=len(descriptors)):
            slots = [(d, _slot_value(d, obj)) for d in descriptors]
            self.parts.append(_Slots(obj, slots, path))
            children.extend((v, (path, d.__name__, "attr")) for d, v in slots if v is not _ABSENT)
        return [*children, *self.of_class(cls)]

    def of_class(self, cls: type) -> list[tuple[Any, _Path]]:
        """An instance's notebook class, to walk (its class-level counters) in turn."""
        return [(cls, (None, cls.__qualname__, "name"))] if self.notebook_class(cls) else []

    def notebook_class(self, cls: type) -> bool:
        return _is_python_class(cls) and cls.__module__ == self.module_name

    def function(self, func: types.FunctionType, path: _Path) -> list[tuple[Any, _Path]]:
        """A notebook function's closure cells and attributes, and what its defaults hold;
        library functions are left alone."""
        if func.__globals__ is not self.namespace:
            return []
        cells = [(cell, _cell_value(cell)) for cell in func.__closure__ or ()]
        if cells:
            self.parts.append(_Cells(cells, path))
        children = [(v, (path, f"<closure {i}>", "name")) for i, (_, v) in enumerate(cells)]
        children = [(v, p) for v, p in children if v is not _ABSENT]
        for extra in (func.__defaults__, func.__kwdefaults__):
            if extra is not None:
                children.append((extra, path))
        return [*children, *self.attributes(func, type(func), path)]

    def class_attributes(self, cls: type, path: _Path) -> list[tuple[Any, _Path]]:
        if not self.notebook_class(cls) or not self.fits(cls, path, references=len(vars(cls))):
            return []
        saved = dict(vars(cls))
        self.parts.append(_ClassAttributes(cls, saved, path))
        children = [(v, (path, k, "attr")) for k, v in saved.items() if type(v) not in _ATOMIC]
        return [*children, *((base, path) for base in cls.__bases__)]


# --- what the cell reads ---------------------------------------------------------------------


def cell_reads(source: str, namespace: dict[str, Any]) -> list[str]:
    """The namespace names a cell can reach, those it names first: every name in its text,
    then the globals that the notebook's functions and classes it names read (their code's
    `co_names`, nested code included), transitively. A bound on the walk then leaves out
    names the cell cannot reach before any it can."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = dict.fromkeys(node.id for node in ast.walk(tree) if isinstance(node, ast.Name))
    order = [name for name in names if name in namespace]
    seen = set(order)
    for name in order:  # grows while it is read
        for code in _code_of(namespace[name], namespace):
            for read in _names_in(code):
                if read in namespace and read not in seen:
                    seen.add(read)
                    order.append(read)
    return order


def _code_of(value: Any, namespace: dict[str, Any]) -> list[types.CodeType]:
    if isinstance(value, types.MethodType):
        value = value.__func__
    if isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, types.FunctionType):
        return [value.__code__] if value.__globals__ is namespace else []
    cls = value if isinstance(value, type) else type(value)
    if not _is_python_class(cls):
        return []
    codes = []
    for klass in cls.__mro__:
        for attr in vars(klass).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            elif isinstance(attr, property):
                attr = attr.fget
            if isinstance(attr, types.FunctionType) and attr.__globals__ is namespace:
                codes.append(attr.__code__)
    return codes


def _names_in(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names_in(const)


# --- the snapshot ----------------------------------------------------------------------------


@dataclass
class PyState:
    """The namespace's plain Python state as it was, and what cannot be put back.

    `tensors`, `modules` and `generators` are torch objects the walk found that the state
    guard's own search did not: it keeps them by its own rules (values, training flags,
    RNG states)."""

    parts: list[_Part]
    markers: list[one_way.Marker]
    tensors: list[torch.Tensor] = field(default_factory=list)
    modules: list[torch.nn.Module] = field(default_factory=list)
    generators: list[torch.Generator] = field(default_factory=list)
    # what a bound left out, or a restore could not write back, one line each (for the
    # report's warnings)
    not_covered: list[str] = field(default_factory=list)
    # after `note_unwritten`: the parts a run wrote, and those it left with their marks then
    written: list[_Part] | None = None
    unwritten: list[tuple[_Part, Any]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def restore(self, written_only: bool = False) -> None:
        """Put every part back into its object; with `written_only`, pass over those noted
        unwritten whose mark is unchanged. A part that cannot be written back (an array a
        run made read-only) is named in `not_covered`; the others are restored all the
        same."""
        if not written_only or self.written is None:
            due = self.parts
        else:
            due = [*self.written, *(p for p, mark in self.unwritten if p.mark() != mark)]
        for part in due:
            try:
                part.restore()
            except Exception as error:
                said = (
                    f"`{part.label}` could not be put back ({type(error).__name__}: {error}), "
                    "so what the measuring runs changed in it stays changed"
                )
                if said not in self.not_covered:
                    self.not_covered.append(said)

    def note_unwritten(self) -> None:
        """After a run of the cell from this snapshot: note the big containers (over
        SKIP_ABOVE references or bytes) it left exactly as they were (a word list, a
        vocabulary, a dataset array the cell only reads), with their marks. Restores
        between measuring runs pass over them while their mark (a length and the items at
        the ends, an array's buffer) is unchanged: comparing a 32k-word list item by item
        costs ~1 ms a run, a mark a fraction of a microsecond."""
        self.written, self.unwritten = [], []
        for part in self.parts:
            mark = part.mark()
            if mark is not None and part.holds_start():
                self.unwritten.append((part, mark))
            else:
                self.written.append(part)

    def written_unseen(self) -> list[str]:
        """Containers passed over between runs that no longer hold their start contents
        although their mark is unchanged (an item replaced in place, an array written
        through numpy), by where they are bound: the runs after that write started from
        it. A full `restore()` still puts them back."""
        return [
            part.label
            for part, mark in self.unwritten
            if part.mark() == mark and not part.holds_start()
        ]

    def unrestorable_changes(self) -> list[str]:
        """What a run of the cell did since the snapshot that no restore can undo, one line
        each, naming the object and why (a generator advanced, a file written, a socket
        the cell can use); empty when re-running the cell repeats nothing the user sees.
        Only objects reachable from the names the cell reads are watched."""
        return [change for marker in self.markers if (change := marker.change()) is not None]


def take(
    namespace: dict[str, Any],
    reads: list[str] | None = None,
    known_tensors: Iterable[int] = (),
    bounds: Bounds | None = None,
) -> PyState:
    """Snapshot the plain Python state `namespace` reaches.

    `reads`: the names the cell reads (`cell_reads`), walked first and the only ones
    whose generators, iterators, files and sockets are watched; None watches all names.
    `known_tensors`: ids of tensors the state guard keeps already (not counted again).
    """
    bounds = bounds or Bounds()
    walk = _Walk(namespace, bounds, set(known_tensors))
    names = [
        name
        for name, value in namespace.items()
        if not name.startswith("_")
        and name not in IPYTHON_NAMES
        and type(value) not in _ATOMIC
        and not isinstance(value, types.ModuleType)
    ]
    if reads is None:
        groups, watched = [names], set(names)
    else:
        watched = set(reads).intersection(names)
        groups = [[n for n in reads if n in watched], [n for n in names if n not in watched]]
    for index, group in enumerate(groups):
        left = walk.walk(group, watched)
        if walk.stopped is not None:
            left += [name for later in groups[index + 1 :] for name in later]
            shown = ", ".join(f"`{n}`" for n in left[:8])
            more = f" and {len(left) - 8} more" if len(left) > 8 else ""
            walk.not_covered.append(
                f"the snapshot of Python objects stopped at {walk.stopped}: some objects "
                f"reachable from {shown}{more} were left out, so what the measuring runs change "
                "in them stays changed"
            )
            break
    return PyState(
        walk.parts,
        walk.markers,
        walk.tensors,
        walk.modules,
        walk.generators,
        walk.not_covered,
    )
