"""Reversible fixes: object patches, context patches and source edits.

A fix changes the live kernel (rebinding a name, patching an attribute, a global switch),
and/or wraps each run of the cell in a context, and/or edits the cell's source. Every change
goes through a `Patcher`, which remembers how to put it back, so undo is exact — object
identity in the namespace included — and happens on toggle-off, on error and on Ctrl-C.

The user keeps working while a report is open: they may rebind `loader` to a new DataLoader
after the probe ran. A fix must never replace that newer object by a copy of the old one, and
undo must never put the old one back over it. So a fix names the places it reads or writes
(`Fix.seen`, `Patcher.rebind`): applying refuses when a place no longer holds what the probe
saw there, and undo leaves a place the user has rebound since, with a note saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .discovery import Location

_ABSENT = object()
_LOOKUP_ERRORS = (KeyError, AttributeError, IndexError, ValueError, TypeError)


class FixError(RuntimeError):
    """A fix could not be applied; the message says why. Nothing of it stays applied."""

    def __init__(self, check_id: str, reason: str):
        super().__init__(f"{check_id}: {reason}")
        self.check_id = check_id
        self.reason = reason


class Rebound(Exception):
    """A place a fix would change no longer holds the object the probe saw there."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def holds(namespace: dict[str, Any], location: Location, obj: Any) -> bool:
    """Whether `location` still leads to `obj` itself (a missing path holds nothing)."""
    try:
        return location.get(namespace) is obj
    except _LOOKUP_ERRORS:
        return False


def expect(namespace: dict[str, Any], location: Location, obj: Any) -> None:
    """Raise `Rebound` unless `location` still holds `obj` (what the probe saw there)."""
    if holds(namespace, location, obj):
        return
    try:
        location.get(namespace)
    except _LOOKUP_ERRORS:
        raise Rebound(
            f"`{location}` is gone since the probe ran: re-run %%perfcheck on the cell"
        ) from None
    raise Rebound(
        f"`{location}` was rebound since the probe ran: re-run %%perfcheck on the cell to "
        "check the new object"
    )


def left_note(label: str) -> str:
    """What undo says when it leaves a place the user rebound while the fix was applied."""
    return (
        f"`{label}` was rebound while the fix was applied: your new object stays there "
        "(the one from before the fix was not put back)"
    )


def replace_held(namespace: dict[str, Any], location: Location, ours: Any, new: Any) -> str | None:
    """Put `new` where `ours` (what a fix put there) still is; a place the user has rebound
    since is left as it is, and the note saying so is returned."""
    if not holds(namespace, location, ours):
        return left_note(str(location))
    location.set(namespace, new)
    return None


class Patcher:
    """Records changes to live objects and undoes them in reverse order.

    `notes` collects what undo left as it found it because the user (or the cell) had
    replaced the fix's object meanwhile: the caller reports them."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.notes: list[str] = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """Set `obj.name`; undo restores the old instance attribute or removes ours."""
        old = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else getattr(obj, name)
        setattr(obj, name, value)

        def restore() -> None:
            if old is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)

        self._undo.append(restore)

    def switch(self, owner: Any, name: str, value: Any) -> None:
        """Set a global switch such as `torch.backends.cudnn.benchmark`; undo sets the value
        read before. (These are properties of module classes, so `setattr`'s instance-dict
        bookkeeping does not apply.)"""
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def setitem(self, mapping: dict[Any, Any], key: Any, value: Any) -> None:
        """Set `mapping[key]` (a namespace name); undo puts the old value back only while
        ours is still there, so a name the cell or the user bound since is kept."""
        old = mapping.get(key, _ABSENT)
        mapping[key] = value

        def restore() -> None:
            if mapping.get(key, _ABSENT) is not value:
                self.notes.append(left_note(str(key)))
            elif old is _ABSENT:
                del mapping[key]
            else:
                mapping[key] = old

        self._undo.append(restore)

    def assign(self, obj: Any, name: str, value: Any, label: str) -> None:
        """Set an attribute of a user object (`block.forward`) while a fix is applied; undo
        puts the old value back only while ours is still there (`label` names the place in
        the note otherwise). For torch's own attributes patched during a run, `setattr`."""
        old = vars(obj).get(name, _ABSENT)
        setattr(obj, name, value)

        def restore() -> None:
            if vars(obj).get(name, _ABSENT) is not value:
                self.notes.append(left_note(label))
            elif old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        self._undo.append(restore)

    def rebind(self, namespace: dict[str, Any], location: Location, old: Any, new: Any) -> None:
        """Put `new` where the namespace holds `old` (a name, `trainer.loader`, `models[0]`).
        Raises `Rebound` when the place no longer holds `old`; undo puts `old` back only
        where `new` still is, and notes a place the user has rebound since."""
        expect(namespace, location, old)
        location.set(namespace, new)

        def restore() -> None:
            note = replace_held(namespace, location, new, old)
            if note is not None:
                self.notes.append(note)

        self._undo.append(restore)

    def call(self, do: Callable[[], Any], undo: Callable[[], Any]) -> None:
        """Run `do` now and `undo` when reverting (for changes that are not assignments)."""
        do()
        self._undo.append(undo)

    def replace_everywhere(self, namespace: dict[str, Any], old: Any, new: Any) -> int:
        """Rebind every namespace name that points at `old` (e.g. `from torch... import f`)."""
        names = [k for k, v in namespace.items() if v is old and not k.startswith("_")]
        for name in names:
            self.setitem(namespace, name, new)
        return len(names)

    def undo(self) -> None:
        """Undo every change, newest first; keep going past failures and re-raise the first."""
        first_error: BaseException | None = None
        while self._undo:
            step = self._undo.pop()
            try:
                step()
            except BaseException as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error


