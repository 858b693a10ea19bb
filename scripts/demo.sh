#!/usr/bin/env bash
# Set everything up on a fresh machine and run the demo: %%perfcheck on a real CPU workload,
# report printed and written (HTML + JSON) under demo-output/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh notebook
venv="${TTM_VENV:-.venv}"
export PATH="$PWD/$venv/bin:$PATH"
python -m torchtune_magic demo --html demo-output/report.html --json demo-output/report.json
