"""Which cells of an unmarked notebook are worth checking, and why (`scan`).

A cell is worth a `%%perfcheck` when its torch work repeats and it takes long enough for
a fix to matter: a training or evaluation loop (DataLoader batches, optimizer steps,
backward calls, a torch module called inside a loop: what `tracker.py` counted in the
scan's first, plain run) that ran at least MIN_SECONDS. Repetition is read from what ran,
not from the code's words: `model.train()` is a mode switch, and a `fit()` call is chosen
by the steps it ran. Every cell passed over gets its reason too, so the summary can say why
its longest cells were left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIN_SECONDS = 0.5
MIN_REPEATS = 2  # one batch is a look at the data, not a loop
COUNT_WORDS = (
    ("optimizer_steps", "optimizer step"),
    ("backward_calls", "backward call"),
    ("batches", "batch"),
)


@dataclass
class CellFacts:
    """What the first run saw of one code cell (`index`: 1-based position, markdown
    included, as the runner's cell<N>)."""

    index: int
    source: str
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    module_loop: str | None = None  # a torch module called inside a loop
    error: str | None = None  # "NameError: ..." where the cell raised


@dataclass
class Choice:
    index: int
    checked: bool
    why: str


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun if n == 1 else noun + ('es' if noun.endswith('h') else 's')}"


def repeats(facts: CellFacts) -> str:
    """The torch work that repeated, in words ("8 optimizer steps, 8 batches"), or ''."""
    words = [
        _plural(facts.counts[key], noun)
        for key, noun in COUNT_WORDS
        if facts.counts.get(key, 0) >= MIN_REPEATS and key != "backward_calls"
    ]
    if not words and facts.counts.get("backward_calls", 0) >= MIN_REPEATS:
        words.append(_plural(facts.counts["backward_calls"], "backward call"))
    if not words and facts.module_loop:
        words.append(f"{facts.module_loop}(...) called in a loop")
    return ", ".join(words)


def _passed_over(facts: CellFacts) -> str:
    if facts.error:
        return f"raised {facts.error}"
    work = repeats(facts)
    if work and facts.seconds < MIN_SECONDS:
        return f"{work}, but {facts.seconds:.2f} s (under {MIN_SECONDS:g} s)"
    if work and facts.source.lstrip().startswith("%%"):
        return f"{work}, but it runs under a cell magic ({facts.source.split()[0]})"
    seen = [_plural(facts.counts[key], noun) for key, noun in COUNT_WORDS if facts.counts.get(key)]
    return f"no torch work that repeats{f' ({seen[0]})' if seen else ''}"


def choose(facts: list[CellFacts]) -> list[Choice]:
    """A Choice per code cell, in notebook order."""
    choices = []
    for cell in facts:
        work = repeats(cell)
        ok = (
            bool(work)
            and not cell.error
            and cell.seconds >= MIN_SECONDS
            and not cell.source.lstrip().startswith("%%")
        )
        why = f"{work}, {cell.seconds:.1f} s" if ok else _passed_over(cell)
        choices.append(Choice(cell.index, ok, why))
    return choices


def chosen_by_user(facts: list[CellFacts], wanted: list[int]) -> list[Choice]:
    """`--cells 7,12`: those cells checked whatever they did."""
    return [
        Choice(
            cell.index,
            cell.index in wanted,
            "chosen with --cells" if cell.index in wanted else "not in --cells",
        )
        for cell in facts
    ]


def parse_cells(text: str, notebook: Any) -> list[int]:
    """`7,12` as positions of code cells of `notebook`; ValueError saying which is not."""
    positions = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"--cells takes cell numbers separated by commas, not {part!r}")
        index = int(part)
        if not 1 <= index <= len(notebook.cells) or notebook.cells[index - 1].cell_type != "code":
            raise ValueError(f"--cells: cell {index} is not a code cell of this notebook")
        positions.append(index)
    return positions
