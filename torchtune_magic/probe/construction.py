"""Objects the checked code builds, recognised by where and in which order it builds them.

A cell (or a whole script run as one) that builds its own model makes new modules on every
run, so a live fix cannot be handed the probe's objects: the measuring runs never use them.
What stays the same from run to run is *how* each object comes about: its class, the call
in the checked code that built it (the innermost frame whose code is the cell's, so a conv
built in `Net.__init__` defined in the cell is keyed by that line, one built inside a
library model by the cell line calling the library) and its place among the objects of
that class built there in this run (a loop building four convs at one line gives ordinals
0 to 3). The probe records each object's `Key` (`recording`); a measuring run with a fix
watches the same keys (`AtConstruction.watched`) and hands that run's objects to the fix
before they are first used, undoing it when the run's context exits.

Modules and optimizers are recognised (`torch.nn.Module.__init__` and
`torch.optim.Optimizer.__init__` are wrapped while a recording or a watch is active): the
fixes that need it act on a model's modules, and `amp`'s float16 form on the optimizer
its GradScaler steps. Nothing is installed in runs without such a fix.
"""

from __future__ import annotations

import contextlib
import difflib
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import torch

from ..kernel.fixes import Fix, Patcher

if TYPE_CHECKING:
    from ..cell.workload import Workload


@dataclass(frozen=True)
class Key:
    """Which object of a run: its class, the call in the checked code that built it (line
    and column as the cell is numbered, the column None where Python does not say) and its
    ordinal among the objects of that class built there in the run."""

    kind: str  # `module.QualName` of the class (a class the cell defines is new each run)
    line: int
    col: int | None
    ordinal: int