class Fix:
    """A reversible change offered for one finding.

    Subclasses override what they need: `patch` (changes to live objects, kept while the fix
    is applied), `run_context` (entered around every run of the cell while applied) and
    `edit_source` (the cell text the workload runs). Expensive artifacts (a compiled module,
    a rebuilt loader) are built once and cached on the instance, so toggling is cheap.
    """

    check_id: ClassVar[str] = ""
    tolerance: ClassVar[float] = 0.0  # max relative difference still called "close"
    # What a first run with the fix can pay once ("compile", "worker start", "cuDNN
    # autotune"). Only such fixes report a one-time cost; for others a slow first run is noise.
    one_time_cause: ClassVar[str] = ""
    # About what that first run pays, in seconds, before it is measured: a first run that
    # would end past the budget's deadline is not started
    one_time_guess_s: ClassVar[float] = 0.0
    # A memory fix (activation checkpointing): under --memory it is judged by its peak
    # memory first and its time second, never called "slower, not recommended".
    saves_memory: ClassVar[bool] = False
    # Devices on which the fix cuts peak memory: after the cell runs out of memory there,
    # a run with the fix shows whether it makes the cell fit.
    cuts_memory_on: ClassVar[frozenset[str]] = frozenset()
    # Sets the C allocator's thresholds for the process (cpu-allocator): after its undo
    # glibc no longer moves them by itself, so runs after it are served under another
    # allocator state than runs before it.
    sets_allocator: ClassVar[bool] = False
    # The run context stands for code the fix's change puts in the cell (a `with
    # torch.no_grad():` around it): it is entered inside the timed run, where that code would
    # run and cost its time. Other run contexts are the measurement's own devices (debug
    # calls made inert for the run) and are entered before the clock starts.
    context_in_cell: ClassVar[bool] = False
    # With the fix applied, what the cell costs no longer follows the Python stack it runs
    # under (anomaly detection off): its runs need not execute under the plain cell's stack.
    ends_stack_cost: ClassVar[bool] = False
    # The share of the cell's steps that still run with the fix (a DistributedSampler
    # leaves each rank 1/N of every epoch): a sampled cell's whole time is projected from
    # the per-step time over that many steps.
    steps_share: float = 1.0
    # The largest speedup the check's evidence allows this fix (Amdahl's bound: a loader
    # waiting 30 % of the run can win at most 1/(1 - 0.3) = 1.43x), None where the evidence
    # gives no bound. The plan measures the most promising fixes first and does not time
    # one whose bound cannot pass the no-change band.
    most_gain: float | None = None

    def bounded_by(self, share: float | None) -> Fix:
        """This fix, its gain bounded by the share of the time it acts on (Amdahl: that
        share made free); a share unknown or whole gives no bound."""
        if share is not None and 0.0 <= share < 1.0:
            self.most_gain = 1.0 / (1.0 - share)
        return self

    def __init__(self) -> None:
        self._patcher: Patcher | None = None
        # What the fix did to the objects the cell's complete run built (`final_run_context`):
        # kept while the fix stays applied, undone with it
        self.kept: list[Patcher] = []
        # Where the probe saw the objects this fix changes (the model holding a conv, the
        # optimizer's names): applying refuses when one of these places holds another object.
        self.seen: list[tuple[Location, Any]] = []

    @property
    def applied(self) -> bool:
        return self._patcher is not None

    @property
    def warmup_steps(self) -> int:
        """Steps a run with the fix takes to reach its steady state (a loader with workers
        hands out its prefetched batches in a burst first); sampled runs skip at least
        this many before timing."""
        return 0

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        """Change live objects through `patcher` (default: nothing)."""

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        """Entered around each run of the cell while the fix is applied (default: nothing)."""
        return contextlib.nullcontext()

    def final_run_context(
        self, namespace: dict[str, Any]
    ) -> contextlib.AbstractContextManager[Any]:
        """Entered around the cell's one complete run while the fix is applied (`--apply`):
        what it does to objects that run builds may stay, in `kept` (default: as any run)."""
        return self.run_context(namespace)

    def keep_for_kernel(self, namespace: dict[str, Any]) -> None:
        """The probe's run was the cell's one complete run and the fix stays applied: make
        its change on the objects that run built, kept in `kept` (default: nothing; a fix
        acting on objects from before the cell made it when applied)."""

    def edit_source(self, source: str) -> str:
        return source

    def apply(self, namespace: dict[str, Any]) -> None:
        """Change the live objects; raises FixError (nothing left applied) when it cannot,
        e.g. when a name it changes was rebound since the probe ran."""
        if self._patcher is not None:
            return
        patcher = Patcher()
        try:
            for location, obj in self.seen:
                expect(namespace, location, obj)
            self.patch(patcher, namespace)
        except BaseException as error:
            patcher.undo()
            if isinstance(error, Rebound):
                raise FixError(self.check_id, error.reason) from None
            if isinstance(error, Exception) and not isinstance(error, FixError):
                raise FixError(self.check_id, f"{type(error).__name__}: {error}") from error
            raise
        self._patcher = patcher

    def undo(self, *, keep_built: bool = False) -> list[str]:
        """Undo every change; returns notes on places left as the user rebound them.

        `keep_built`: what the fix did to the objects the cell's complete run built stays
        (`kept`): a measurement lifts the applied fixes for its runs, which build objects
        of their own, and applies them again after; the kernel's objects keep the change
        meanwhile, since applying cannot rebuild them."""
        patcher, self._patcher = self._patcher, None
        kept = [] if keep_built else self.kept
        if not keep_built:
            self.kept = []
        notes = []
        for undone in [*reversed(kept), *([patcher] if patcher is not None else [])]:
            undone.undo()
            notes += undone.notes
        return [f"{self.check_id}: {note}" for note in notes]


