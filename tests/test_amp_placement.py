"""`amp` autocasts the forward pass and the loss only: `backward()` and `optimizer.step()`
stay outside `torch.autocast`, in the code change and in the live fix, whatever shape the
training loop has; float16 adds the GradScaler's calls where they belong.

This CPU may lack native bf16 (then `amp` does not apply to it): these tests play a CPU
with AVX512-BF16 by its feature flags, and torch emulates bf16 where the hardware has none,
so everything still runs for real, slowly.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import pytest
import torch
from workloads import detected, namespace_with

from torchtune_magic.checks import precision
from torchtune_magic.checks.base import Detection
from torchtune_magic.probe import cpu

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                    nn.Linear(1024, 10))
opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
X, Y = torch.randn(256, 512), torch.randint(0, 10, (256,))
loader = DataLoader(TensorDataset(X, Y), batch_size=128)
"""
LOOPS = {
    "plain loop": """
        for _ in range(3):
            opt.zero_grad()
            out = mlp(X)
            loss = nn.functional.cross_entropy(out, Y)
            loss.backward()
            opt.step()
        """,
    "loop over a loader": """
        for epoch in range(2):
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(mlp(x), y)
                loss.backward()
                opt.step()
        """,
    "backward on the loss expression": """
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(mlp(X), Y).backward()
            opt.step()
        """,
    "closure for the optimizer": """
        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(mlp(X), Y)
            loss.backward()
            return loss
        for _ in range(3):
            opt.step(closure)
        """,
    "helper function, backward in an if": """
        def forward(batch):
            return mlp(batch)
        for step in range(3):
            logits = forward(X)
            loss = nn.functional.cross_entropy(logits, Y) / 2
            if step >= 0:
                loss.backward()
            opt.step()
            opt.zero_grad()
        """,
}


@pytest.fixture(autouse=True)
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU whose flags say AVX512-BF16."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))


def _amp(cell: str, ns: dict[str, Any], **options: Any) -> Detection:
    session = detected(cell, ns, checks="amp", **options)
    [detection] = session.detections
    return detection


def _autocast_blocks(tree: ast.Module) -> list[ast.With]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        and any(_callee(item.context_expr) == "torch.autocast" for item in node.items)
    ]


def _callee(node: ast.expr) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def _calls(node: ast.AST, attr: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
    ]


@pytest.mark.parametrize("shape", list(LOOPS))
def test_the_code_change_autocasts_forward_and_loss_never_backward_or_step(shape: str) -> None:
    ns = namespace_with(SETUP)
    cell = textwrap.dedent(LOOPS[shape])
    detection = _amp(cell, ns)
    fixed = detection.fixed_source
    assert fixed is not None and detection.finding.fixable
    diff = detection.finding.code_change.diff
    assert re.search(r'^\+\s*with torch\.autocast\("cpu", dtype=torch\.bfloat16\):$', diff, re.M)
    tree = ast.parse(fixed)
    [block] = _autocast_blocks(tree)
    inside = ast.Module(body=block.body, type_ignores=[])
    assert not _calls(inside, "backward") and not _calls(inside, "step"), fixed
    assert "cross_entropy" in ast.unparse(inside)  # the loss is computed under autocast
    assert _calls(tree, "backward") and _calls(tree, "step")  # still there, outside it
    before = [p.detach().clone() for p in ns["mlp"].parameters()]
    exec(fixed, ns)  # the changed cell runs, and trains
    assert any(not torch.equal(b, p) for b, p in zip(before, ns["mlp"].parameters(), strict=True))
    assert not torch.is_autocast_enabled("cpu")


def test_the_live_fix_autocasts_the_forward_and_never_backward_or_step() -> None:
    """Measured for real: during the amp runs the model's forward sees autocast on, its
    backward and the optimizer's step see it off, as in the code change."""
    ns = namespace_with(SETUP)
    seen: dict[str, set[bool]] = {"forward": set(), "backward": set(), "step": set()}

    def note(kind: str) -> Any:
        return lambda *args: seen[kind].add(torch.is_autocast_enabled("cpu"))

    mlp, opt = ns["mlp"], ns["opt"]
    mlp[2].register_forward_pre_hook(note("forward"))
    mlp[2].register_full_backward_pre_hook(note("backward"))
    opt.register_step_pre_hook(note("step"))
    cell = textwrap.dedent(LOOPS["plain loop"])
    session = detected(cell, ns, checks="amp", budget=3)
    report = session.measure()
    variant = report.variant_for(["amp"])
    assert variant.error is None and variant.numerics.verdict in ("close", "changed")
    assert seen == {"forward": {True, False}, "backward": {False}, "step": {False}}


