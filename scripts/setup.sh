#!/usr/bin/env bash
# Create (or reuse) the project venv and install everything the demo and tests need.
# Usage: scripts/setup.sh [extras]   (default extras: notebook)
# Installs the CPU build of torch 2.13.0 only when the venv has no importable torch,
# and leaves an existing torch alone. The JupyterLab extension is built by the package's
# build hook (jlpm through hatch-jupyter-builder) during `pip install`.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-notebook}"
venv="${TTM_VENV:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "==> creating $venv"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "==> installing torch 2.13.0 (CPU build)"
    "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" numpy hatchling hatch-jupyter-builder jupyter_builder editables
# The build hook needs jlpm (from jupyter_builder) on PATH.
export PATH="$PWD/$venv/bin:$PATH"
echo "==> installing torchtune-magic[$extras] (builds the JupyterLab extension)"
"${pip[@]}" --no-build-isolation -e ".[$extras]"
