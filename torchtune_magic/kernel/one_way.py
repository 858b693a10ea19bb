"""State no restore can put back: marked when a snapshot is taken, compared after a run.

A generator or iterator bound before the cell and advanced by it, a file it reads or writes
through an object made earlier, a socket it can use: re-running the cell would consume,
read, write or send again, and nothing can undo it. The snapshot (`pystate`) marks each
one the names the cell reads reach; after the probe's run, `Marker.change()` says what the
run did to it, so the session can refuse to run the cell again.
"""

from __future__ import annotations

import operator
import types
import warnings
from dataclasses import dataclass
from typing import Any

from torch.utils.data.dataloader import _BaseDataLoaderIter


class Marker:
    """Where something that cannot be restored stood when the snapshot was taken."""

    def change(self) -> str | None:
        """What a run did to it that re-running the cell would repeat, or None."""
        raise NotImplementedError


@dataclass
class Advancing(Marker):
    """A generator or iterator: its position, read again after a run."""

    obj: Any
    label: str
    what: str  # "a generator", "an iterator", …
    before: Any

    def change(self) -> str | None:
        head = f"`{self.label}` ({self.what} bound before the cell)"
        tail = "cannot be rewound, so re-running the cell would consume more of it"
        if self.before is _UNREAD:
            return (
                f"{head} has a position perfcheck cannot read: if the cell advances it, it {tail}"
            )
        if _same_position(_position(self.obj), self.before):
            return None
        return f"{head} was advanced by the cell: it {tail}"


@dataclass
class File(Marker):
    """A file object: whether it is closed, and its position (`tell()`)."""

    obj: Any
    label: str
    closed: bool
    position: int | None
    writable: bool

    @classmethod
    def of(cls, file: Any, label: str) -> File:
        closed, position = _file_position(file)
        try:
            writable = not closed and file.writable()
        except (OSError, ValueError):
            writable = False
        return cls(file, label, closed, position, writable)

    def change(self) -> str | None:
        if self.closed:
            return None  # nothing a run can do to it
        closed, position = _file_position(self.obj)
        kind = "a file open for writing" if self.writable else "a file open for reading"
        head = f"`{self.label}` ({kind})"
        if closed:
            return f"{head} was closed by the cell: re-running the cell would find it closed"
        if position is None or self.position is None:
            return (
                f"{head} has a position perfcheck cannot read: what a run reads or writes "
                "through it cannot be taken back, and re-running the cell would do it again"
            )
        if position == self.position:
            return None
        if self.writable:
            return (
                f"{head} was written by the cell (its position moved): what a run writes "
                "cannot be taken back, so re-running the cell would write it again"
            )
        return (
            f"{head} was read by the cell (its position moved): re-running the cell would "
            "read on from where the last run stopped"
        )


@dataclass
class Socket(Marker):
    """An open socket: what went through it cannot be read, so it is always named."""

    label: str

    def change(self) -> str | None:
        return (
            f"`{self.label}` (an open socket bound before the cell) may be used by the cell: "
            "what a run sends or receives cannot be taken back, so re-running the cell "
            "would send or receive again"
        )


def _position(obj: Any, depth: int = 0) -> Any:
    """Where an iterator or generator stands, as far as can be read: a generator's
    instruction and locals (its state lives in its frame), a builtin iterator's remaining
    length or else its pickled state, a DataLoader iterator's batch count; the iterators it
    draws from are read in turn. `_UNREAD` when nothing can be read."""
    if type(obj) is tuple:  # pickled state nests its parts in tuples
        return tuple(_position(part, depth) for part in obj)
    if isinstance(obj, types.GeneratorType):
        frame = obj.gi_frame
        if frame is None:
            return ("exhausted",)
        values = tuple(frame.f_locals.values())
        inner = tuple(_position(v, depth + 1) for v in values if advances(v))
        delegate = _position(obj.gi_yieldfrom, depth + 1) if obj.gi_yieldfrom else None
        return (frame.f_lasti, values, inner, delegate)
    if isinstance(obj, _BaseDataLoaderIter):
        return ("batches", obj._num_yielded)
    if depth > _POSITION_DEPTH or not advances(obj):
        return obj
    left = operator.length_hint(obj, -1)
    if left >= 0:
        return ("left", left)
    if (
        type(obj).__reduce_ex__ is object.__reduce_ex__
        and type(obj).__reduce__ is object.__reduce__
    ):
        return _UNREAD  # object's own pickling knows nothing of a position (csv.reader)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # pickling itertools, 3.12+
            reduced = obj.__reduce__()
    except Exception:
        return _UNREAD
    return _position(tuple(reduced[1:]), depth + 1)


_POSITION_DEPTH = 3
_UNREAD = object()  # a position that cannot be read: never known to be unchanged


def advances(obj: Any) -> bool:
    cls = type(obj)
    return hasattr(cls, "__next__") and hasattr(cls, "__iter__")


def _same_position(a: Any, b: Any) -> bool:
    """Positions compared: numbers and names by value, other objects by identity; a part
    that could not be read is never known to be unchanged."""
    if a is _UNREAD or b is _UNREAD:
        return False
    if type(a) is tuple:
        return type(b) is tuple and len(a) == len(b) and all(map(_same_position, a, b))
    if type(a) in (int, str, bool) and type(b) is type(a):
        return a == b
    return a is b


def _file_position(file: Any) -> tuple[bool, int | None]:
    if file.closed:
        return (True, None)
    try:
        return (False, file.tell() if file.seekable() else None)
    except (OSError, ValueError):
        return (False, None)


def advancing(obj: Any, label: str, what: str) -> Advancing:
    """A generator or iterator (`what`: "a generator", …) marked where it stands now."""
    return Advancing(obj, label, what, _position(obj))
