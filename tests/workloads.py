"""Small real workloads shared by tests (importable, so DataLoader workers can pickle)."""

from __future__ import annotations

import textwrap
from typing import Any

TRAIN_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
X = torch.randn(128, 32)
Y = torch.randn(128, 1)
"""


def namespace_with(setup: str = TRAIN_SETUP) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(textwrap.dedent(setup), ns)
    return ns


