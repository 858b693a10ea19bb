"""fuse-pointwise: chains of elementwise ops found in the op stream, compiled where they live.

Only one test compiles for real (the measured one); the others check detection and the
live patch, which is lazy: torch.compile does its work on the first call.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from workloads import detected, namespace_with

import torchtune_magic
from torchtune_magic.session import Session

GELU_DEF = """
import torch
def new_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))
"""


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory: pytest.TempPathFactory):
    """A fresh inductor cache per test run: /tmp/torchinductor_root is shared by everyone."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def namespace(*setups: str) -> dict[str, Any]:
    return namespace_with(*setups)  # one exec per "earlier cell"


def finding(session: Session, check_id: str = "fuse-pointwise"):
    return next((d for d in session.detections if d.finding.id == check_id), None)


def test_compiling_a_function_from_an_earlier_cell_is_faster_with_compile_time_apart():
    ns = namespace(GELU_DEF, "x = torch.randn(256, 1024)")
    # the budget leaves room for the first compile (4-20 s on a CPU here): the fix is not
    # started where its first run could not end before the deadline
    report = torchtune_magic.perfcheck(
        "for _ in range(8):\n    y = new_gelu(x)\n", ns, checks="fuse-pointwise", budget=25
    )
    found = report.finding("fuse-pointwise")
    assert found is not None and found.fixable
    assert "new_gelu" in found.where and "earlier cell" in found.code_change.elsewhere[0]
    variant = report.variant_for(["fuse-pointwise"])
    assert variant.error is None
    # perfcheck's own verdict (its 99.8% interval clear of 1): 1.5-8.8x measured here, as
    # glibc's state decides how much page faulting the eager version pays
    assert variant.verdict == "faster", variant
    assert variant.one_time_s is not None and variant.one_time_s > 0.1  # compile, apart
    assert variant.break_even_runs is not None
    assert variant.numerics.verdict in ("identical", "close")
    assert ns["new_gelu"].__code__.co_name == "new_gelu"  # the original object is back
    assert not hasattr(ns["new_gelu"], "_torchdynamo_orig_callable")


def test_function_round_trips_by_identity():
    ns = namespace(GELU_DEF, "x = torch.randn(64, 512)")
    original = ns["new_gelu"]
    session = detected("for _ in range(20):\n    y = new_gelu(x)\n", ns)
    session.apply("fuse-pointwise")
    assert ns["new_gelu"] is not original
    session.undo("fuse-pointwise")
    assert ns["new_gelu"] is original


def test_fires_inside_a_user_module_and_compiles_the_model_in_place():
    ns = namespace(
        """
        import torch
        class Swishy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(64, 1024)  # the chain, not the matmul, dominates
            def forward(self, x):
                h = self.lin(x)
                return h * torch.sigmoid(1.702 * h) + 0.1 * torch.tanh(h) * h
        model = Swishy()
        x = torch.randn(256, 64)
        """
    )
    model = ns["model"]
    attributes = dict(vars(model))
    session = detected("with torch.no_grad():\n    for _ in range(20):\n        y = model(x)\n", ns)
    found = finding(session)
    assert found is not None and found.finding.where == "model"
    session.apply("fuse-pointwise")
    assert ns["model"] is model and model._compiled_call_impl is not None
    session.undo("fuse-pointwise")
    assert ns["model"] is model and model._compiled_call_impl is None
    assert vars(model) == attributes  # no attribute of ours left behind


def test_fires_behind_a_factory_closure_and_rebinds_the_closure():
    ns = namespace(
        """
        import torch
        def make_activation(alpha):
            def activation(x):
                return torch.exp(-alpha * x * x) * x + torch.sin(x) * alpha - x / 3.0
            return activation
        act = make_activation(0.5)
        x = torch.randn(128, 512)
        """
    )
    original = ns["act"]
    session = detected("for _ in range(20):\n    y = act(x)\n", ns)
    found = finding(session)
    assert found is not None and found.finding.where == "act"
    assert "factory" in found.finding.code_change.elsewhere[0]
    session.apply("fuse-pointwise")
    assert ns["act"] is not original
    session.undo("fuse-pointwise")
    assert ns["act"] is original


def test_a_method_of_a_plain_user_class_is_rebound_on_the_class():
    ns = namespace(
        """
        import torch
        class Scaler:
            def squash(self, x):
                return torch.tanh(x) * 2.0 + torch.sigmoid(x) - x * 0.5
        scaler = Scaler()
        x = torch.randn(128, 512)
        """
    )
    original = vars(ns["Scaler"])["squash"]
    session = detected("for _ in range(20):\n    y = scaler.squash(x)\n", ns)
    assert finding(session).finding.where == "Scaler.squash"
    session.apply("fuse-pointwise")
    assert vars(ns["Scaler"])["squash"] is not original
    session.undo("fuse-pointwise")
    assert vars(ns["Scaler"])["squash"] is original


def test_a_def_in_the_cell_itself_gets_the_decorator():
    ns = namespace("import torch\nx = torch.randn(128, 512)")
    cell = (
        "def f(x):\n"
        "    return torch.tanh(x) * x + torch.exp(-x) * 0.5\n"
        "for _ in range(20):\n"
        "    y = f(x)\n"
    )
    session = detected(cell, ns)
    found = finding(session)
    assert found is not None and found.fix is not None
    assert "@torch.compile\ndef f(x):" in found.fixed_source
    assert found.fix.edit_source(cell) == found.fixed_source


@pytest.mark.parametrize(
    "setup, cell",
    [
        (  # matmul-dominated
            "import torch\na = torch.randn(384, 384)\nb = torch.randn(384, 384)",
            "for _ in range(5):\n    c = torch.relu(a @ b) + 1.0\n",
        ),
        (  # conv-dominated, one activation per conv
            "import torch\nconv = torch.nn.Conv2d(16, 32, 3)\nimg = torch.randn(4, 16, 64, 64)",
            "with torch.no_grad():\n    for _ in range(3):\n        out = torch.relu(conv(img))\n",
        ),
    ],
)
def test_silent_on_cells_dominated_by_matmul_or_conv(setup: str, cell: str):
    assert finding(detected(cell, namespace(setup))) is None


def test_evidence_gives_the_share_and_the_details_name_the_chain():
    ns = namespace(GELU_DEF, "x = torch.randn(64, 512)")
    found = finding(detected("for _ in range(20):\n    y = new_gelu(x)\n", ns)).finding
    assert re.match(r"chains of elementwise ops took \d+% of the cell's time", found.evidence)
    assert "tanh" in found.details and "new_gelu" in found.details
    assert found.segment == "other"  # a function of the cell's, not a model's forward
    assert torch.is_tensor(ns["y"])
