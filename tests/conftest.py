"""Shared fixtures: real IPython shells and small real torch workloads."""

from __future__ import annotations

import os
from typing import Any

import pytest
from workloads import namespace_with

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.getcwd(), ".pytest-inductor"))


@pytest.fixture(scope="session")
def ipython_shell():
    """One real IPython InteractiveShell for the session (IPython allows one per process)."""
    from IPython.testing import globalipapp

    globalipapp.start_ipython()  # starts it once per process; later calls return None
    shell = globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "torchtune_magic")
    yield shell
    shell.run_line_magic("perfcheck", "revert")


@pytest.fixture
def ip(ipython_shell):
    """The shell with a clean user namespace and torch imported, per test."""
    ipython_shell.reset(new_session=False)
    ipython_shell.run_cell("import torch\nfrom torch import nn\ntorch.manual_seed(0)")
    yield ipython_shell
    ipython_shell.run_line_magic("perfcheck", "revert")


@pytest.fixture
def train_ns() -> dict[str, Any]:
    return namespace_with()
