"""A fix never overwrites the user's names, and the saved report follows the applied state.

After a run the user keeps working: they may rebind `loader` to a DataLoader of their own.
Applying a fix then must refuse (it would replace their loader by a rebuilt copy of the old
one), and undo must never put the old object back over theirs: through the Session (the
panel's toggles and Revert all call it), `%perfcheck revert` and `--apply`. Every apply,
undo and revert publishes the report with the current `applied` list.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from workloads import detected, namespace_with

from torchtune_magic.cell.workload import Workload
from torchtune_magic.checks.optimizer import FusedOptimizerFix
from torchtune_magic.kernel.discovery import Location, Step
from torchtune_magic.kernel.fixes import FixError, Patcher, Rebound
from torchtune_magic.options import Options
from torchtune_magic.report import Report
from torchtune_magic.session import Session

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from tests.slow_data import SlowDataset
torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(SlowDataset(48, delay_s=0.002), batch_size=8)
"""
TRAIN = """for x, y in loader:
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
REFUSED = (
    "`loader` was rebound since the probe ran: re-run %%perfcheck on the cell to check the "
    "new object"
)
LEFT = (
    "dataloader-workers: `loader` was rebound while the fix was applied: your new object "
    "stays there (the one from before the fix was not put back)"
)


def _measured(ns: dict, reports: list[Report], **options: object) -> Session:
    options = {"checks": "dataloader-workers", "budget": 1, **options}
    session = Session(Workload(TRAIN, ns), Options.build(**options), on_report=reports.append)
    session.run()
    return session


def _users_loader(ns: dict) -> DataLoader:
    """What the user does after the run: a loader of their own under the same name."""
    mine = DataLoader(ns["loader"].dataset, batch_size=8, num_workers=2)
    ns["loader"] = mine
    return mine


def test_a_rebound_loader_refuses_its_fix_and_stays_the_users_after_revert_all():
    ns = namespace_with(SETUP)
    reports: list[Report] = []
    session = _measured(ns, reports)
    assert session.report.finding("dataloader-workers").fixable
    mine = _users_loader(ns)

    with pytest.raises(FixError) as refused:
        session.apply("dataloader-workers")
    assert refused.value.reason == REFUSED
    assert ns["loader"] is mine and session.applied_ids == []
    session.revert_all()
    assert ns["loader"] is mine and mine.num_workers == 2


def test_undo_leaves_a_loader_the_user_bound_while_the_fix_was_applied(tmp_path: Path):
    ns = namespace_with(SETUP)
    original = ns["loader"]
    reports: list[Report] = []
    saved = tmp_path / "report.json"
    session = _measured(ns, reports, json=saved)

    session.apply("dataloader-workers")
    rebuilt = ns["loader"]
    assert rebuilt is not original and rebuilt.num_workers > 0
    assert reports[-1].applied == ["dataloader-workers"]  # the saved report follows at once
    assert json.loads(saved.read_text())["applied"] == ["dataloader-workers"]

    mine = _users_loader(ns)
    notes = session.revert_all()
    assert ns["loader"] is mine  # never the old num_workers=0 loader over theirs
    assert notes == [LEFT]
    assert reports[-1].applied == [] and LEFT in reports[-1].warnings
    assert json.loads(saved.read_text())["applied"] == []

    # their own loader is theirs to use; the fix can no longer be applied over it
    with pytest.raises(FixError, match="was rebound since the probe ran"):
        session.apply("dataloader-workers")
    assert ns["loader"] is mine


def test_each_toggle_publishes_the_applied_state_and_undo_is_exact():
    ns = namespace_with(SETUP)
    original = ns["loader"]
    reports: list[Report] = []
    session = _measured(ns, reports)
    published = len(reports)

    session.apply("dataloader-workers")
    session.undo("dataloader-workers")
    session.apply("dataloader-workers")
    session.revert_all()
    assert [r.applied for r in reports[published:]] == [
        ["dataloader-workers"],
        [],
        ["dataloader-workers"],
        [],
    ]
    assert all(r.phase == "done" for r in reports[published:])
    # every earlier measurement stays in each of those reports
    assert all(r.variants == reports[published - 1].variants for r in reports[published:])
    assert ns["loader"] is original and LEFT not in reports[-1].warnings


def test_a_model_rebound_after_the_probe_keeps_its_convs_and_the_old_one_is_untouched():
    ns = namespace_with(
        """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
