"""The workers fix over a cell of several epochs: the complete run with the fix, and the
notebook edited as the fix says, must end bit for bit as a plain run does.

A loader with `persistent_workers=True` reuses its iterator from the second epoch on, and
a reused iterator draws no base seed from the global random stream: every later random
number (the next epoch's shuffle, dropout) comes one draw apart from a run without it. A
scan's optimized copy printed other losses that way. Sampled runs see one epoch, so only
the complete run and the edited cells can tell.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from slow_data import TWO_SHUFFLED_EPOCHS

from torchtune_magic import session

SETUP = """from torch.utils.data import DataLoader
from tests.slow_data import SlowDataset
loader = DataLoader(SlowDataset(192, delay_s=0.004), batch_size=8, shuffle=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)"""

TRAIN = TWO_SHUFFLED_EPOCHS

CHECKED = (
    "%%perfcheck -o -q --budget 12 --checks dataloader-workers --apply dataloader-workers\n" + TRAIN
)


@pytest.fixture(autouse=True)
def short_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe stops after a second (users get 2-8 s): the 1.6 s cell (2 epochs of 24
    batches of 4 ms items) then runs complete with the fix applied, as a long cell does."""
    monkeypatch.setattr(session, "PROBE_SECONDS", (1.0, 1.0))


def _run(ip: Any, *cells: str) -> None:
    """`cells` run as notebook cells in a clean namespace, from the seed the `ip` fixture
    sets."""
    ip.reset(new_session=False)
    ip.run_cell("import torch\nfrom torch import nn\ntorch.manual_seed(0)")
    for cell in cells:
        assert ip.run_cell(cell, store_history=True).error_in_exec is None


def _after(ip: Any, *cells: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The printed losses and the weights after running `cells` (`_run`)."""
    _run(ip, *cells)
    return _state(ip.user_ns)


def _state(ns: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    weights = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    return list(ns["losses"]), weights


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_shuffled_epochs_with_dropout_end_as_a_plain_run_live_and_in_the_edited_cell(ip):
    plain_losses, plain_weights = _after(ip, SETUP, TRAIN)
    assert len(plain_losses) == 2

    # live: the measured fix, then the cell's complete run with it applied
    _run(ip, SETUP)
    report = ip.run_cell(CHECKED, store_history=True).result
    finding = report.finding("dataloader-workers")
    assert finding is not None and finding.fixable, report.findings
    chosen = re.search(
        r"; (\d+) chosen \(start-up \d+\.\d\d s, paid again at each epoch's "
        r"start; persistent_workers=True would save it",
        finding.details,
    )
    assert chosen, finding.details  # named as a further saving, with why it is not applied
    assert "random stream" in finding.details
    variant = report.variant_for(["dataloader-workers"])
    assert variant.error is None and variant.speedup is not None
    assert variant.numerics.verdict == "identical"
    assert report.applied == ["dataloader-workers"]
    assert report.cell_run.status == "complete"
    losses, weights = _state(ip.user_ns)
    assert losses == plain_losses  # both epochs, bit for bit
    assert _same(weights, plain_weights)

    # the notebook as the fix says to edit it: the loader's cell, then the training cell
    (change,) = finding.code_change.cells
    assert f"num_workers={chosen.group(1)})" in change.after
    assert "persistent_workers" not in change.after
    edited_losses, edited_weights = _after(ip, change.after, TRAIN)
    assert edited_losses == plain_losses
    assert _same(edited_weights, plain_weights)
