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

In three modules: the container parts (`pyparts`), the walk that makes them (`pywalk`),
and here the snapshot, its restore and the names the cell reads.
"""

from __future__ import annotations

import ast
import functools
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import one_way
from .discovery import IPYTHON_NAMES
from .pyparts import Part
from .pywalk import ATOMIC, Bounds, Walk, is_python_class

# What a snapshot takes of free host memory for copies of arrays and tensors it finds
# (beyond those the state guard found itself), as the session does for the whole snapshot.
SHARE_OF_FREE_MEMORY = 0.25


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
    if not is_python_class(cls):
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

    parts: list[Part]
    markers: list[one_way.Marker]
    tensors: list[torch.Tensor] = field(default_factory=list)
    modules: list[torch.nn.Module] = field(default_factory=list)
    generators: list[torch.Generator] = field(default_factory=list)
    # what a bound left out, or a restore could not write back, one line each (for the
    # report's warnings)
    not_covered: list[str] = field(default_factory=list)
    # after `note_unwritten`: the parts a run wrote, and those it left with their marks then
    written: list[Part] | None = None
    unwritten: list[tuple[Part, Any]] = field(default_factory=list)

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
    walk = Walk(namespace, bounds, set(known_tensors))
    names = [
        name
        for name, value in namespace.items()
        if not name.startswith("_")
        and name not in IPYTHON_NAMES
        and type(value) not in ATOMIC
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
