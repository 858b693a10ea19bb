"""`pip install torchtune-magic` alone gives the live panel (issue 12 item 5).

A fresh venv with a Jupyter of its own (the kernel and nbclient, no ipywidgets) gets the
package with `pip install .`, no extras: its base dependencies bring IPython, ipywidgets
and anywidget, the wheel carries the labextension and the panel's ES module, and an
nbclient-executed %%perfcheck cell shows the live panel (the anywidget view, with the
report in its state), not the static fallback. The engine alone still imports none of
the front-end packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import checkout
import nbformat
import pytest
from checkout import run

from torchtune_magic.report import MIME_TYPE

REPO = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
FRONT_END = ("IPython", "ipywidgets", "anywidget")

SETUP = """\
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
X, Y = torch.randn(64, 16), torch.randn(64, 1)
"""
PERFCHECK = """\
%%perfcheck --budget 1
torch.autograd.set_detect_anomaly(True)
for step in range(3):
    opt.zero_grad(set_to_none=False)
    loss = ((model(X) - Y) ** 2).mean()
    loss.backward()
    opt.step()
torch.autograd.set_detect_anomaly(False)
"""
EXECUTE = """\
import sys
import nbformat
from nbclient import NotebookClient

nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, kernel_name="python3", store_widget_state=True, timeout=300).execute()
nbformat.write(nb, sys.argv[1])
"""


def test_the_engine_imports_no_front_end_package() -> None:
    """Rendering text and HTML reports needs no IPython, ipywidgets or anywidget either."""
    code = (
        "import sys, json, torchtune_magic\n"
        "from torchtune_magic.render import html, text\n"
        "from torchtune_magic.report import Report\n"
        f"r = Report.from_dict(json.load(open({str(REPO / 'tests/data/sample_report.json')!r})))\n"
        "text.render(r); html.render(r)\n"
        f"print([n for n in {FRONT_END!r} if n in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_pip_install_alone_gives_the_live_panel(tmp_path: Path) -> None:
    if shutil.which("node") is None:
        pytest.fail("nodejs is needed to build the labextension and the panel's ES module")
    clone = checkout.clone(tmp_path / "repo")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"PYTHONPATH", "VIRTUAL_ENV", "JUPYTER_PATH", "JUPYTER_DATA_DIR"}
    }
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
        VIRTUAL_ENV=str(venv),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        JUPYTER_DATA_DIR=str(tmp_path / "jupyter-data"),  # no user kernelspec in the way
    )
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # The user's Jupyter: a kernel and a way to run notebooks; no widget package at all.
    run([*pip, "torch==2.13.0", "numpy", "ipykernel", "nbclient", "nbformat"], env, clone, 600)
    check = "import importlib.util as u; print([n for n in ('ipywidgets', 'anywidget') if u.find_spec(n)])"  # noqa: E501
    assert run([python, "-c", check], env, clone, 60).strip() == "[]"

    run([*pip, "."], env, clone, timeout=900)  # no extras

    installed = venv / "share" / "jupyter" / "labextensions"
    for extension in ("torchtune-magic", "anywidget", "@jupyter-widgets/jupyterlab-manager"):
        assert (installed / extension / "package.json").is_file(), extension
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext torchtune_magic\n" + SETUP),
        nbformat.v4.new_code_cell(PERFCHECK),
    ]
    path = tmp_path / "run" / "panel.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    (tmp_path / "execute.py").write_text(EXECUTE)
    run([python, str(tmp_path / "execute.py"), str(path)], env, path.parent, timeout=600)

    saved = nbformat.read(path, as_version=4)
    outputs = saved.cells[1].outputs
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "no live panel" not in printed
    views = [o for o in outputs if WIDGET_VIEW in o.get("data", {})]
    reports = [o.data[MIME_TYPE] for o in outputs if MIME_TYPE in o.get("data", {})]
    assert len(views) == 1 and len(reports) == 1
    state = saved.metadata.widgets[WIDGET_STATE]["state"][views[0].data[WIDGET_VIEW]["model_id"]]
    assert state["model_name"] == "AnyModel"  # the anywidget panel, from the wheel's ES module
    panel = state["state"]
    assert "export" in panel["_esm"] and panel["attached"] and not panel["busy"]
    assert json.dumps(panel["report"], sort_keys=True) == json.dumps(reports[0], sort_keys=True)
