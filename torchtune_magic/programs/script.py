"""A script as the checked code: `python -m torchtune_magic check SCRIPT ARGS...`.

The script runs as `__main__` would under `python SCRIPT ARGS...`: its source compiled with
its real path (tracebacks and linecache show its lines), a fresh module `__main__` as its
namespace (so pickling a class it defines finds it), `sys.argv = [SCRIPT, *ARGS]` and its
folder first on `sys.path`. The engine runs it several times (probe, measuring runs, the
one complete run); `ScriptWorkload` makes each run start from what a plain run starts from:

- the same `sys.argv` (a run that edits it does not change the next);
- the same standard input: stdin is read once, as the runs ask for it, and every later run
  reads the same text again from its start (`ReplayedStdin`), so a script fed by a pipe
  sees the same input in each run and the pipe is consumed once;
- files: the runs before the complete one write to a scratch folder (`programs.files`), so
  a checkpoint or log is written by the script's one complete run only;
- `sys.exit(0)` ends the run as returning would; another status ends it as a failure the
  user sees (`ScriptExit`).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cell.workload import Workload
from ..kernel.fixes import Patcher, patched
from ..kernel.plain_stack import PlainStack
from .files import ScratchWrites


class ScriptInputError(ValueError):
    """SCRIPT cannot be checked as given; the message says why and what to do."""


class ScriptExit(Exception):
    """The script called `sys.exit(status)` with a failing status: the run ends there, and
    `check` exits with that status."""

    def __init__(self, status: int | str | None):
        super().__init__(f"the script exited with status {status}")
        self.status = status


@dataclass(frozen=True)
class Script:
    """A script to check: its path as given, its arguments and its text."""

    path: Path
    args: tuple[str, ...]
    source: str

    @classmethod
    def load(cls, path_text: str, args: list[str]) -> Script:
        """Validate SCRIPT: an existing .py file (a notebook is `scan`'s)."""
        path = Path(path_text)
        if path.suffix == ".ipynb":
            raise ScriptInputError(
                f"{path_text} is a notebook: check runs a Python script; "
                f"for a notebook use `python -m torchtune_magic scan {path_text}`"
            )
        if not path.exists():
            raise ScriptInputError(f"{path_text}: no such file")
        if not path.is_file() or path.suffix != ".py":
            raise ScriptInputError(f"{path_text} is not a Python script (.py file)")
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ScriptInputError(f"{path_text}: cannot be read: {error}") from error
        return cls(path, tuple(args), source)

    @property
    def argv(self) -> list[str]:
        return [str(self.path), *self.args]

    @property
    def real_path(self) -> str:
        return str(self.path.resolve())


class ReplayedStdin(io.TextIOBase):
    """Standard input read once and given again to every run: a run reads through what
    earlier runs read, then on from the real stdin (recording it), so every run sees the
    same stream and the real one is consumed once."""

    def __init__(self, real: Any):
        self._real = real
        self._recorded = ""
        self._position = 0

    def rewind(self) -> None:
        self._position = 0

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return bool(self._real is not None and self._real.isatty())

    def _ensure(self, wanted: int | None, *, line: bool = False) -> None:
        """Record more of the real stdin until `wanted` characters (None: all; `line`: a
        whole line) lie ahead of the position."""
        while True:
            ahead = self._recorded[self._position :]
            if line and "\n" in ahead:
                return
            if not line and wanted is not None and len(ahead) >= wanted:
                return
            more = self._real.readline() if self._real is not None else ""
            if not more:
                return
            self._recorded += more

    def read(self, size: int | None = -1) -> str:
        whole = size is None or size < 0
        self._ensure(None if whole else size)
        end = len(self._recorded) if whole else self._position + size  # type: ignore[operator]
        text = self._recorded[self._position : end]
        self._position += len(text)
        return text

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        self._ensure(None, line=True)
        ahead = self._recorded[self._position :]
        newline = ahead.find("\n")
        text = ahead if newline < 0 else ahead[: newline + 1]
        if size is not None and size >= 0:
            text = text[:size]
        self._position += len(text)
        return text

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]
        return self

    def __next__(self) -> str:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    @property
    def text(self) -> str:
        """All the runs read of stdin (what a plain run of the script is to be given)."""
        return self._recorded

    @property
    def consumed(self) -> bool:
        """Whether any run read from stdin."""
        return bool(self._recorded)


