"""A small built-in CPU workload with planted problems, for `python -m torchtune_magic demo`."""

from __future__ import annotations

from typing import Any

SETUP = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
inputs = torch.randn(64, 256)
targets = torch.randint(0, 10, (64,))
"""

CELL = """\
torch.autograd.set_detect_anomaly(True)  # left on from a debugging session
for step in range(30):
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    opt.step()
torch.autograd.set_detect_anomaly(False)
"""


def namespace() -> dict[str, Any]:
    """A fresh namespace holding the demo's model, optimizer and data."""
    ns: dict[str, Any] = {}
    exec(SETUP, ns)
    return ns
