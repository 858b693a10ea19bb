"""Where the checked cell sits in the notebook, and the kernel's earlier cells.

The cell as run (`workload`) and the edits of earlier cells (`history`) both read it, so it
sits below them. The engine imports no IPython: the magic hands over the input history
(`Notebook`), and the Python API finds `In` in the namespace when it is a kernel's.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Inputs:
    """The kernel's stored cells: as typed, and as IPython ran them (magics and `!` lines
    turned into Python), which is what gets parsed. Entry i is the cell with execution
    count `first_count + i` (entry 0 is IPython's empty placeholder): `%reset` empties
    IPython's lists while the counts the notebook shows go on."""

    typed: tuple[str, ...]
    python: tuple[str, ...]
    first_count: int = 0

    @classmethod
    def of_history(cls, manager: Any, last_count: int) -> Inputs:
        """From IPython's HistoryManager, whose last stored cell has execution count
        `last_count` (the running cell, while a magic runs)."""
        typed, python = tuple(manager.input_hist_raw), tuple(manager.input_hist_parsed)
        return cls(typed, python, last_count - (len(python) - 1))

    def cell(self, count: int) -> tuple[str, str]:
        """(as typed, as run) of the cell with this execution count."""
        index = count - self.first_count
        return self.typed[index], self.python[index]

    @property
    def last_count(self) -> int:
        return self.first_count + len(self.python) - 1


@dataclass
class Notebook:
    """Where the checked cell sits in the notebook.

    `header`: the line above the cell in the editor, as typed (`%%perfcheck --budget 5`;
    empty for the Python API). `body`: the cell below it, as typed. `execution_count`: the
    checked cell's own count, when IPython stored it (cells before it are the earlier ones).
    """

    header: str
    body: str
    execution_count: int | None = None
    inputs: Inputs | None = None
    _trees: dict[int, ast.Module | None] = field(default_factory=dict, repr=False)

    @classmethod
    def of_namespace(cls, cell: str, namespace: dict[str, Any]) -> Notebook:
        """For the Python API: the kernel's `In` when `namespace` is an IPython one (every
        stored cell counts as earlier: the code given is no cell of its own)."""
        inputs = namespace.get("In")
        found = None
        if isinstance(inputs, list) and all(isinstance(text, str) for text in inputs):
            found = Inputs(tuple(inputs), tuple(inputs))
        return cls("", cell, None, found)

    @property
    def text(self) -> str:
        """The checked cell as the editor holds it, `%%perfcheck` line included."""
        return f"{self.header}\n{self.body}" if self.header else self.body

    def earlier(self) -> Iterator[tuple[int, ast.Module]]:
        """Earlier cells that parse, newest first: (execution count, AST of the run text)."""
        if self.inputs is None:
            return
        newest = self.inputs.last_count
        if self.execution_count is not None:
            newest = min(newest, self.execution_count - 1)
        for count in range(newest, self.inputs.first_count, -1):
            if count not in self._trees:
                self._trees[count] = None
                with contextlib.suppress(SyntaxError, ValueError):
                    self._trees[count] = ast.parse(self.inputs.cell(count)[1])
            tree = self._trees[count]
            if tree is not None:
                yield count, tree
