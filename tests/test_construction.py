"""Recognising the modules the checked code builds (`probe/construction`): the same key
for the same object in every run, one ordinal per object a loop builds at one call, nothing
for objects built elsewhere; and live fixes given to each run's new modules at their
model's first call, gone when the run's context ends."""

from __future__ import annotations

import textwrap

import torch
from torch import nn
from workloads import detected

from torchtune_magic.cell.workload import Workload
from torchtune_magic.checks import checkpointing, memory_format
from torchtune_magic.probe import construction


def _inits() -> tuple:
    """What construction goes through now: `nn.Module.__init__` (torch.compile's guards
    replace it for the rest of the process once anything was compiled, so it is read
    before each test, not once at import)."""
    return (nn.Module.__init__,)


CELL = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x))) + x

torch.manual_seed(0)
stem = nn.Conv2d(3, 4, 1)
blocks = [Block() for _ in range(3)]
model = nn.Sequential(stem, *blocks, nn.Conv2d(4, 2, 1))
out = model(torch.randn(2, 3, 8, 8))
"""


def _keys(workload: Workload) -> list[construction.Key]:
    """The key of each of the model's modules, in module order, from one run."""
    with construction.recording(workload) as built:
        workload.run()
    return [built.keys[id(module)] for module in workload.namespace["model"].modules()]


def test_the_same_modules_get_the_same_keys_in_every_run():
    workload = Workload(textwrap.dedent(CELL), {"__name__": "__main__"})
    first, again = _keys(workload), _keys(workload)
    assert first == again
    assert len(set(first)) == len(first)  # every module told apart


def test_a_loop_building_convs_at_one_call_gives_each_its_ordinal():
    workload = Workload(textwrap.dedent(CELL), {"__name__": "__main__"})
    keys = _keys(workload)
    model = workload.namespace["model"]
    block_convs = [
        keys[i] for i, m in enumerate(model.modules()) if m in [b.conv for b in model[1:4]]
    ]
    # built by `self.conv = nn.Conv2d(...)` inside the cell's Block class: that line, 0 to 2
    assert {key.line for key in block_convs} == {8}
    assert [key.ordinal for key in block_convs] == [0, 1, 2]
    stem = keys[1]
    assert (stem.line, stem.ordinal) == (15, 0)


def test_modules_built_outside_the_checked_code_are_not_recorded():
    inits = _inits()
    workload = Workload("import torch\nmodel = torch.nn.Linear(2, 2)\n", {})
    with construction.recording(workload) as built:
        elsewhere = nn.Linear(2, 2)  # this test's own code, not the cell's
        workload.run()
    assert id(elsewhere) not in built.keys
    assert id(workload.namespace["model"]) in built.keys
    assert _inits() == inits


def test_a_fixed_cell_with_a_line_more_still_finds_the_same_modules():
    """A fix's edit (another check's) may add lines: keys are in the cell's numbering."""
    workload = Workload(textwrap.dedent(CELL), {"__name__": "__main__"})
    keys = _keys(workload)
    fixed = workload.source.replace("torch.manual_seed(0)\n", "torch.manual_seed(0)\nx = 1\n")
    with construction.recording(workload) as built:
        workload.run(fixed)
    model = workload.namespace["model"]
    assert [built.keys[id(module)] for module in model.modules()] == keys


TRAIN_CELL = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                      nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    x = torch.randn(4, 3, 6, 6)
    h = model[1](model[0](x)).permute(0, 2, 3, 1)
    opt.zero_grad()
    model[2](h).square().mean().backward()
    opt.step()
    seen_format = model[0].weight.is_contiguous(memory_format=torch.channels_last)
    seen_forward = getattr(vars(model[2][0]).get("forward"), "__name__", None)
"""


def test_live_fixes_reach_each_run_s_model_and_leave_nothing_behind():
    """channels-last and activation checkpointing, for a model the cell builds: applied to
    the model each run builds (the cell sees it), gone from it after the run; the probe's
    model is never touched."""
    inits = _inits()
    session = detected(TRAIN_CELL, {"__name__": "__main__"}, checks="conv-bias-bn")
    obs, workload = session.observation, session.workload
    probed = workload.namespace["model"]
    chosen = checkpointing.repeated_blocks(obs)[0][1]
    fixes = [
        memory_format._channels_last_fix(obs, probed[0]),
        checkpointing._checkpoint_fix(obs, chosen),
    ]
    for fix in fixes:
        assert fix.built is not None and not fix.seen
        with fix.run_context(workload.namespace):
            workload.run()
        model = workload.namespace["model"]
        assert model is not probed and fix.built.applied_runs == 1
        if isinstance(fix, memory_format.ChannelsLastFix):
            assert workload.namespace["seen_format"] is True
            assert model[0].weight.is_contiguous()
            assert not model[0].weight.is_contiguous(memory_format=torch.channels_last)
        else:
            assert workload.namespace["seen_forward"] == "checkpointed_forward"
            assert all("forward" not in vars(block) for block in model[2])
        assert all(not m._forward_pre_hooks for m in model.modules())
        assert probed[0].weight.is_contiguous() and "forward" not in vars(probed[2][0])
    assert _inits() == inits
