#!/usr/bin/env bash
# Set everything up on a fresh machine and run the demo: the quickstart notebook executed
# headless, its %%perfcheck report printed and written under demo-output/ (JSON per report,
# one HTML page, and the executed notebook to open in JupyterLab).
# (`python -m torchtune_magic demo` still runs a built-in cell without a notebook.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh notebook
venv="${TTM_VENV:-.venv}"
export PATH="$PWD/$venv/bin:$PATH"
python -m torchtune_magic run notebooks/01_quickstart.ipynb \
    --json demo-output --html demo-output/report.html \
    --output demo-output/01_quickstart.ipynb

# The same notebook unmarked, as most notebooks are: `scan` executes it, finds the training
# cells itself, checks each in place, writes an optimized copy and re-runs both to prove it.
mkdir -p demo-output/scan
cp notebooks/demo_data.py demo-output/scan/
python - <<'PY'
import nbformat

notebook = nbformat.read("notebooks/01_quickstart.ipynb", as_version=4)
for cell in notebook.cells:
    if cell.cell_type == "code" and cell.source.startswith("%%perfcheck"):
        cell.source = cell.source.split("\n", 1)[1]
nbformat.write(notebook, "demo-output/scan/01_quickstart.ipynb")
PY
python -m torchtune_magic scan demo-output/scan/01_quickstart.ipynb \
    --write demo-output/scan/01_quickstart-optimized.ipynb --verify \
    --json demo-output/scan/scan.json --html demo-output/scan/scan.html \
    || echo "scan exited $?: a cell raised or the verify found a difference (listed above)"