X = torch.randn(4, 3, 16, 16)
"""
    )
    session = detected("y = model(X)\n", ns, checks="conv-bias-bn")
    old_conv = ns["model"][0]
    ns["model"] = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    with pytest.raises(FixError) as refused:
        session.apply("conv-bias-bn")
    assert refused.value.reason.startswith("`model` was rebound since the probe ran")
    assert old_conv.bias is not None and ns["model"][0].bias is not None


def test_magic_revert_and_apply_never_clobber_a_rebound_loader(ip, capsys):
    ip.run_cell(SETUP)
    result = ip.run_cell(
        "%%perfcheck -q --budget 1 --checks dataloader-workers --apply dataloader-workers\n" + TRAIN
    )
    assert result.error_in_exec is None
    assert ip.user_ns["loader"].num_workers > 0  # applied by --apply
    ip.run_cell("loader = DataLoader(loader.dataset, batch_size=8, num_workers=2)")
    mine = ip.user_ns["loader"]
    capsys.readouterr()
    ip.run_line_magic("perfcheck", "revert")
    shown = capsys.readouterr().out
    assert "reverted: dataloader-workers" in shown
    assert f"left as you rebound it: {LEFT}" in shown
    assert ip.user_ns["loader"] is mine

    # the cell itself rebinds `loader` at its end: --apply must not replace that loader
    ip.run_cell("loader = DataLoader(SlowDataset(48, delay_s=0.002), batch_size=8)")
    report = ip.run_cell(
        "%%perfcheck -o -q --budget 1 --checks dataloader-workers --apply dataloader-workers\n"
        + TRAIN
        + "loader = DataLoader(loader.dataset, batch_size=4)\n"
    ).result
    assert f"--apply dataloader-workers: not applied: {REFUSED}" in report.warnings
    assert report.applied == []
    assert ip.user_ns["loader"].batch_size == 4 and ip.user_ns["loader"].num_workers == 0


def test_patcher_refuses_a_moved_place_and_undo_keeps_newer_objects():
    first, theirs = object(), object()
    namespace = {"opt": first}
    place = Location((Step("name", "opt"),))
    patcher = Patcher()
    patcher.rebind(namespace, place, first, "ours")
    namespace["opt"] = theirs
    patcher.undo()
    assert namespace["opt"] is theirs
    assert patcher.notes == [
        "`opt` was rebound while the fix was applied: your new object stays there "
        "(the one from before the fix was not put back)"
    ]
    with pytest.raises(Rebound, match="`opt` was rebound since the probe ran"):
        Patcher().rebind(namespace, place, first, "ours")
    del namespace["opt"]
    with pytest.raises(Rebound, match="`opt` is gone since the probe ran"):
        Patcher().rebind(namespace, place, first, "ours")

    block = nn.Linear(2, 2)
    patcher = Patcher()
    patcher.assign(block, "forward", "ours", "model.0.forward")
    block.forward = lambda x: x  # the user's own forward, set while the fix was on
    mine = block.forward
    patcher.undo()
    assert block.forward is mine and "`model.0.forward` was rebound" in patcher.notes[0]

    names = {"gradcheck": "torch's"}
    patcher = Patcher()
    patcher.setitem(names, "gradcheck", "ours")
    names["gradcheck"] = "the cell's own"
    patcher.undo()
    assert names["gradcheck"] == "the cell's own"


def test_the_fused_optimizer_swap_refuses_a_rebound_name_and_undo_keeps_the_users():
    """`fused-optimizer` is a CUDA check; its swap is the same on a CPU optimizer (torch
    fuses SGD on CPU too), so the guard is exercised here on real objects."""
    ns = namespace_with()
    opt, sched = ns["opt"], ns["sched"]
    place = Location((Step("name", "opt"),))
    fix = FusedOptimizerFix(opt, [place], [sched])
    fix.seen = [(place, opt)]
    fix.apply(ns)
    fused = ns["opt"]
    assert fused is not opt and fused.param_groups[0]["fused"] and sched.optimizer is fused
    mine = torch.optim.SGD(ns["model"].parameters(), lr=0.1)
    ns["opt"] = mine
    assert fix.undo() == [
        "fused-optimizer: `opt` was rebound while the fix was applied: your new object stays "
        "there (the one from before the fix was not put back)"
    ]
    assert ns["opt"] is mine and sched.optimizer is opt
    with pytest.raises(FixError, match="`opt` was rebound since the probe ran"):
        fix.apply(ns)
    assert ns["opt"] is mine and not fix.applied


GUARDED = {
    "zero-grad-none": (
        "import torch\nfrom torch import nn\nmodel = nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nx = torch.randn(8, 4)\n",
        "for _ in range(3):\n    opt.zero_grad(set_to_none=False)\n"
        "    model(x).sum().backward()\n    opt.step()\n",
        "opt",
    ),
    "channels-last": (
        "import torch\nfrom torch import nn\n"
        "net = nn.Sequential(*[nn.Conv2d(16, 16, 3, padding=1) for _ in range(4)]).eval()\n"
        "images = torch.randn(8, 16, 48, 48)\n",
        "with torch.no_grad():\n    out = net(images)\n",
        "net",
    ),
    "fuse-pointwise": (
        "import torch\ndef act(x):\n"
        "    return torch.exp(-0.5 * x * x) * x + torch.sin(x) * 0.5 - x / 3.0\n"
        "z = torch.randn(512, 1024)\n",
        "for _ in range(5):\n    y = act(z)\n",
        "act",
    ),
}


@pytest.mark.parametrize("check_id", sorted(GUARDED))
def test_every_fix_refuses_an_object_rebound_since_the_probe(check_id: str) -> None:
    setup, cell, name = GUARDED[check_id]
    ns = namespace_with(setup)
    session = detected(cell, ns, checks=check_id)
    assert session.fixable, f"{check_id} did not fire"
    ns[name] = replacement = object()  # the user rebound the name after the run
    with pytest.raises(FixError, match=f"`{name}` was rebound since the probe ran"):
        session.apply(check_id)
    assert ns[name] is replacement and session.applied_ids == []
