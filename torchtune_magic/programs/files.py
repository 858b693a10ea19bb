"""Files a checked script writes reach their place from its one complete run only.

The engine runs a script several times: the probe, the measuring runs (each maybe stopped
at a step), the complete run. A checkpoint saved at the end, or a log opened for appending,
must not be written by the extra runs. So every run but the complete one writes to a
scratch folder instead: `open`/`io.open` in a writing mode (and `torch.save` to a path,
whose file torch's C++ opens itself) get a scratch path standing for the real one; a file a
run wrote is read back from its scratch copy by that run (`open` for reading, `torch.load`);
a file opened for appending or updating starts as a copy of the real one. Each run starts
from an empty scratch folder: it reads the real files, as a plain run would, and its own
writes. Where the probe turned out to be the whole run (it was not stopped at a step), it
*was* the complete run: its scratch files are copied to their real paths (`commit`).
Writes through other routes (`os.open`, a C library's own file handling) are not
redirected.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..kernel.fixes import Patcher, patched

_WRITING = set("wax+")


def _is_path(file: Any) -> bool:
    return isinstance(file, (str, bytes, os.PathLike))


def _regular(file: Any) -> bool:
    """A path to a regular file, or to none yet (not a device such as /dev/null)."""
    path = os.fsdecode(file)
    return not os.path.exists(path) or os.path.isfile(path)


class ScratchWrites:
    """Where a script's runs write: the scratch folder until `for_real`."""

    def __init__(self) -> None:
        self.real = False
        self._folder: Path | None = None
        self._scratch: dict[str, Path] = {}  # real absolute path -> scratch path
        self.written: list[str] = []  # the paths as the script named them, first write first

    def _scratch_for(self, file: Any, copy_existing: bool) -> str:
        real = os.path.abspath(os.fsdecode(file))
        scratch = self._scratch.get(real)
        if scratch is None:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="perfcheck-writes-"))
            scratch = self._folder / f"{len(self._scratch)}-{os.path.basename(real)}"
            self._scratch[real] = scratch
            if copy_existing and os.path.isfile(real):
                # io.FileIO, not `open`: our own copy must not pass through the redirect
                with io.FileIO(real, "r") as source, io.FileIO(scratch, "w") as target:
                    shutil.copyfileobj(source, target)
            shown = os.fsdecode(file)
            if shown not in self.written:
                self.written.append(shown)
        return str(scratch)

    def _read_path(self, file: Any) -> Any:
        if not _is_path(file):
            return file
        scratch = self._scratch.get(os.path.abspath(os.fsdecode(file)))
        return str(scratch) if scratch is not None else file

    @contextlib.contextmanager
    def redirected(self) -> Iterator[None]:
        """One run's writes go to the scratch folder (unless this is the complete run)."""
        if self.real:
            yield
            return
        self.discard()  # each run sees the files as a plain run would, and its own writes
        import torch

        real_open, real_save, real_load = builtins.open, torch.save, torch.load

        def scratch_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if _is_path(file) and _regular(file):
                if _WRITING & set(mode):
                    copy = "a" in mode or "+" in mode
                    file = self._scratch_for(file, copy_existing=copy)
                else:
                    file = self._read_path(file)
            return real_open(file, mode, *args, **kwargs)

        def scratch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if _is_path(f) and _regular(f):
                f = self._scratch_for(f, copy_existing=False)
            return real_save(obj, f, *args, **kwargs)

        def scratch_load(f: Any, *args: Any, **kwargs: Any) -> Any:
            return real_load(self._read_path(f), *args, **kwargs)

        def build(patcher: Patcher) -> None:
            patcher.setattr(builtins, "open", scratch_open)
            patcher.setattr(io, "open", scratch_open)
            patcher.setattr(torch, "save", scratch_save)
            patcher.setattr(torch, "load", scratch_load)

        with patched(build):
            yield

    @contextlib.contextmanager
    def for_real(self) -> Iterator[None]:
        """The complete run: files go where the script writes them."""
        self.real = True
        try:
            yield
        finally:
            self.real = False

    def commit(self) -> None:
        """The run that wrote to the scratch folder was the complete one: put its files in
        place, and start the next runs' scratch afresh."""
        for real, scratch in self._scratch.items():
            if scratch.exists():
                Path(real).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(scratch, real)
        self.discard()

    def discard(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = None
        self._scratch = {}
