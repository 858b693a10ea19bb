"""perfcheck's own failures, contained at the part where they happen.

Only the cell's own exception may reach the user: a bug in a check, a code change, the
measuring, the numerics or the display must not fail a cell that ran fine, nor cost the
findings and numbers the other parts produced. Each part of the machinery after the probe
runs under `OwnFailures.part(name)`; an exception raised there by perfcheck's own code is
kept (the part, a one-line reason, the traceback for a bug report) and the flow goes on
without what that part would have added. What is never contained: the cell's own exception
(`CellError`), Ctrl-C, and a torchrun rank failing (every rank must stop together).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .cell.workload import CellError
from .distributed.lockstep import RankFailed
from .report import OwnFailure

_Result = TypeVar("_Result")

# exceptions that are never perfcheck's own failure: they go on to the caller
PASSED_ON: tuple[type[BaseException], ...] = (CellError, RankFailed)


class OwnFailures:
    """The failures of one session's machinery, in the order they happened (each part and
    reason once: a display that fails on every update is one failure)."""

    def __init__(self) -> None:
        self.seen: list[OwnFailure] = []

    def add(self, part: str, error: BaseException) -> None:
        failure = OwnFailure.of(part, error)
        if not any(f.part == part and f.reason == failure.reason for f in self.seen):
            self.seen.append(failure)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Run one part: its own failure is kept and the block is left, nothing raised."""
        try:
            yield
        except PASSED_ON:
            raise
        except Exception as error:
            self.add(name, error)

    def call(
        self, name: str, function: Callable[..., _Result], *args: Any, default: _Result
    ) -> _Result:
        """`function(*args)`, or `default` when it fails (the failure kept under `name`)."""
        with self.part(name):
            return function(*args)
        return default

    def guarded(self, name: str, callback: Callable[..., None]) -> Callable[..., None]:
        """`callback` with its failures kept under `name` (a display the session feeds)."""

        def contained(*args: Any) -> None:
            with self.part(name):
                callback(*args)

        return contained

    def failed(self, name: str) -> bool:
        return any(f.part == name for f in self.seen)
