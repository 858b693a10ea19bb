"""`amp` for a cell that builds its model and optimizer and trains them through a function
of an earlier cell (issue 33): the cell's text has no forward to wrap, and every measuring
run builds a new model, so the fix gives autocast to the model each run builds, recognised
by where and in which order the run builds it, from its first call. With float16 the
optimizer the run builds steps through that run's GradScaler. Measured for real; after
the check the kernel is as after one plain run, with nothing of ours left on the model,
the optimizer or torch's constructors.

The CPU plays one with AVX512-BF16 by its feature flags (as in test_amp_placement.py):
torch emulates bf16 where the hardware has none, so everything still runs for real.
"""

from __future__ import annotations

import contextlib
import io
import math
import textwrap
from typing import Any

import pytest
import torch
from torch import nn
from workloads import detected, namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.cell.workload import Workload
from torchtune_magic.checks import precision
from torchtune_magic.kernel import fixes
from torchtune_magic.options import Options
from torchtune_magic.probe import cpu
from torchtune_magic.report import Report
from torchtune_magic.session import Session

HELPER = """
import torch
from torch import nn


def train(model, opt, steps):
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        note(out.dtype, model[-1].weight.grad.norm().item())
        opt.step()
    return loss
"""
CELL = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                      nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss = train(model, opt, 6)
"""
BUDGET_S = 15.0  # a loaded 2-core machine left 8 s too little for a first amp run


@pytest.fixture(autouse=True)
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU whose flags say AVX512-BF16, and no floor on amp's payoff (as `checked`)."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(precision, "CPU_MIN_MATH_SHARE", 0.0)
    monkeypatch.setattr(precision, "CPU_MIN_CALL_FLOPS", 0.0)


def _namespace(seen: list[tuple[torch.dtype, float]]) -> dict[str, Any]:
    """The earlier cell's `train` (each step's output dtype and gradient norm after
    backward go to `seen`)."""
    return namespace_with(HELPER, note=lambda *step: seen.append(step))


def _ours() -> dict[str, Any]:
    """What the fix patches while it runs, read now (torch.compile's guards may have
    replaced `nn.Module.__init__` earlier in the process: read before the check)."""
    return {
        "module init": nn.Module.__init__,
        "optimizer init": torch.optim.Optimizer.__init__,
        "backward": torch.Tensor.backward,
    }


def _plain_run() -> dict[str, Any]:
    namespace = _namespace([])
    exec(textwrap.dedent(CELL), namespace)
    return namespace


def _left_on(namespace: dict[str, Any]) -> list[str]:
    """Anything of the fix's still on the kernel's model and optimizer."""
    left = [
        f"{name}.forward" for name, m in namespace["model"].named_modules() if "forward" in vars(m)
    ]
    left += [name for name, m in namespace["model"].named_modules() if m._forward_pre_hooks]
    if "step" in vars(namespace["opt"]):
        left.append("opt.step")
    return left


@pytest.fixture(scope="module")
def checked() -> tuple[Report, dict[str, Any], dict[str, Any], dict[str, Any], list[Any]]:
    """The report, the namespace after the check, a plain run's, what we patch, read
    before the check, and the steps the check's runs took."""
    seen: list[tuple[torch.dtype, float]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
        # whether amp pays off on a CPU (the matmul share and size, measured: in a full
        # run's process the share read under the floor once) is not what this file tests
        patch.setattr(precision, "CPU_MIN_MATH_SHARE", 0.0)
        patch.setattr(precision, "CPU_MIN_CALL_FLOPS", 0.0)
        namespace, before = _namespace(seen), _ours()
        with contextlib.redirect_stdout(io.StringIO()):
            report = perfcheck(CELL, namespace, budget=BUDGET_S, checks="amp")
    return report, namespace, _plain_run(), before, seen


def test_amp_is_measured_on_the_model_each_run_builds(checked) -> None:
    report, *_, seen = checked
    finding = next(f for f in report.findings if f.id == "amp")
    assert finding.fixable, finding.details
    assert "not applied live" not in (finding.details or "")
    variant = report.variant_for(["amp"])
    assert variant.error is None
    assert variant.speedup is not None and variant.rounds, variant
    # bfloat16 reached each run's model: its results differ, within amp's tolerance
    assert variant.numerics.verdict == "close", variant.numerics
    assert {dtype for dtype, _ in seen} == {torch.float32, torch.bfloat16}


def test_the_kernel_is_as_after_one_plain_run_with_nothing_of_ours_left(checked) -> None:
    _, namespace, plain, before, _ = checked
    state, plain_state = namespace["model"].state_dict(), plain["model"].state_dict()
    assert list(state) == list(plain_state)
    for key, value in plain_state.items():
        assert torch.equal(state[key], value), key
    assert torch.equal(namespace["loss"], plain["loss"])
    assert _left_on(namespace) == []
    assert _ours() == before
    assert namespace["model"](torch.randn(2, 512)).dtype == torch.float32


def test_apply_leaves_autocast_on_the_model_the_complete_run_built_until_reverted() -> None:
    """`--apply amp`: the kernel's model (the cell's complete run built it) runs its forward
    under autocast, as the report says; Revert all takes it off."""
    namespace, before = _namespace([]), _ours()
    options = Options.build(budget=3.0, checks="amp", apply="amp")
    session = Session(Workload(textwrap.dedent(CELL), namespace), options)
    with contextlib.redirect_stdout(io.StringIO()):
        report = session.run()
    assert report.applied == ["amp"], (report.applied, report.warnings)
    model, x = namespace["model"], torch.randn(2, 512)
    assert model(x).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")  # only inside the model's forward
    assert _ours() == before  # the constructors are torch's again once the run is over
    session.revert_all()
    assert model(x).dtype == torch.float32
    assert _left_on(namespace) == [] and _ours() == before


def test_float16_training_steps_the_optimizer_the_run_builds_through_its_grad_scaler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU without bf16 trains in float16 with a GradScaler, played on this CPU (autocast
    and GradScaler run float16 on CPUs too; far slower than float32 here, so one run with
    the fix rather than a measurement): the loss reaching backward is scaled (gradients
    thousands of times a plain run's) and the optimizer the run built unscales them before
    stepping (its steps move the weights as a plain run's do); the model's first call in
    the run is already autocast; after, nothing is left."""
    monkeypatch.setattr(precision, "_amp_dtype", lambda device: torch.float16)
    plain_seen: list[tuple[torch.dtype, float]] = []
    plain = _namespace(plain_seen)
    exec(textwrap.dedent(CELL), plain)
    built = _namespace([])
    exec(textwrap.dedent(CELL).split("opt =")[0], built)  # the model before training
    start = list(built["model"].parameters())
    seen: list[tuple[torch.dtype, float]] = []
    namespace, before = _namespace(seen), _ours()
    session = detected(CELL, namespace, checks="amp")
    [detection] = session.detections
    fix = detection.fix
    assert fix is not None and "GradScaler" in (detection.finding.details or "")
    seen.clear()
    cell = compile(textwrap.dedent(CELL), session.workload.filename, "exec")
    with fixes.applied([fix], namespace), fix.run_context(namespace):
        exec(cell, namespace)  # a run of the cell as the measuring runs make it
    assert [dtype for dtype, _ in seen] == [torch.float16] * 6, seen
    # a step whose scaled gradients overflowed float16 is skipped, as GradScaler does
    finite = [norm for _, norm in seen if math.isfinite(norm)]
    assert len(finite) >= 3, seen
    assert min(finite) > 1000 * max(norm for _, norm in plain_seen), (seen, plain_seen)
    for name, p0, scaled, unscaled in zip(
        [n for n, _ in plain["model"].named_parameters()],
        start,
        namespace["model"].parameters(),
        plain["model"].parameters(),
        strict=True,
    ):
        moved, plain_moved = (scaled - p0).norm(), (unscaled - p0).norm()
        assert moved < 2 * plain_moved, name
    assert _left_on(namespace) == [] and _ours() == before
