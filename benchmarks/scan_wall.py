"""The scan's wall-clock promise (issue 33): `scan --write --verify` at the default budget
waits at most 3 x the notebook's plain run + (budget + 15 s) per checked cell.

    python benchmarks/scan_wall.py [--notebook NB] [--budget S] [--json PATH]

Default notebook: the quickstart demo with its `%%perfcheck` line removed (copied with its
data module to a temporary folder). The plain run is timed first, in its own kernel
(`execute`, as the verify runs it); then the scan runs as a user runs it, through the CLI
in a subprocess. Prints a markdown table and writes JSON (default
benchmarks/results/scan_wall.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torchtune_magic.programs.execute import execute  # noqa: E402

DEFAULT_BUDGET = 20.0  # the magic's
PER_CELL_S = 15.0


def unmarked_copy(source: Path, folder: Path) -> Path:
    """`source` without its `%%perfcheck` lines, beside a copy of its folder's modules."""
    for module in source.parent.glob("*.py"):
        shutil.copy(module, folder)
    notebook = nbformat.read(source, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.source.startswith("%%perfcheck"):
            cell.source = cell.source.split("\n", 1)[1]
    path = folder / source.name
    nbformat.write(notebook, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebook", type=Path, default=REPO / "notebooks" / "01_quickstart.ipynb")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET)
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks/results/scan_wall.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scan-wall-") as scratch:
        folder = Path(scratch)
        path = unmarked_copy(args.notebook, folder)
        started = time.perf_counter()
        execute(nbformat.read(path, as_version=4), folder, kernel_name="python3", timeout=600)
        plain_s = time.perf_counter() - started
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "torchtune_magic", "scan", path.name, "--budget",
             f"{args.budget:g}", "--write", "opt.ipynb", "--verify", "--json", "scan.json"],
            cwd=folder, capture_output=True, text=True, check=False,
        )  # fmt: skip
        scan_s = time.perf_counter() - started
        data = json.loads((folder / "scan.json").read_text())
    checked = sum(c["checked"] for c in data["cells"])
    bound = 3 * plain_s + (args.budget + PER_CELL_S) * checked
    row = {
        "notebook": args.notebook.name,
        "budget_s": args.budget,
        "plain_s": round(plain_s, 1),
        "scan_s": round(scan_s, 1),
        "checked": checked,
        "bound_s": round(bound, 1),
        "within": scan_s <= bound,
        "exit_status": done.returncode,
        "optimized": data["optimized"],
        "verify": data["verify"],
    }
    print("| notebook | plain run s | scan --write --verify s | checked cells | bound s | within |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {row['notebook']} | {row['plain_s']} | {row['scan_s']} | {checked} | "
        f"{row['bound_s']} | {'yes' if row['within'] else 'no'} |"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
