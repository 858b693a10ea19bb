"""The probe: what it records, and that it leaves no hook or patch behind."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter
from workloads import namespace_with

from torchtune_magic.cell.workload import CellError, Workload
from torchtune_magic.probe import probe


def _global_state() -> tuple:
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    return (
        torch.autograd.backward,
        torch.optim.Optimizer.zero_grad,
        torch.nn.Module.zero_grad,
        DataLoader.__iter__,
        _BaseDataLoaderIter.__next__,
        torch.autograd.gradcheck,
        torch.profiler.profile.start,
        len(module_mod._global_forward_pre_hooks),
        len(module_mod._global_forward_hooks),
        len(optimizer_mod._global_optimizer_pre_hooks),
    )


def test_records_forward_backward_steps_loaders_and_lines():
    ns = namespace_with()
    ns["loader"] = DataLoader(TensorDataset(ns["X"], ns["Y"]), batch_size=32)
    cell = (
        "for xb, yb in loader:\n"
        "    opt.zero_grad()\n"
        "    loss = torch.nn.functional.mse_loss(model(xb), yb)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    obs = probe.run(Workload(cell, ns), "cpu")
    model_use = obs.modules[id(ns["model"])]
    assert model_use.outer_calls == 4 and model_use.grad_calls == 4
    assert model_use.lines == {3}
    assert obs.backward_calls == 4 and obs.backward_lines == {4}
    assert obs.optimizer_steps[id(ns["opt"])][1] == 4
    assert [c.detail for c in obs.zero_grad_calls] == [True] * 4
    loader_use = obs.loaders[id(ns["loader"])]
    assert loader_use.batches == 4  # the StopIteration ending the epoch is no batch
    assert loader_use.wait_s > 0 and loader_use.lines == {1}
    linear0, relu = ns["model"][0], ns["model"][1]
    assert obs.edges[(id(linear0), id(relu))] == 4  # by tensor identity
    assert obs.ops and any(op.name == "aten::linear" for op in obs.ops)
    assert obs.peak_memory.bytes and obs.peak_memory.bytes > 0
    assert obs.module_path(linear0) == "model.0"


def test_every_hook_and_patch_is_removed_also_on_error():
    before = _global_state()
    ns = namespace_with()
    with pytest.raises(CellError):
        probe.run(Workload("y = model(X)\nraise RuntimeError('x')", ns), "cpu")
    assert _global_state() == before
    probe.run(Workload("y = model(X)", ns), "cpu")
    assert _global_state() == before


def test_the_cells_own_profiler_turns_the_probe_profiler_off():
    ns = namespace_with()
    obs = probe.run(Workload("with torch.profiler.profile():\n    y = model(X)", ns), "cpu")
    assert obs.ops is None
    assert [e.kind for e in obs.profiler_entries] == ["torch.profiler.profile"]


def test_a_forward_that_raises_does_not_make_later_forwards_look_nested():
    ns = namespace_with(
        "import torch\nfrom torch import nn\n"
        "class Picky(nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise ValueError('not today')\n"
        "picky = Picky()\nmodel = nn.Linear(4, 2)\nx = torch.randn(3, 4)\n"
    )
    cell = (
        "for _ in range(3):\n"
        "    try:\n"
        "        picky(x)\n"
        "    except ValueError:\n"
        "        pass\n"
        "    y = model(x)\n"
    )
    obs = probe.run(Workload(cell, ns), "cpu")
    assert obs.modules[id(ns["model"])].outer_calls == 3  # top-level forwards, all of them
