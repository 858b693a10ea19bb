"""perfcheck's own failures never fail the cell (issue 28, item 2).

A failure is injected into each part of perfcheck's machinery after the probe (the whole
detection, one check, a code change, measuring, numerics), the cell is checked through the
Python API, and a user would see: the cell's own output once, a report that names the part
that failed with a one-line reason and a traceback, every other finding and number, and a
namespace exactly as after one plain run of the cell. Rendering and the live panel are
tested in a real kernel in `test_own_failures_kernel.py`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from workloads import namespace_with

from torchtune_magic import perfcheck
from torchtune_magic import session as session_module
from torchtune_magic.checks import autograd, cellchanges, registry
from torchtune_magic.measuring import numerics
from torchtune_magic.measuring.runs import Runs
from torchtune_magic.render import html, text

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from slow_data import SlowDataset
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(SlowDataset(n=48, delay_s=0.004), batch_size=8)
losses = []
"""

CELL = """
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
print(f"final loss {losses[-1]:.6f} after {len(losses)} steps")
"""


def _boom(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("injected failure\nsecond line not shown")


def _failing_for(check_id: str) -> Callable[..., None]:
    """`attach_cell_changes` that fails for one finding's code change only."""
    real = cellchanges.attach_cell_changes

    def attach(workload: Any, detections: list[Any]) -> None:
        if any(d.finding.id == check_id for d in detections):
            _boom()
        real(workload, detections)

    return attach


# part -> (what to break, the failure's part name, findings still expected)
INJECTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str, set[str]]] = {
    "detection": (
        # the session's view of the registry (options still parse with the real one)
        lambda mp: mp.setattr(
            session_module,
            "registry",
            SimpleNamespace(all_checks=_boom, without_win=registry.without_win),
        ),
        "detection",
        set(),
    ),
    "a check": (
        lambda mp: mp.setattr(autograd.ZeroGradNoneCheck, "detect", _boom),
        "check zero-grad-none",
        {"dataloader-workers"},
    ),
    "a code change": (
        lambda mp: mp.setattr(
            cellchanges, "attach_cell_changes", _failing_for("zero-grad-none")
        ),
        "code change for zero-grad-none",
        {"dataloader-workers", "zero-grad-none"},
    ),
    "measuring": (
        lambda mp: mp.setattr(Runs, "measure", _boom),
        "measuring",
        {"dataloader-workers", "zero-grad-none"},
    ),
    "numerics": (
        lambda mp: mp.setattr(numerics, "compare", _boom),
        "numerics",
        {"dataloader-workers", "zero-grad-none"},
    ),
}


def _plain_run() -> tuple[dict[str, Any], str]:
    """The namespace after the setup and one plain run of the cell, and what it printed."""
    import contextlib
    import io

    ns = namespace_with(SETUP)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(textwrap.dedent(CELL), ns)
    return ns, printed.getvalue()


@pytest.mark.parametrize("part", list(INJECTED))
def test_a_failure_of_ours_is_contained_at_its_part(
    part: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plain_ns, plain_printed = _plain_run()
    capsys.readouterr()
    inject, part_name, still_found = INJECTED[part]
    ns = namespace_with(SETUP)
    inject(monkeypatch)

    report = perfcheck(
        textwrap.dedent(CELL), ns, budget=8, skip="cpu-threads,cpu-allocator,fuse-pointwise"
    )

    # the cell's own output, once, as a plain run prints it
    assert capsys.readouterr().out == plain_printed
    # the report names the part, with a one-line reason and perfcheck's traceback
    failed = [f for f in report.failures if f.part == part_name]
    assert failed, f"no failure under {part_name!r}: {report.failures}"
    assert failed[0].reason == "RuntimeError: injected failure"
    assert "injected failure" in failed[0].traceback and "Traceback" in failed[0].traceback
    assert {f.part for f in report.failures} == {part_name}
    # every other finding still comes, and the numbers a working part gives
    assert {f.id for f in report.findings} >= still_found
    if part == "measuring":
        assert report.variants == []
    elif still_found:  # measuring went on: timed, or out of time with what would tell
        assert report.baseline.median_s is not None, report.warnings
        assert {v.fixes[0] for v in report.variants} >= still_found
        assert all(
            v.speedup is not None or v.budget_to_tell_s or v.at_most is not None
            for v in report.variants
        )
    if part == "numerics":
        assert all(v.numerics.verdict == "not-compared" for v in report.variants)
    # every view says so
    assert f"{part_name} failed: RuntimeError: injected failure" in text.render(report)
    assert f"{part_name} failed: RuntimeError: injected failure" in html.render(report)
    # JSON round trip keeps it (schema v1, optional field)
    again = type(report).from_dict(report.to_dict())
    assert again.failures == report.failures
    # the kernel as after one plain run of the cell
    assert ns["losses"] == plain_ns["losses"]
    for mine, plain in zip(
        ns["model"].state_dict().values(), plain_ns["model"].state_dict().values(), strict=True
    ):
        assert torch.equal(mine, plain)
    assert ns["loader"].num_workers == 0, "no fix left applied"
