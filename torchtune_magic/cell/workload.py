"""The cell as something that can be run again and again: compiled source + namespace."""

from __future__ import annotations

import ast
import contextlib
import io
import itertools
import linecache
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernel.fixes import Patcher
from ..kernel.plain_stack import PlainStack
from . import loops
from .notebook import Notebook

_counter = itertools.count(1)


class CellError(Exception):
    """The user's cell raised; `original` is their exception, shown with its own traceback."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original
        self.observation: Any = None  # what the probe saw before the cell raised, if any


def synchronize() -> None:
    """Wait for queued device work, so a timed run includes it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def captured() -> Iterator[io.StringIO]:
    """Send what the cell prints to a buffer: stdout, stderr, and the logging handlers that
    write to them (frameworks such as Lightning log through handlers made at import time,
    which hold the stream object itself, so redirecting `sys.stdout` alone misses them)."""
    sink = io.StringIO()
    streams = {id(stream) for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    patcher = Patcher()
    try:
        for handler in _logging_handlers():
            if id(getattr(handler, "stream", None)) in streams:
                patcher.setattr(handler, "stream", sink)
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield sink
    finally:
        patcher.undo()


def silenced() -> contextlib.AbstractContextManager[io.StringIO]:
    """Swallow what the extra measuring runs print: the user sees it once, in the run that
    leaves the kernel as if the cell ran once."""
    return captured()


def _logging_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        item
        for item in logging.Logger.manager.loggerDict.values()
        if isinstance(item, logging.Logger)
    ]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler)]


@dataclass
class Workload:
    """The cell source and the namespace it runs in.

    `source` is the text the engine runs, checks and edits. Under a `%%perfcheck` line the
    cell's first line is line 2 (or more) in the editor: `at_line` starts `source` with
    that many blank lines less one, so that every line number — in code objects and so in
    tracebacks, in the AST, in findings and in diff hunks — is the editor's. `cell` is the
    text as given; the Python API (`first_line` 1) keeps the text's own numbering.
    """

    source: str
    namespace: dict[str, Any]
    filename: str = field(default="")
    first_line: int = 1  # the editor line of the cell's first line; `source` is padded to it
    # where the cell sits in the notebook (its text as typed, execution count, the kernel's
    # input history): for the code changes to earlier cells. Default: read from `In`.
    notebook: Notebook | None = None
    _compiled: dict[tuple[str, frozenset[str]], Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.filename:
            self.filename = f"<perfcheck-cell-{next(_counter)}>"
        self.tree = ast.parse(self.source, self.filename)  # SyntaxError surfaces before any run
        if self.notebook is None:
            self.notebook = Notebook.of_namespace(self.cell, self.namespace)

    @classmethod
    def at_line(
        cls,
        cell: str,
        namespace: dict[str, Any],
        first_line: int,
        notebook: Notebook | None = None,
    ) -> Workload:
        """The cell whose first line is the editor's line `first_line` (a SyntaxError
        names the editor's line)."""
        padded = "\n" * (first_line - 1) + cell
        return cls(padded, namespace, first_line=first_line, notebook=notebook)

    @property
    def cell(self) -> str:
        return self.as_typed(self.source)

    def as_typed(self, text: str) -> str:
        """`source`, or a text edited from it, without the blank lines standing for the
        editor's lines above the cell: what the user would paste into the cell."""
        lines = text.splitlines(keepends=True)
        padding = 0
        while padding < min(self.first_line - 1, len(lines)) and not lines[padding].strip():
            padding += 1
        return "".join(lines[padding:])

    def code_for(self, source: str | None = None, loop_keys: frozenset[str] = frozenset()) -> Any:
        """Compile (once per distinct text and set of instrumented loops, `cell/loops`);
        registered in linecache so tracebacks show lines."""
        source = self.source if source is None else source
        code = self._compiled.get((source, loop_keys))
        filename = self.filename if source == self.source else self.fixed_filename
        # the text about to run is the one linecache shows (the fixed texts share a name)
        lines = source.splitlines(keepends=True)
        linecache.cache[filename] = (len(source), None, lines, filename)
        if code is None:
            tree: Any = source
            if loop_keys:
                tree = loops.instrumented(ast.parse(source, filename), loop_keys)
            code = compile(tree, filename, "exec")
            self._compiled[(source, loop_keys)] = code
        return code

    def run(
        self,
        source: str | None = None,
        under: PlainStack | None = None,
        around: contextlib.AbstractContextManager[Any] | None = None,
        loop_keys: frozenset[str] = frozenset(),
    ) -> float:
        """Execute the cell once; seconds of wall time, device work included. `under`: the
        stack a plain run of the cell has, to run it under (`PlainStack.run`); `around`: a
        context entered and left inside the timed run, as code in the cell would be;
        `loop_keys`: the cell's loops that report each iteration (`cell/loops`)."""
        __tracebackhide__ = True
        code = self.code_for(source, loop_keys)
        hooked = loops.hook_bound(self.namespace) if loop_keys else contextlib.nullcontext()
        synchronize()
        start = time.perf_counter()
        try:
            with hooked, around or contextlib.nullcontext():
                if under is None:
                    exec(code, self.namespace)
                else:
                    under.run(exec, code, self.namespace)
            synchronize()
        except Exception as error:
            raise CellError(error) from error
        return time.perf_counter() - start

    def source_compiled_as(self, code: Any) -> str | None:
        """The text `code` (a module code object `code_for` made) was compiled from: which
        of the fixed versions a running frame executes (`probe/construction`)."""
        for (source, _), compiled in self._compiled.items():
            if compiled is code:
                return source
        return None

    def complete_run(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around the code's one complete run (`Session.finish`): a cell has nothing
        to do there; a script writes its files for real only then (`programs/script.py`)."""
        return contextlib.nullcontext()

    def probe_was_complete(self) -> None:
        """The probe ran the code to its end, so it was the complete run (a script then
        keeps the files it wrote)."""

    @property
    def fixed_filename(self) -> str:
        if self.filename.startswith("<"):
            return f"{self.filename[:-1]} with fixes>"
        return f"<{self.filename} with fixes>"  # a script's real path

    def cell_line(self) -> int | None:
        """The cell line executing right now (walks the stack to the cell's frame)."""
        frame = sys._getframe(1)
        names = (self.filename, self.fixed_filename)
        while frame is not None:
            if frame.f_code.co_filename in names:
                return frame.f_lineno
            frame = frame.f_back
        return None

    def line_text(self, line: int | None) -> str:
        if line is None:
            return ""
        lines = self.source.splitlines()
        return lines[line - 1].strip() if 0 < line <= len(lines) else ""
