"""Where a flagged loader lives and how a fix can reach it: the notebook names that hold
it (rebound live), its constructor call in the cell (edited in the text), the earlier cell
that built it, or the Hugging Face Trainer that builds it from its arguments; and why a
live fix cannot reach it, when it cannot."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...cell import codeedit, history
from ...kernel import trainers
from ...probe import frameworks
from .edits import POSITIONAL, class_names

if TYPE_CHECKING:
    from ...kernel.discovery import Location
    from ...probe.observation import LoaderUse, Observation


@dataclass
class Target:
    """Where a loader lives and how a fix can reach it."""

    use: LoaderUse
    name: str
    locations: list[Location]
    cell_call: ast.Call | None  # its constructor call in the cell, if built there
    unreachable: str | None  # why a live fix cannot reach it, if it cannot
    # a Hugging Face Trainer from an earlier cell that builds the loader from its arguments
    # on each call (`trainer.train()`): fixes go through those arguments
    trainer: trainers.HFTrainer | None = None


def locate(obs: Observation, use: LoaderUse) -> Target:
    """Where the loader of `use` lives and how a fix can reach it."""
    loader = use.loader
    locations = obs.lasting_locations(loader)
    name = str(locations[0]) if locations else f"a {type(loader).__name__}"
    cell_call = None
    unreachable = None
    if use.built_in_cell:
        if use.built_line is not None:
            cell_call = codeedit.call_at(obs.tree, use.built_line, class_names(loader))
        owner = None
        if cell_call is None:
            owner = frameworks.hf_owner(obs.workload.namespace, obs.names_before, loader)
        if owner is not None:
            name = f"the DataLoader {owner.name} builds from {owner.name}.args (Hugging Face)"
            return Target(use, name, [], None, None, owner)
        if cell_call is None:
            where = f" at cell line {use.built_line}" if use.built_line else ""
            unreachable = (
                f"the loader is built by code the cell calls{where}, so every run makes a "
                "new one: change that constructor"
            )
    elif not locations:
        unreachable = "no notebook name reaches the loader, so it cannot be swapped"
    elif not all(location.rebindable for location in locations):
        unreachable = (
            "the loader is held as a local variable of a running generator, which cannot be "
            "rebound from outside: change its constructor and restart the generator"
        )
    return Target(use, name, locations, cell_call, unreachable)


def earlier_edit(
    obs: Observation, target: Target, values: dict[str, str]
) -> history.CallEdit | None:
    """The loader's constructor call in the earlier cell that built it, given `values`."""
    for location in target.locations:
        path = history.location_path(location)
        if path is None:
            continue
        workload = obs.workload
        edit = history.keyword_edit(workload.notebook, workload.namespace, path, values, POSITIONAL)
        if edit is not None:
            return edit
    return None
