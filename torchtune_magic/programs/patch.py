"""`check --patch FILE`: the script's recommended code changes as a unified diff.

The headers name the script relative to the current folder (`a/train.py`, `b/train.py`),
so `git apply FILE` and `patch -p1 < FILE` run from that folder accept it; a script outside
the current folder is named relative to its own folder (apply the patch there). A text
without a final newline gets diff's own marker for it, as `git diff` writes.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

NO_NEWLINE = "\\ No newline at end of file\n"


@dataclass(frozen=True)
class Patch:
    """A unified diff of one file, and the folder it applies in."""

    text: str
    applies_in: Path

    def write(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.text, encoding="utf-8")
        return target


def header_path(script: Path) -> tuple[str, Path]:
    """The script's name in the diff headers, and the folder the patch applies in."""
    here = Path.cwd()
    relative = os.path.relpath(script.resolve(), here)
    if relative.startswith(os.pardir):
        return script.name, script.resolve().parent
    return Path(relative).as_posix(), here


def _lines(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n" + NO_NEWLINE  # difflib has no marker of its own
    return lines


def unified(script: Path, original: str, changed: str) -> Patch | None:
    """The diff from `original` to `changed` for `script`, or None when they are equal."""
    if original == changed:
        return None
    name, folder = header_path(script)
    diff = difflib.unified_diff(_lines(original), _lines(changed), f"a/{name}", f"b/{name}")
    return Patch("".join(diff), folder)
