"""A plain DDP training script as users write one, run under real torchrun (gloo, CPU) by
tests/test_torchrun.py: a two-layer model in DistributedDataParallel, gradient accumulation
over 8 micro-batches, each rank iterating a DataLoader with no DistributedSampler.

    torchrun --nproc-per-node 2 tests/ddp_script.py MODE OUT_DIR [BUDGET]

MODE `plain` runs the cell once; `perfcheck` runs it under `perfcheck(CELL, globals())`
(rank 0 writes OUT_DIR/report.json); `raise` makes rank 1's cell raise in its fourth run (a
measuring run), `interrupt` sends rank 1 a SIGINT there (Ctrl-C on one rank); `right` and
`wrong` check the accumulation written with `no_sync()`, syncing on the last micro-batch and
(the off-by-one) on the first, with ddp-no-sync only (rank 0 writes
OUT_DIR/report-MODE.json). `settings` and `static` build the wrapper with
`find_unused_parameters=True` and no accumulation, every parameter used (`settings`, with
ddp-find-unused and ddp-bucket-view) or one layer never used (`static`, ddp-find-unused
only); `settings-plain` runs that cell once. `imbalance` makes rank 1's loader 10 ms slower a
batch, with rank-imbalance only. Each rank saves its parameters, optimizer state and losses
to OUT_DIR/state-MODE-RANK.pt.
"""

from __future__ import annotations

import contextlib  # noqa: F401  (the no_sync cell uses it)
import os  # noqa: F401  (the interrupt mode's cell uses it)
import signal  # noqa: F401  (likewise)
import sys
import time
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


class Net(torch.nn.Module):
    def __init__(self, unused_head: bool):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
        )
        if unused_head:  # never called: the same parameters unused in every step
            self.unused_head = torch.nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


settings = mode.startswith("settings") or mode == "static"
model = DistributedDataParallel(Net(mode == "static"), find_unused_parameters=settings)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
generator = torch.Generator().manual_seed(rank)
dataset = torch.utils.data.TensorDataset(
    torch.randn(96 * 16, 64, generator=generator),
    torch.randint(0, 10, (96 * 16,), generator=generator),
)


def collate(batch: list) -> list:
    if mode == "imbalance" and rank == 1:
        time.sleep(0.01)  # a slow preprocessing step on one rank
    return torch.utils.data.default_collate(batch)


loader = torch.utils.data.DataLoader(dataset, batch_size=16, collate_fn=collate)
accumulate = 1 if settings or mode == "imbalance" else 8
losses: list[float] = []  # appended to every optimizer step, as notebooks do
log = types.ModuleType("log")  # counts every run: modules are not restored between runs
log.runs = 0

CELL = """
log.runs += 1
if mode == "raise" and rank == 1 and log.runs == 4:
    raise RuntimeError("rank 1 failed in its fourth run")
if mode == "interrupt" and rank == 1 and log.runs == 4:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C on rank 1 only, in a measuring run
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

if mode in ("plain", "settings-plain"):
    exec(CELL)
elif mode in ("settings", "static"):
    from torchtune_magic import perfcheck

    checks = "ddp-find-unused,ddp-bucket-view" if mode == "settings" else "ddp-find-unused"
    perfcheck(CELL, globals(), budget=budget, checks=checks, json=out / f"report-{mode}.json")
elif mode == "imbalance":
    from torchtune_magic import perfcheck

    perfcheck(
        CELL, globals(), budget=budget, checks="rank-imbalance", json=out / "report-imbalance.json"
    )
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
