"""Cell text edits: a DataLoader constructor call given keyword values, and the batches'
`.to(...)` / `.cuda(...)` copies given non_blocking=True."""

from __future__ import annotations

import ast

from torch.utils.data import DataLoader

from ...cell import codeedit

POSITIONAL = {"num_workers": 5, "pin_memory": 7}  # DataLoader's positional parameters


def with_keywords(source: str, line: int, names: set[str], values: dict[str, str]) -> str:
    """The text with the DataLoader call of `names` at `line` given these keyword values
    (replacing a keyword or DataLoader positional argument already there, else appending)."""
    return codeedit.with_keywords(source, line, names, values, POSITIONAL)


def class_names(loader: DataLoader) -> set[str]:
    """Names a call building this loader may use: DataLoader or the user's subclass."""
    return {"DataLoader", type(loader).__name__}


def non_blocking_edit(source: str, lines: set[int]) -> str:
    """`.to(...)` / `.cuda(...)` calls on these cell lines, given non_blocking=True (the
    last line first: a call written one argument per line gets a line more)."""
    for line in sorted(lines, reverse=True):
        tree = ast.parse(source)
        for call in codeedit.calls_named(tree, {"to", "cuda"}):
            if call.lineno == line and not any(k.arg == "non_blocking" for k in call.keywords):
                source = with_keywords(source, line, {"to", "cuda"}, {"non_blocking": "True"})
                break
    return source
