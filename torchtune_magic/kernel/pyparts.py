"""The container parts of a Python-state snapshot: one object's contents each, written
back into that same object.

A list, deque, dict, set, buffer, numpy array, in-memory file, instance dict, `__slots__`,
closure cells, class attributes or `random.Random` state: each kind knows how to copy what
it holds (its references, shallowly), tell whether it still holds them, and put them back
in place, so references the user holds elsewhere stay valid. The walk (`pywalk`) makes
them; the snapshot (`pystate`) restores them.
"""

from __future__ import annotations

import array
import collections
import io
import operator
import random
import reprlib
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

try:  # numpy is optional: torch works without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    np = None

# Containers up to this many references (or bytes) are written back on every restore: as
# cheap as reading a mark, and exact. Bigger ones the probe's run left as they were are
# passed over between runs while their mark is unchanged (`PyState.note_unwritten`).
SKIP_ABOVE = 256


ABSENT = object()  # an attribute, slot or closure cell that holds nothing
_MODULE_ATTRIBUTES = frozenset({"training"})  # set by torch's Module, restored elsewhere


# A path from a namespace name to an object, built as a linked list while walking and
# written out only to name what was left out: (parent path or None, key, kind).
RefPath = tuple[Any, Any, str]


def path_label(path: RefPath) -> str:
    """`layers[3].out`: where an object is bound, as the user would write it."""
    steps = []
    node: Any = path
    while node is not None:
        node, key, kind = node
        # a user's key: reprlib keeps a long one short, and one whose repr raises readable
        index = f"[{reprlib.repr(key)}]"
        steps.append(key if kind == "name" else f".{key}" if kind == "attr" else index)
    return "".join(reversed(steps))


# --- parts: one object's contents each, written back into that object --------------------


class Part:
    """One object's saved contents. `write` puts them back into the object itself;
    `restore` does where `holds_start` says, exactly, that the object no longer holds them
    (parts whose writing is cheaper than comparing write unconditionally); `mark` is a
    cheap reading (a length, the ends) that the usual writes to a big container change, or
    None where restoring costs no more than reading one."""

    path: RefPath  # where it is bound, written out only to name it (`label`)
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
        return path_label(self.path)


def _same_refs(now: Iterable[Any], saved: Iterable[Any]) -> bool:
    return not any(map(operator.is_not, now, saved))


