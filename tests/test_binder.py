"""Binder builds from `binder/` alone: a fresh environment, `postBuild`, the three notebooks.

There is no conda here, so the conda-forge packages of `binder/environment.yml` become pip
requirements through an explicit map (an unknown package fails the test: add it to the map
deliberately). The repository is copied as Binder clones it (tracked and new files, nothing
ignored: no built extension, no node_modules), so `postBuild` must build the extension.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import checkout
import nbformat
import pytest
import yaml
from checkout import run

from torchtune_magic.report import MIME_TYPE

REPO = Path(__file__).resolve().parents[1]
BINDER = REPO / "binder"
# conda-forge name -> pip requirement, or None: provided by the machine itself.
CONDA_TO_PIP: dict[str, str | None] = {
    "python": None,  # the venv's own interpreter
    "pip": None,
    "nodejs": None,  # node is on the machine (checked below)
    "pytorch-cpu": "torch==2.13.0",  # the CPU wheel on these machines
    "numpy": "numpy",
    "jupyterlab": "jupyterlab",
    "ipywidgets": "ipywidgets",
}
OPENED = Path("notebooks") / "01_quickstart.ipynb"  # the badge's labpath


def pip_requirements(environment: dict) -> list[str]:
    """The environment's packages as pip requirements (conda's `name>=v` is pip syntax too;
    `name=v` pins become `name==v`)."""
    requirements = []
    for entry in environment["dependencies"]:
        if isinstance(entry, dict):
            requirements.extend(entry.get("pip", []))
            continue
        name, spec = entry, ""
        for operator in (">=", "<=", "==", "="):
            if operator in entry:
                name, version = entry.split(operator, 1)
                spec = ("==" if operator == "=" else operator) + version
                break
        if name not in CONDA_TO_PIP:
            raise AssertionError(f"binder/environment.yml: no pip name for {name!r}; map it")
        requirement = CONDA_TO_PIP[name]
        if requirement is None:
            continue
        if spec and "==" not in requirement:  # a pin in the map wins over a conda range
            requirement += spec
        requirements.append(requirement)
    return requirements


def test_environment_maps_to_pip() -> None:
    environment = yaml.safe_load((BINDER / "environment.yml").read_text())
    assert environment["channels"] == ["conda-forge"]
    assert pip_requirements(environment)[:4] == [
        "torch==2.13.0",
        "numpy",
        "jupyterlab>=4",
        "ipywidgets>=8",
    ]


def test_binder_files_name_no_registry_host() -> None:
    for path in BINDER.iterdir():
        text = path.read_text().lower()
        assert "http" not in text and "index-url" not in text and "registry" not in text, path


def test_fresh_binder_environment_runs_the_notebook_binder_opens(tmp_path: Path) -> None:
    """Binder's own install (environment.yml, postBuild) into a fresh environment, and the
    notebook the badge opens run there with its report. Every demo notebook runs in the
    development environment (test_notebooks.py); here the install is what is tested."""
    if shutil.which("node") is None:
        pytest.fail("nodejs is needed (Binder gets it from conda-forge): install node")
    clone = checkout.clone(tmp_path / "repo")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
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
    environment = yaml.safe_load((BINDER / "environment.yml").read_text())
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    run([*pip, *pip_requirements(environment)], env, clone, timeout=600)
    run(["bash", str(clone / "binder" / "postBuild")], env, clone, timeout=600)

    shared = venv / "share" / "jupyter"
    assert (shared / "labextensions" / "torchtune-magic" / "package.json").is_file()
    assert (shared / "lab" / "settings" / "overrides.json").is_file()
    kernel = run(
        [
            str(python),
            "-c",
            "from jupyter_client.kernelspec import get_kernel_spec as g;"
            "import shutil; print(shutil.which(g('python3').argv[0]))",
        ],
        env,
        clone,
        timeout=60,
    )
    assert Path(kernel.strip()).parent == venv / "bin"

    # Installed, not imported from the clone: run from outside it.
    executed = tmp_path / "executed" / OPENED.name
    command = [str(python), "-m", "torchtune_magic", "run", str(clone / OPENED)]
    run([*command, "--output", str(executed)], env, tmp_path, timeout=600)
    saved = nbformat.read(executed, as_version=4)
    outputs = [o for c in saved.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(MIME_TYPE in o.get("data", {}) for o in outputs)