@contextlib.contextmanager
def applied(fixes: list[Fix], namespace: dict[str, Any]) -> Iterator[None]:
    """Apply `fixes` for the duration of the block; undo them all however it ends.

    Already-applied fixes are left as they were (they belong to the caller). Undo notes
    are dropped: these are measuring runs, where a name the cell rebinds is the cell's own
    doing and the next run starts from the restored start state. What a lifted fix did to
    the objects of the cell's complete run (`kept`) is the kernel's, not these runs': it
    stays.
    """
    ours: list[Fix] = []
    try:
        for fix in fixes:
            if not fix.applied:
                fix.apply(namespace)
                ours.append(fix)
        yield
    finally:
        for fix in reversed(ours):
            fix.undo(keep_built=True)


@contextlib.contextmanager
def combined_context(
    fixes: list[Fix], namespace: dict[str, Any], in_cell: bool | None = None, final: bool = False
) -> Iterator[None]:
    """Every fix's run context (with `in_cell`, only those whose `context_in_cell` is that;
    with `final`, the contexts of the cell's complete run), entered in a fixed order so
    composition is deterministic."""
    with contextlib.ExitStack() as stack:
        for fix in sorted(fixes, key=lambda f: f.check_id):
            if in_cell is None or fix.context_in_cell == in_cell:
                context = fix.final_run_context if final else fix.run_context
                stack.enter_context(context(namespace))
        yield


@contextlib.contextmanager
def patched(build: Callable[[Patcher], None]) -> Iterator[None]:
    """A run context made of patches: `build` patches, the block runs, all is undone (a
    name the cell rebound meanwhile stays as the cell left it)."""
    patcher = Patcher()
    try:
        build(patcher)
        yield
    finally:
        patcher.undo()


def combined_source(source: str, fixes: list[Fix]) -> str:
    for fix in sorted(fixes, key=lambda f: f.check_id):
        source = fix.edit_source(source)
    return source
