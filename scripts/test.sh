#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
scripts/install_browser.sh
venv="${TTM_VENV:-.venv}"
export PATH="$PWD/$venv/bin:$PATH"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)/inductor}"
echo "==> ruff"
ruff check .
echo "==> pytest"
python -m pytest -m "not gpu" --durations=40 "$@"
