"""A training function for child processes (tests/test_launchers.py): importable, so
`torch.multiprocessing.spawn` can start it; each process appends a line to `log` when done."""

from __future__ import annotations

from pathlib import Path

import torch


def train(index: int, log: str) -> None:
    torch.manual_seed(index)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(20):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    with Path(log).open("a") as out:
        out.write(f"process {index} trained\n")
