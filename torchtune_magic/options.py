"""Options shared by the cell magic and the Python API, validated in one place.

Bad input gets a clear `OptionsError` before anything runs, so nothing is lost.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field
from pathlib import Path

from .report import count


class OptionsError(ValueError):
    """An option the user gave cannot be used; the message says why and what is valid."""


def _id_list(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


@dataclass
class Options:
    """What one perfcheck run should do (names follow the magic's flags)."""

    checks: list[str] = field(default_factory=list)  # empty means every check
    skip: list[str] = field(default_factory=list)
    budget: float = 20.0
    quick: bool = False
    apply: list[str] = field(default_factory=list)  # ids, "all", "wins" (clear wins)
    json: Path | None = None
    quiet: bool = False
    widget: bool = True
    restore: bool = True
    device: str | None = None  # None: cuda when the cell used it, else cpu
    memory: bool = False
    finish: bool = True  # run the cell to completion at the end (False: kernel as before it)

    @classmethod
    def build(
        cls,
        *,
        checks: str | list[str] | None = None,
        skip: str | list[str] | None = None,
        budget: float | None = None,
        quick: bool = False,
        apply: str | list[str] | None = None,
        json: str | Path | None = None,
        quiet: bool = False,
        no_widget: bool = False,
        no_restore: bool = False,
        device: str | None = None,
        memory: bool = False,
        no_finish: bool = False,
    ) -> Options:
        """Validate user-facing values (from keywords or parsed flags)."""
        from .checks import registry

        known = registry.ids()
        for label, ids in (("--checks", _id_list(checks)), ("--skip", _id_list(skip))):
            unknown = [i for i in ids if i not in known]
            if unknown:
                raise OptionsError(
                    f"{label}: {count(len(unknown), 'unknown check id')}: {', '.join(unknown)}; "
                    f"known: {', '.join(sorted(known))}"
                )
        applied = _id_list(apply)
        unknown = [i for i in applied if i not in ("all", "wins") and i not in known]
        if unknown:
            raise OptionsError(
                f"--apply: {count(len(unknown), 'unknown check id')}: {', '.join(unknown)}; "
                "use ids, 'all' or 'wins'"
            )
        if budget is not None and not budget > 0:
            raise OptionsError(f"--budget must be a positive number of seconds, got {budget!r}")
        if device not in (None, "cpu", "cuda"):
            raise OptionsError(f"--device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise OptionsError("--device cuda: no CUDA device is available to torch here")
        return cls(
            checks=_id_list(checks),
            skip=_id_list(skip),
            budget=float(budget) if budget is not None else cls.budget,
            quick=quick,
            apply=applied,
            json=Path(json) if json else None,
            quiet=quiet,
            widget=not no_widget,
            restore=not no_restore,
            device=device,
            memory=memory,
            finish=not no_finish,
        )

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, handled_by_caller: tuple[str, ...] = ()
    ) -> Options:
        """Validated options from parsed flags: the magic's, `check`'s or `scan`'s, whose
        flags share these names; a flag a command does not have, or one it handles itself
        (`check` writes its own `--json`, with the script in it), takes its default."""
        names = [n for n in inspect.signature(cls.build).parameters if n not in handled_by_caller]
        return cls.build(**{name: getattr(args, name) for name in names if hasattr(args, name)})

    def wants(self, check_id: str) -> bool:
        return (not self.checks or check_id in self.checks) and check_id not in self.skip