def test_float16_code_change_scales_the_loss_and_steps_through_the_scaler() -> None:
    """The CUDA float16 variant's text (a GPU without bf16), from a CPU run's observation."""
    ns = namespace_with(SETUP)
    cell = textwrap.dedent(LOOPS["plain loop"]).replace(
        "    loss.backward()\n",
        "    loss.backward()\n    torch.nn.utils.clip_grad_norm_(mlp.parameters(), 1.0)\n",
    )
    session = detected(cell, ns, checks="amp")
    obs = session.observation
    obs.device = "cuda"  # the text only: nothing runs on a GPU here
    change = precision.amp_change(obs, precision.fp32_math(obs), torch.float16)
    assert change.shown == textwrap.dedent(
        """
        scaler = torch.amp.GradScaler("cuda")
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                out = mlp(X)
                loss = nn.functional.cross_entropy(out, Y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(mlp.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        """
    )
    assert change.elsewhere == []
    # the live fix runs the cell autocast only; its run context does the scaling
    assert "scaler" not in (change.run or "") and "torch.float16" in (change.run or "")


def test_a_helper_from_an_earlier_cell_gets_advice_and_its_model_forward_autocast() -> None:
    """Forward, loss and backward in a function of an earlier cell: the cell has nothing to
    wrap; the advice names the function, and the live fix runs the model's forward under
    autocast (as accelerate's mixed precision does), backward and step outside it."""
    ns = namespace_with(
        SETUP,
        """
def train_step(x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(mlp(x), y)
    loss.backward()
    opt.step()
""",
    )
    detection = _amp("for _ in range(3):\n    train_step(X, Y)\n", ns)
    [advice] = detection.finding.code_change.elsewhere
    assert advice.startswith("in train_step() (defined in an earlier cell), put the forward")
    assert detection.fixed_source is None
    fix = detection.fix
    mlp = ns["mlp"]
    fix.apply(ns)
    try:
        assert mlp(ns["X"]).dtype == torch.bfloat16
        assert not torch.is_autocast_enabled("cpu")
    finally:
        fix.undo()
    assert "forward" not in vars(mlp) and mlp(ns["X"]).dtype == torch.float32


LIGHTNING_SETUP = """
import pytorch_lightning as pl


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024),
                                 nn.GELU(), nn.Linear(1024, 10))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


lit = Classifier()
"""
FIT = """
trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(lit, loader)
"""


def test_lightning_gets_its_precision_setting_and_the_live_fix_autocasts_the_forward() -> None:
    """Lightning runs backward and the optimizer step itself: the change is the Trainer's
    own `precision="bf16-mixed"`; live, the model's forward runs under autocast (the
    Trainer reads its precision when it is built), backward and step outside it."""
    pytest.importorskip("pytorch_lightning")
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    ns = namespace_with(SETUP, LIGHTNING_SETUP)
    seen: dict[str, set[bool]] = {"forward": set(), "backward": set(), "step": set()}

    def note(kind: str) -> Any:
        return lambda *args: seen[kind].add(torch.is_autocast_enabled("cpu"))

    net = ns["lit"].net
    net[2].register_forward_pre_hook(note("forward"))
    net[2].register_full_backward_pre_hook(note("backward"))
    stepping = register_optimizer_step_pre_hook(note("step"))
    try:
        session = detected(FIT, ns, checks="amp", budget=3)
        [detection] = session.detections
        diff = detection.finding.code_change.diff
        assert 'enable_model_summary=False, precision="bf16-mixed")' in diff
        assert "torch.autocast" not in diff
        assert [label for _, label in detection.fix.models] == ["lit.net"]
        variant = session.measure().variant_for(["amp"])
    finally:
        stepping.remove()
    assert variant.error is None
    assert seen == {"forward": {True, False}, "backward": {False}, "step": {False}}
    assert "forward" not in vars(net)  # undone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_training_cell_gets_forward_and_loss_autocast_and_runs() -> None:
    ns = namespace_with(SETUP)
    ns["mlp"].cuda()  # its parameters keep their identity: `opt` steps them on the GPU
    ns["X"], ns["Y"] = ns["X"].cuda(), ns["Y"].cuda()
    detection = _amp(textwrap.dedent(LOOPS["plain loop"]), ns, device="cuda")
    fixed = detection.fixed_source
    tree = ast.parse(fixed)
    [block] = _autocast_blocks(tree)
    inside = ast.Module(body=block.body, type_ignores=[])
    assert not _calls(inside, "backward") and not _calls(inside, "step")
    if torch.cuda.is_bf16_supported():
        assert "dtype=torch.bfloat16" in fixed and "GradScaler" not in fixed
    else:
        assert 'scaler = torch.amp.GradScaler("cuda")' in fixed
        assert "scaler.scale(loss).backward()" in fixed and "scaler.step(opt)" in fixed
    exec(fixed, ns)