@dataclass
class ScriptWorkload(Workload):
    """The script as the engine's checked code: every run starts as a plain run starts
    (see the module docstring)."""

    script: Script | None = None
    stdin: ReplayedStdin | None = None
    writes: ScratchWrites = field(default_factory=ScratchWrites)
    exit_status: int | str | None = 0

    def run(
        self,
        source: str | None = None,
        under: PlainStack | None = None,
        around: contextlib.AbstractContextManager[Any] | None = None,
        loop_keys: frozenset[str] = frozenset(),
    ) -> float:
        __tracebackhide__ = True
        assert self.script is not None
        sys.argv[:] = self.script.argv
        if self.stdin is not None:
            self.stdin.rewind()
        with self.writes.redirected(), _process_group_kept():
            return super().run(source, under, self._exit_ends_run(around), loop_keys)

    @contextlib.contextmanager
    def _exit_ends_run(
        self, around: contextlib.AbstractContextManager[Any] | None
    ) -> Iterator[None]:
        """Inside the timed run: `sys.exit(0)` (or None) ends the run as a return would;
        another status becomes `ScriptExit`, which the engine treats as the script's own
        failure."""
        with around or contextlib.nullcontext():
            try:
                yield
            except SystemExit as done:
                if done.code in (0, None):
                    return
                self.exit_status = done.code
                raise ScriptExit(done.code) from None

    def complete_run(self) -> contextlib.AbstractContextManager[None]:
        """The script's one complete run: its files are written where it writes them."""
        return self.writes.for_real()

    def probe_was_complete(self) -> None:
        """The probe ran the whole script: what it wrote to the scratch folder is put where
        the script wrote it (as the complete run would have written it)."""
        self.writes.commit()


@contextlib.contextmanager
def _process_group_kept() -> Iterator[None]:
    """A script that makes its process group makes it in every run, and torch allows one
    default group per process: the first run's group serves the later runs
    (`init_process_group` returns at once where one exists) and the script's
    `destroy_process_group()` of it waits for the check's end (`check._process_group`)."""
    import torch.distributed as dist

    if not dist.is_available():
        yield
        return
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_once(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            init(*args, **kwargs)

    def destroy_later(group: Any = None) -> None:
        if group is not None and group is not dist.group.WORLD:
            destroy(group)

    def build(patcher: Patcher) -> None:
        patcher.setattr(dist, "init_process_group", init_once)
        patcher.setattr(dist, "destroy_process_group", destroy_later)

    with patched(build):
        yield


@contextlib.contextmanager
def as_main(script: Script) -> Iterator[ScriptWorkload]:
    """The script ready to run as `__main__` (the process's `__main__` module, `sys.argv`,
    `sys.path[0]` and `sys.stdin` are the script's until the context ends)."""
    module = types.ModuleType("__main__")
    module.__file__ = script.real_path
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    namespace = module.__dict__
    namespace["__package__"] = None
    namespace["__cached__"] = None
    saved = (sys.modules.get("__main__"), list(sys.argv), list(sys.path), sys.stdin)
    stdin = ReplayedStdin(sys.stdin)
    workload = ScriptWorkload(
        script.source, namespace, filename=script.real_path, script=script, stdin=stdin
    )
    try:
        sys.modules["__main__"] = module
        sys.argv[:] = script.argv
        sys.path.insert(0, str(Path(script.real_path).parent))
        sys.stdin = stdin  # type: ignore[assignment]
        yield workload
    finally:
        main, argv, path, real_stdin = saved
        if main is not None:
            sys.modules["__main__"] = main
        sys.argv[:] = argv
        sys.path[:] = path
        sys.stdin = real_stdin
        workload.writes.discard()