def _kind_of(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class Constructions:
    """The modules and optimizers the checked code of `workload` built in one run, by `Key`
    (held weakly: an object the run drops is not kept alive by this record)."""

    def __init__(self, workload: Workload):
        self.workload = workload
        self._filenames = (workload.filename, workload.fixed_filename)
        self._counts: Counter[tuple[str, int, int | None]] = Counter()
        self._objects: weakref.WeakValueDictionary[Key, Any] = weakref.WeakValueDictionary()
        # id of each object built -> its key (a later object with a reused id replaces it)
        self.keys: dict[int, Key] = {}
        self._line_maps: dict[CodeType, dict[int, int]] = {}

    def get(self, key: Key) -> Any | None:
        """This run's object at `key`, if it was built (and is still alive)."""
        return self._objects.get(key)

    def built(self, obj: Any, frame: FrameType | None) -> Key | None:
        """Record `obj`, constructed with `frame` the innermost Python frame of its caller;
        None (not recorded) where no frame on the stack is the checked code's."""
        site = self._site(frame)
        if site is None:
            self.keys.pop(id(obj), None)  # an object of the cell's that had this id is gone
            return None
        kind = _kind_of(obj)
        line, col = site
        ordinal = self._counts[(kind, line, col)]
        self._counts[(kind, line, col)] += 1
        key = Key(kind, line, col, ordinal)
        self.keys[id(obj)] = key
        with contextlib.suppress(TypeError):  # an object without weak references
            self._objects[key] = obj
        return key

    def _site(self, frame: FrameType | None) -> tuple[int, int | None] | None:
        """(line, column) of the call in the innermost frame of the checked code, as the
        cell is numbered (a run of the fixed cell maps its lines back)."""
        inner = None
        outermost = None
        while frame is not None:
            if frame.f_code.co_filename in self._filenames:
                inner = inner or frame
                outermost = frame
            frame = frame.f_back
        if inner is None or outermost is None:
            return None
        line, col = _position(inner)
        if inner.f_code.co_filename == self.workload.fixed_filename:
            mapped = self._line_map(outermost.f_code).get(line)
            if mapped is None:  # a line the fix's own edit added: no object of the cell's
                return None
            line = mapped
        return line, col

    def _line_map(self, code: CodeType) -> dict[int, int]:
        """Lines of the fixed text that `code` was compiled from -> the cell's lines (a
        fix's edit may add lines: `difflib` pairs up the unchanged ones and edited lines
        within a block of equal length)."""
        known = self._line_maps.get(code)
        if known is not None:
            return known
        fixed = self.workload.source_compiled_as(code)
        mapping: dict[int, int] = {}
        if fixed is not None:
            old = self.workload.source.splitlines()
            new = fixed.splitlines()
            matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
            for tag, a0, a1, b0, b1 in matcher.get_opcodes():
                if tag == "equal" or (tag == "replace" and a1 - a0 == b1 - b0):
                    mapping.update({b0 + i + 1: a0 + i + 1 for i in range(b1 - b0)})
        self._line_maps[code] = mapping
        return mapping


def _position(frame: FrameType) -> tuple[int, int | None]:
    """The line and column of the call the frame is making (the column where the code
    object records positions, Python 3.11 on)."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is not None:
        try:
            line, _, col, _ = list(positions())[frame.f_lasti // 2]
        except (IndexError, ValueError):
            line, col = None, None
        if line is not None:
            return line, col
    return frame.f_lineno, None


@contextlib.contextmanager
def recording(
    workload: Workload, on_built: Callable[[Any, Key], None] | None = None
) -> Iterator[Constructions]:
    """Record every module and optimizer the checked code of `workload` builds while the
    block runs (and call `on_built(obj, key)` once the base class's `__init__` has run: a
    module's hooks can be registered, its parameters are not made yet). Undone exactly
    when it ends."""
    constructions = Constructions(workload)

    def recorded(original: Callable[..., None]) -> Callable[..., None]:
        def recorded_init(obj: Any, *args: Any, **kwargs: Any) -> None:
            original(obj, *args, **kwargs)
            key = constructions.built(obj, sys._getframe(1))
            if key is not None and on_built is not None:
                on_built(obj, key)

        return recorded_init

    patcher = Patcher()
    try:
        for base in (torch.nn.Module, torch.optim.Optimizer):
            patcher.setattr(base, "__init__", recorded(base.__init__))
        yield constructions
    finally:
        patcher.undo()


class AtConstruction:
    """A live fix for objects the checked code builds: the keys of the objects it needs
    (as the probe recorded them), the key of the module whose first call applies it (one
    that runs before any of them is used: the model holding them) and how to make the
    fix for a run's objects (given in the order of `keys`). `seen` are the probe's own
    objects at those keys, held weakly: where the probe was the cell's one complete run,
    they are the kernel's, and `--apply` fixes them (`keep_on_seen`).

    With `on_build`, the fix is applied as the trigger (module or optimizer: the last of
    the objects the probe saw built) is constructed instead, for a fix that needs none of
    their state: a module's first call has already read its `forward` when its forward
    pre-hooks run, so a fix replacing `forward` must come before it."""

    def __init__(
        self,
        workload: Workload,
        keys: Sequence[Key],
        trigger: Key,
        make: Callable[[list[Any]], Fix],
        seen: Sequence[Any],
        on_build: bool = False,
    ):
        self.workload, self.keys, self.trigger, self.make = workload, list(keys), trigger, make
        self.on_build = on_build
        self.applied_runs = 0  # runs in which the fix reached its objects
        self._seen = [weakref.ref(obj) for obj in seen]

    def keep_on_seen(self, namespace: dict[str, Any], kept: list[Patcher]) -> None:
        """Fix the probe's objects, its undo appended to `kept` (nothing where one is gone)."""
        objects = [ref() for ref in self._seen]
        if not objects or any(obj is None for obj in objects):
            return
        patcher = Patcher()
        try:
            self.make(objects).patch(patcher, namespace)
        except BaseException:
            patcher.undo()
            raise
        kept.append(patcher)

    @contextlib.contextmanager
    def watched(
        self, namespace: dict[str, Any], kept: list[Patcher] | None = None
    ) -> Iterator[None]:
        """One run: at the trigger module's construction a forward pre-hook is registered;
        its first call makes the fix for this run's objects and applies it (the hook goes
        as it fires; `on_build`: the fix is applied then and there). Everything is undone,
        in reverse, when the block ends; with `kept` (the cell's complete run under
        `--apply`), what the fix did to the run's objects stays, its undo appended there."""
        patcher = Patcher()

        def on_built(module: Any, key: Key) -> None:
            if key != self.trigger:
                return
            if self.on_build:
                self._fix_run(patcher, namespace, constructions)
                return
            handles: list[Any] = []

            def first_call(called: torch.nn.Module, args: tuple[Any, ...]) -> Any:
                handles.pop().remove()
                return self._apply(patcher, namespace, called, args, constructions)

            handles.append(module.register_forward_pre_hook(first_call))
            patcher.call(lambda: None, lambda: [handle.remove() for handle in handles])

        try:
            with recording(self.workload, on_built) as constructions:
                yield
        finally:
            if kept is None:
                patcher.undo()
            else:
                kept.append(patcher)

    def _apply(
        self,
        patcher: Patcher,
        namespace: dict[str, Any],
        module: torch.nn.Module,
        args: tuple[Any, ...],
        constructions: Constructions,
    ) -> tuple[Any, ...] | None:
        """Apply the fix to this run's objects, then give this first call what the
        forward pre-hooks the fix added to `module` make of its inputs (hooks added while
        the module's hooks run are first called on its next call)."""
        before = set(module._forward_pre_hooks)
        if not self._fix_run(patcher, namespace, constructions):
            return None
        changed = False
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if hook_id in before or hook_id in module._forward_pre_hooks_with_kwargs:
                continue
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
                changed = True
        return args if changed else None

    def _fix_run(
        self, patcher: Patcher, namespace: dict[str, Any], constructions: Constructions
    ) -> bool:
        """Make and apply the fix for this run's objects; False where the run has not built
        them all (other objects than the probe's: left as they are)."""
        objects = [constructions.get(key) for key in self.keys]
        if any(obj is None for obj in objects):
            return False
        self.make(objects).patch(patcher, namespace)
        self.applied_runs += 1
        return True


class BuiltObjectsFix(Fix):
    """A fix whose change also reaches the objects the checked code builds (`built`, None
    where it acts on objects from before the cell only): each run's new objects get it,
    and under `--apply` the complete run's objects keep it until the fix is undone."""

    built: AtConstruction | None = None

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        if self.built is None:
            return contextlib.nullcontext()
        return self.built.watched(namespace)

    def final_run_context(
        self, namespace: dict[str, Any]
    ) -> contextlib.AbstractContextManager[Any]:
        if self.built is None:
            return contextlib.nullcontext()
        return self.built.watched(namespace, self.kept)

    def keep_for_kernel(self, namespace: dict[str, Any]) -> None:
        if self.built is not None:
            self.built.keep_on_seen(namespace, self.kept)


UNREACHED = (
    "made anew on every run without a constructor call in the checked code to follow "
    "(copied, unpickled or built in another thread): change the constructors"
)
