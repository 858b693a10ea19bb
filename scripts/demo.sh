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