@dataclass
class ListPart(Part):
    obj: list[Any]
    items: list[Any]
    path: RefPath

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
class DequePart(Part):
    obj: collections.deque[Any]
    items: list[Any]
    path: RefPath

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
class DictPart(Part):
    """A dict or a subclass, written through the base class's own methods (a Counter's
    `update` adds counts, a user subclass's `__setitem__` may do anything). An OrderedDict
    keeps an order of its own, written through its methods; a defaultdict's
    `default_factory` is kept too."""

    obj: dict[Any, Any]
    saved: dict[Any, Any]
    path: RefPath
    factory: Any = ABSENT

    def __post_init__(self) -> None:
        ordered = isinstance(self.obj, collections.OrderedDict)
        self.base: type[dict[Any, Any]] = collections.OrderedDict if ordered else dict
        self.size = 2 * len(self.saved)

    @classmethod
    def of(cls, obj: dict[Any, Any], path: RefPath) -> DictPart:
        ordered = isinstance(obj, collections.OrderedDict)
        saved = dict(collections.OrderedDict.items(obj)) if ordered else dict.copy(obj)
        factory = obj.default_factory if isinstance(obj, collections.defaultdict) else ABSENT
        return cls(obj, saved, path, factory)

    def holds_start(self) -> bool:
        obj, saved, base = self.obj, self.saved, self.base
        return (
            (self.factory is ABSENT or obj.default_factory is self.factory)
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
        if self.factory is not ABSENT:
            obj.default_factory = self.factory

    def mark(self) -> Any:
        return dict.__len__(self.obj) if self.size > SKIP_ABOVE else None


@dataclass
class SetPart(Part):
    obj: set[Any]
    saved: set[Any]
    path: RefPath

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
class BufferPart(Part):
    """A bytearray or an array.array: its bytes, copied back whole (a memcpy)."""

    obj: bytearray | array.array[Any]
    saved: bytearray | array.array[Any]
    path: RefPath

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
class NDArrayPart(Part):
    """A numpy array's values (references, for object arrays), shape and dtype, copied back
    whole. An array resized in place (`ndarray.resize`) keeps its new size: its old memory
    is gone."""

    obj: Any
    saved: Any
    path: RefPath

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
class MemoryFilePart(Part):
    """An io.BytesIO or io.StringIO: contents and position, through the state its pickling
    reads and sets in place (a file on disk cannot be put back; one in memory can)."""

    obj: io.BytesIO | io.StringIO
    saved: tuple[Any, ...]
    path: RefPath

    def __post_init__(self) -> None:
        self.nbytes = len(self.saved[0])

    def write(self) -> None:
        if not self.obj.closed:  # a run that closed it: closed it stays
            self.obj.__setstate__(self.saved)

    restore = write


def memory_file_size(file: io.BytesIO | io.StringIO) -> int:
    if isinstance(file, io.BytesIO):
        with file.getbuffer() as view:  # no copy; released at once (it blocks resizing)
            return view.nbytes
    return len(file.getvalue())


@dataclass
class AttributesPart(Part):
    """An object's `__dict__`: attributes a run added are removed, changed ones put back,
    written into the dict itself (no `__setattr__`, no properties). For an nn.Module only
    its plain attributes (`self.out`, a counter): torch's own (`_parameters`, `_modules`,
    hooks, `training`) are the state guard's."""

    obj: Any
    saved: dict[str, Any]
    path: RefPath
    plain_only: bool = False

    def __post_init__(self) -> None:
        self.size = len(self.saved)

    def _now(self) -> dict[str, Any]:
        now = object.__getattribute__(self.obj, "__dict__")
        return {k: v for k, v in now.items() if plain_name(k)} if self.plain_only else now

    def holds_start(self) -> bool:
        now, saved = self._now(), self.saved
        return len(now) == len(saved) and all(now.get(k, ABSENT) is v for k, v in saved.items())

    def write(self) -> None:
        # key by key: rebinding `self.out` leaves the dict as it is shaped (CPython shares
        # the keys of instances' dicts; a rebuilt dict would slow attribute reads down)
        current = object.__getattribute__(self.obj, "__dict__")
        ours = plain_name if self.plain_only else any_name
        for key in [k for k in current if ours(k) and k not in self.saved]:
            del current[key]
        for key, value in self.saved.items():
            if current.get(key, ABSENT) is not value:
                current[key] = value
        if not self.plain_only and list(current) != list(self.saved):  # deleted, re-added
            dict.clear(current)
            dict.update(current, self.saved)


def any_name(name: Any) -> bool:
    return True


def plain_name(name: Any) -> bool:
    return isinstance(name, str) and not name.startswith("_") and name not in _MODULE_ATTRIBUTES


@dataclass
class SlotsPart(Part):
    obj: Any
    slots: list[tuple[Any, Any]]  # (member descriptor, value or ABSENT)
    path: RefPath

    def __post_init__(self) -> None:
        self.size = len(self.slots)

    def holds_start(self) -> bool:
        return all(slot_value(d, self.obj) is v for d, v in self.slots)

    def write(self) -> None:
        for descriptor, value in self.slots:
            if slot_value(descriptor, self.obj) is value:
                continue
            if value is ABSENT:
                descriptor.__delete__(self.obj)
            else:
                descriptor.__set__(self.obj, value)


def slot_value(descriptor: Any, obj: Any) -> Any:
    try:
        return descriptor.__get__(obj, type(obj))
    except AttributeError:
        return ABSENT


@dataclass
class CellsPart(Part):
    """A notebook function's closure cells: a `nonlocal` counter lives there."""

    cells: list[tuple[types.CellType, Any]]  # (cell, contents or ABSENT)
    path: RefPath

    def __post_init__(self) -> None:
        self.size = len(self.cells)

    def holds_start(self) -> bool:
        return all(cell_value(c) is v for c, v in self.cells)

    def write(self) -> None:
        for cell, value in self.cells:
            if cell_value(cell) is value:
                continue
            if value is ABSENT:
                del cell.cell_contents
            else:
                cell.cell_contents = value


def cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return ABSENT


@dataclass
class ClassAttributesPart(Part):
    """A notebook class's own attributes (a class-level counter, a registry list). Dunder
    names Python adds by itself (`__annotations__`, `__slotnames__`: lazily built caches)
    are left when a run added them."""

    cls: type
    saved: dict[str, Any]
    path: RefPath

    def __post_init__(self) -> None:
        self.size = len(self.saved)

    def _added(self) -> list[str]:
        return [k for k in vars(self.cls) if k not in self.saved and not k.startswith("__")]

    def holds_start(self) -> bool:
        now = vars(self.cls)
        return not self._added() and all(now.get(k, ABSENT) is v for k, v in self.saved.items())

    def write(self) -> None:
        for key in self._added():
            type.__delattr__(self.cls, key)
        now = vars(self.cls)
        for key, value in self.saved.items():
            if now.get(key, ABSENT) is not value:
                type.__setattr__(self.cls, key, value)


@dataclass
class RandomStatePart(Part):
    """A random number generator of its own (`random.Random`, numpy's Generator,
    RandomState or bit generator): its state, set back on every restore (microseconds)."""

    set: Callable[[Any], None]
    saved: Any
    path: RefPath

    def write(self) -> None:
        self.set(self.saved)

    restore = write  # setting a state costs microseconds


def random_part(obj: Any, path: RefPath) -> RandomStatePart | None:
    """The state part of a generator of `RNG_TYPES`; None for one without a state to read
    (`random.SystemRandom` draws from the OS)."""
    try:
        if isinstance(obj, random.Random):
            return RandomStatePart(obj.setstate, obj.getstate(), path)
        if isinstance(obj, np.random.RandomState):
            return RandomStatePart(obj.set_state, obj.get_state(), path)
    except NotImplementedError:
        return None
    bit_generator = obj.bit_generator if isinstance(obj, np.random.Generator) else obj

    def set_state(state: Any) -> None:
        bit_generator.state = state

    return RandomStatePart(set_state, bit_generator.state, path)


RNG_TYPES: tuple[type, ...] = (random.Random,) + (
    () if np is None else (np.random.RandomState, np.random.Generator, np.random.BitGenerator)
)
