"""A DDP training script whose cell builds its own DataLoader, with no DistributedSampler,
run under real torchrun (gloo, CPU) by tests/test_torchrun_cell_loader.py: every run of the
cell makes a new loader, so the distributed-sampler fix edits its constructor call.

    torchrun --nproc-per-node 2 tests/ddp_cell_loader_script.py MODE OUT_DIR [BUDGET]

MODE `plain` runs the cell once; `perfcheck` runs it under `perfcheck(CELL, globals())`
with distributed-sampler only (rank 0 writes OUT_DIR/report.json). Each rank saves its
parameters and losses to OUT_DIR/state-MODE-RANK.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

mode, out = sys.argv[1], Path(sys.argv[2])
budget = float(sys.argv[3]) if len(sys.argv) > 3 else 15.0
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)  # two ranks on a 2-core box
torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(rank)
dataset = torch.utils.data.TensorDataset(
    torch.randn(48 * 16, 64, generator=generator),
    torch.randint(0, 10, (48 * 16,), generator=generator),
)
losses: list[float] = []

CELL = """
loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)
for x, y in loader:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
"""
if mode == "plain":
    exec(CELL)
else:
    from torchtune_magic import perfcheck

    report_path = out / "report.json"
    perfcheck(CELL, globals(), budget=budget, checks="distributed-sampler", json=report_path)
torch.save({"model": model.state_dict(), "losses": losses}, out / f"state-{mode}-{rank}.pt")
dist.destroy_process_group()
