"""Reversible fixes: object patches, context patches and source edits.

A fix changes the live kernel (rebinding a name, patching an attribute, a global switch),
and/or wraps each run of the cell in a context, and/or edits the cell's source. Every change
goes through a `Patcher`, which remembers how to put it back, so undo is exact — object
identity in the namespace included — and happens on toggle-off, on error and on Ctrl-C.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

_ABSENT = object()


class FixError(RuntimeError):
    """A fix could not be applied; the message says why. Nothing of it stays applied."""

    def __init__(self, check_id: str, reason: str):
        super().__init__(f"{check_id}: {reason}")
        self.check_id = check_id
        self.reason = reason


class Patcher:
    """Records changes to live objects and undoes them in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

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
        old = mapping.get(key, _ABSENT)
        mapping[key] = value

        def restore() -> None:
            if old is _ABSENT:
                mapping.pop(key, None)
            else:
                mapping[key] = old

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

    def __init__(self) -> None:
        self._patcher: Patcher | None = None

    @property
    def applied(self) -> bool:
        return self._patcher is not None

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        """Change live objects through `patcher` (default: nothing)."""

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        """Entered around each run of the cell while the fix is applied (default: nothing)."""
        return contextlib.nullcontext()

    def edit_source(self, source: str) -> str:
        return source

    def apply(self, namespace: dict[str, Any]) -> None:
        if self._patcher is not None:
            return
        patcher = Patcher()
        try:
            self.patch(patcher, namespace)
        except BaseException as error:
            patcher.undo()
            if isinstance(error, Exception) and not isinstance(error, FixError):
                raise FixError(self.check_id, f"{type(error).__name__}: {error}") from error
            raise
        self._patcher = patcher

    def undo(self) -> None:
        patcher, self._patcher = self._patcher, None
        if patcher is not None:
            patcher.undo()


@contextlib.contextmanager
def applied(fixes: list[Fix], namespace: dict[str, Any]) -> Iterator[None]:
    """Apply `fixes` for the duration of the block; undo them all however it ends.

    Already-applied fixes are left as they were (they belong to the caller).
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
            fix.undo()


@contextlib.contextmanager
def combined_context(fixes: list[Fix], namespace: dict[str, Any]) -> Iterator[None]:
    """Every fix's run context, entered in a fixed order so composition is deterministic."""
    with contextlib.ExitStack() as stack:
        for fix in sorted(fixes, key=lambda f: f.check_id):
            stack.enter_context(fix.run_context(namespace))
        yield


@contextlib.contextmanager
def patched(build: Callable[[Patcher], None]) -> Iterator[None]:
    """A run context made of patches: `build` patches, the block runs, all is undone."""
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
