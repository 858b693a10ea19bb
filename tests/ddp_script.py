"""A plain DDP training script as users write one, run under real torchrun (gloo, CPU) by
tests/test_torchrun.py: a two-layer model in DistributedDataParallel, gradient accumulation
over 8 micro-batches, each rank iterating a DataLoader with no DistributedSampler.

    torchrun --nproc-per-node 2 tests/ddp_script.py MODE OUT_DIR [BUDGET]

MODE `plain` runs the cell once; `perfcheck` runs it under `perfcheck(CELL, globals())`
(rank 0 writes OUT_DIR/report.json); `raise` makes rank 1's cell raise in its fourth run (a
measuring run); `right` and `wrong` check the accumulation written with `no_sync()`, syncing
on the last micro-batch and (the off-by-one) on the first, with ddp-no-sync only (rank 0
writes OUT_DIR/report-MODE.json). Each rank saves its parameters, optimizer state and losses
to OUT_DIR/state-MODE-RANK.pt.
"""

from __future__ import annotations

import contextlib  # noqa: F401  (the no_sync cell uses it)
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

mode, out = sys.argv[1], Path(sys.argv[2])
budget = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)  # two ranks on a 2-core box
torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
generator = torch.Generator().manual_seed(rank)
dataset = torch.utils.data.TensorDataset(
    torch.randn(96 * 16, 64, generator=generator),
    torch.randint(0, 10, (96 * 16,), generator=generator),
)
loader = torch.utils.data.DataLoader(dataset, batch_size=16)
accumulate = 8
losses: list[float] = []  # appended to every optimizer step, as notebooks do
log = types.ModuleType("log")  # counts every run: modules are not restored between runs
log.runs = 0

CELL = """
log.runs += 1
if mode == "raise" and rank == 1 and log.runs == 4:
    raise RuntimeError("rank 1 failed in its fourth run")
for i, (x, y) in enumerate(loader):
    loss = torch.nn.functional.cross_entropy(model(x), y) / accumulate
    loss.backward()
    if (i + 1) % accumulate == 0:
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
"""
# the accumulation written with no_sync(): the sync on the last micro-batch of each step
# (right) or on the first (wrong: the other seven stay each rank's own)
NO_SYNC_CELL = """
for i, (x, y) in enumerate(loader):
    sync = (i + 1) % accumulate == 0 if mode == "right" else i % accumulate == 0
    with contextlib.nullcontext() if sync else model.no_sync():
        loss = torch.nn.functional.cross_entropy(model(x), y) / accumulate
        loss.backward()
    if (i + 1) % accumulate == 0:
        opt.step()
        opt.zero_grad()
"""

if mode == "plain":
    exec(CELL)
elif mode in ("right", "wrong"):
    from torchtune_magic import perfcheck

    report_path = out / f"report-{mode}.json"
    perfcheck(NO_SYNC_CELL, globals(), budget=budget, checks="ddp-no-sync", json=report_path)
else:
    from torchtune_magic import perfcheck

    report = perfcheck(CELL, globals(), budget=budget, json=out / "report.json")
    if rank != 0:
        print(f"rank {rank}: {report!r}")
torch.save(
    {"model": model.state_dict(), "opt": opt.state_dict(), "losses": losses},
    out / f"state-{mode}-{rank}.pt",
)
dist.destroy_process_group()
