"""A DDP training script whose ranks' op time shares differ, run under real torchrun (gloo,
CPU) by tests/test_torchrun_agree.py: every step runs a chain of elementwise ops on its
activations, over a tensor four times larger on rank 1, so the chain is a small share of
rank 0's time and a large share of rank 1's (fuse-pointwise thresholds it at 15%).

    torchrun --nproc-per-node 2 tests/agree_script.py OUT_DIR [BUDGET]

Each rank writes the finding ids its report holds to OUT_DIR/ids-RANK.json; rank 0 writes
OUT_DIR/report.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torchtune_magic import perfcheck

out = Path(sys.argv[1])
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 6.0
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)  # two ranks on a 2-core box
torch.manual_seed(0)


def activation(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


model = DistributedDataParallel(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256)
extra = torch.randn(64 * (4 if rank == 1 else 1) * 8, 256)  # rank 1's chain: 4x the work

CELL = """
for _ in range(12):
    loss = model(x).square().mean() + activation(extra).mean() * 0
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

report = perfcheck(
    CELL, globals(), budget=budget, checks="fuse-pointwise", json=out / "report.json"
)
(out / f"ids-{rank}.json").write_text(json.dumps([f.id for f in report.findings]))
dist.destroy_process_group()
