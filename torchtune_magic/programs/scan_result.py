"""What a scan found, as plain values, and its JSON (schema `torchtune-magic/scan/v1`,
`scan.schema.json`): the cells with why each was checked or passed over and the checked
cells' reports (report v1, exactly as the notebook's kernel published them), the optimized
copy's edits, and the verify's comparison."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..report import Report

SCAN_SCHEMA_ID = "torchtune-magic/scan/v1"


@dataclass
class ScannedCell:
    """One code cell: `index` its 1-based position (markdown included, the runner's
    cell<N>), `seconds` its time in the plain run, `report` the checked cell's report."""

    index: int
    checked: bool
    seconds: float | None
    why: str
    source: str = ""
    report: dict[str, Any] | None = None

    @property
    def parsed_report(self) -> Report | None:
        return Report.from_dict(self.report) if self.report else None


@dataclass
class Edit:
    """A cell of the optimized copy and the fixes whose code changes it carries."""

    index: int
    fixes: list[str]


@dataclass
class Optimized:
    path: str | None  # None: built for --verify only, not written
    edits: list[Edit]


@dataclass
class Difference:
    """The first line that differs between the original's and the copy's outputs."""

    index: int
    line: str


@dataclass
class Verification:
    """Original and optimized, executed plainly in alternation, `runs` times each."""

    runs: int
    original_s: float
    optimized_s: float
    cells_compared: int
    cells_same: int
    masked: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    # per code cell: (original seconds, optimized seconds), medians over the runs
    cell_seconds: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        return self.original_s / self.optimized_s if self.optimized_s > 0 else None


@dataclass
class CellFailure:
    """The first cell that raised: named, and where the scan stopped unless told to go on."""

    index: int
    error: str  # "ValueError: ..."


@dataclass
class ScanResult:
    notebook: str
    cells: list[ScannedCell]
    plain_s: float | None = None  # the first plain run's cells, added
    failure: CellFailure | None = None
    stopped: bool = False  # the scan stopped at `failure` (no --allow-errors)
    optimized: Optimized | None = None
    verification: Verification | None = None
    notes: list[str] = field(default_factory=list)  # what a reader must know (said, not hidden)

    @property
    def checked(self) -> list[ScannedCell]:
        return [c for c in self.cells if c.checked]

    def to_dict(self) -> dict[str, Any]:
        optimized = self.optimized
        verify = self.verification
        return {
            "schema": SCAN_SCHEMA_ID,
            "notebook": self.notebook,
            "cells": [
                {
                    "index": c.index,
                    "checked": c.checked,
                    "seconds": c.seconds,
                    "why": c.why,
                    **({"report": c.report} if c.checked else {}),
                }
                for c in self.cells
            ],
            "optimized": None
            if optimized is None
            else {
                "path": optimized.path,
                "edits": [{"index": e.index, "fixes": e.fixes} for e in optimized.edits],
            },
            "verify": None
            if verify is None
            else {
                "runs": verify.runs,
                "original_s": verify.original_s,
                "optimized_s": verify.optimized_s,
                "speedup": verify.speedup,
                "cells_compared": verify.cells_compared,
                "cells_same": verify.cells_same,
                "masked": verify.masked,
                "differences": [{"index": d.index, "line": d.line} for d in verify.differences],
            },
        }

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path


def load_scan_schema() -> dict[str, Any]:
    """The shipped JSON Schema for `ScanResult.to_dict()`."""
    text = resources.files("torchtune_magic").joinpath("scan.schema.json").read_text()
    return json.loads(text)
