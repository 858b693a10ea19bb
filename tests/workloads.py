"""Small real workloads shared by tests (importable, so DataLoader workers can pickle)."""

from __future__ import annotations

import textwrap
from typing import Any

from torchtune_magic.cell.workload import Workload
from torchtune_magic.options import Options
from torchtune_magic.session import Session

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

# Checks whose findings depend on the machine's load (cpu-threads counts other processes' CPU
# time during the probe): tests asserting the exact findings of a cell about something else
# skip them, so a busy test machine does not add one.
LOAD_DEPENDENT = "cpu-threads"


def namespace_with(*setups: str, **names: Any) -> dict[str, Any]:
    """A notebook-like namespace: `names` pre-bound, then each setup run as an earlier cell
    (the training setup when none is given)."""
    ns: dict[str, Any] = {"__name__": "__main__", **names}
    for setup in setups or (TRAIN_SETUP,):
        exec(textwrap.dedent(setup), ns)
    return ns


def detected(cell: str, ns: dict[str, Any], **options: Any) -> Session:
    """A session that has probed `cell` and run the checks, not yet measured."""
    session = Session(Workload(textwrap.dedent(cell), ns), Options.build(**options))
    session.probe()
    session.detect()
    return session
