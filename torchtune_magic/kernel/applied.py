"""The fixes applied to the live kernel now, and which ones `--apply` asks for.

Each fix undoes itself exactly (its `Patcher`); this stack keeps which are on, so the panel's
toggles, Revert all and a measurement (which lifts them for its runs and puts them back
after) agree on it. Undo can leave a place the user rebound while the fix was on: the notes
saying so go to `warn`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..report import Variant
from .fixes import Fix, FixError


class AppliedFixes:
    """The fixes on the live objects of `namespace`, by check id."""

    def __init__(self, namespace: dict, warn: Callable[[str], None]):
        self._namespace = namespace
        self._warn = warn
        self._applied: dict[str, Fix] = {}

    @property
    def ids(self) -> list[str]:
        return sorted(self._applied)

    def fixes(self) -> list[Fix]:
        """The applied fixes, in the order of their ids."""
        return [self._applied[i] for i in self.ids]

    def apply(self, check_id: str, fix: Fix) -> None:
        """Apply the fix of `check_id`; raises FixError with nothing of it left applied."""
        fix.apply(self._namespace)
        self._applied[check_id] = fix

    def undo(self, check_id: str, *, keep_built: bool = False) -> list[str]:
        """Undo the fix of `check_id` (nothing when it is not applied); returns the notes on
        places the user rebound meanwhile, which keep the user's object. `keep_built`: as
        `Fix.undo`."""
        fix = self._applied.pop(check_id, None)
        notes = fix.undo(keep_built=keep_built) if fix is not None else []
        for note in notes:
            self._warn(note)
        return notes

    def revert_all(self) -> list[str]:
        """Undo every applied fix, the newest id first; notes as `undo`."""
        return [note for check_id in reversed(self.ids) for note in self.undo(check_id)]

    @contextmanager
    def lifted(self, warnings: list[str]) -> Iterator[None]:
        """No fix applied inside (a measurement's runs apply their own); each is applied
        again after, a failure to do so said in `warnings`. What a fix did to the objects
        the cell's complete run built stays on them throughout (`Fix.undo`), and goes with
        the fix where it cannot be applied again."""
        lifted = [(i, self._applied[i]) for i in self.ids]
        for check_id, _ in reversed(lifted):
            self.undo(check_id, keep_built=True)
        try:
            yield
        finally:
            for check_id, fix in lifted:
                try:
                    self.apply(check_id, fix)
                except FixError as error:
                    warnings.extend(fix.undo())
                    warnings.append(f"could not re-apply {check_id}: {error.reason}")


def solo_variants(fixable: list[str], variants: list[Variant]) -> list[Variant]:
    """The newest solo measurement of each fixable finding, in finding order."""
    newest = {tuple(v.fixes): v for v in variants}
    return [newest[(i,)] for i in fixable if (i,) in newest]


def wins(fixable: list[str], variants: list[Variant]) -> list[str]:
    """Fixes whose own newest measurement was clearly faster (its interval above 1, past
    the no-change band, without error) and left what the cell produced bit-identical:
    `--apply wins` never changes results silently (amp, tf32 and the like are applied
    by name)."""
    return [
        variant.fixes[0]
        for variant in solo_variants(fixable, variants)
        if variant.is_win and variant.numerics.verdict == "identical"
    ]


def recommended(fixable: list[str], variants: list[Variant]) -> list[str]:
    """Fixes whose own newest measurement was clearly faster with the same results: the
    same loss curve in a training cell (a changed loss never counts, however fast), else
    outputs identical or within the fix's stated tolerance (`Numerics.same_results`).
    What the combined row, `--apply all`, the code changes and Apply to notebook carry by
    default. Others are opt-in, their verdict beside them."""
    return [
        variant.fixes[0]
        for variant in solo_variants(fixable, variants)
        if variant.is_win and variant.numerics.same_results
    ]


def settled_without_win(variant: Variant) -> bool:
    """Measured, and no win to have: slower, or "no clear change" with an interval settled
    within the band (no `--budget` would tell more). Unsettled or failed: not known."""
    if variant.error or variant.speedup is None or variant.verdict is None:
        return False
    return variant.is_slower or (not variant.is_win and not variant.budget_to_tell_s)


def requested(apply: list[str], fixable: list[str], variants: list[Variant]) -> list[str]:
    """`--apply IDS|all|wins`, as fix ids found in this cell: ids as named, `all` the
    recommended fixes, `wins` the clear wins with identical results."""
    wanted = set(apply)
    if "wins" in wanted:
        wanted.update(wins(fixable, variants))
    if "all" in wanted:
        wanted.update(recommended(fixable, variants))
    return [i for i in fixable if i in wanted]
