"""Step objects the checked code builds anew in every run, recognised in later runs.

A cell that trains an object made in an earlier cell hands every run the same loader,
optimizer and model, and a step is counted by identity (`steps.StepSource`). A script's
`main()`, or a one-cell program, makes its dataset, model and optimizer again in each run,
often from a class it defines again too: the probe's object is gone by the next run. Such a
step is recognised by what does not change between runs: the object's class (by module and
name) and the code line the step was issued from (the line iterating the loader, calling
`step()` or the model) — in the code as given by number, in a fix's edited text (whose
inserted lines shift the numbers) by the line's text.
"""

from __future__ import annotations

import linecache
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RebuiltSource:
    """The probe's step object as the checked code builds it again in every run: its type,
    and the code lines its steps were issued from. In the code as given they are known by
    number; in a fix's edited text (lines inserted above shift them) by their text, read
    from the edited text now running (`Workload.code_for` keeps it in linecache)."""

    kind: tuple[str, str]  # module and qualified name: code that defines the class runs again
    filename: str
    lines: frozenset[int]
    fixed_filename: str
    texts: frozenset[str]

    @classmethod
    def of(cls, stepped: Any, workload: Any, lines: set[int]) -> RebuiltSource:
        source_lines = workload.source.splitlines()
        texts = {source_lines[n - 1].strip() for n in lines if 0 < n <= len(source_lines)}
        return cls(
            _type_name(stepped),
            workload.filename,
            frozenset(lines),
            workload.fixed_filename,
            frozenset(texts),
        )

    def matches(self, obj: Any) -> bool:
        """`obj` has the probe's type and its step is issued from one of the probe's lines:
        the first frame of the checked code on the stack is at one of them."""
        if _type_name(obj) != self.kind:
            return False
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name == self.filename:
                return frame.f_lineno in self.lines
            if name == self.fixed_filename:
                entry = linecache.cache.get(name)
                lines = entry[2] if entry else []
                line = lines[frame.f_lineno - 1].strip() if frame.f_lineno <= len(lines) else ""
                return line in self.texts
            frame = frame.f_back
        return False


def _type_name(obj: Any) -> tuple[str, str]:
    kind = type(obj)
    return (kind.__module__, kind.__qualname__)
