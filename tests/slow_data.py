"""Datasets for the loader tests, in an importable module so worker processes can load
them under any start method (classes defined in a notebook cell live in `__main__`)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class SlowDataset(Dataset):
    """Each item costs `delay_s` of blocking I/O-like waiting (a sleep, so workers overlap
    it even on a machine with few cores)."""

    def __init__(self, n: int = 64, features: int = 8, delay_s: float = 0.002):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=generator)
        self.y = torch.randn(n, 1, generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.x[index], self.y[index]


def slow_worker_start(worker_id: int) -> None:
    """A `worker_init_fn` that takes a quarter second, as opening files or a database
    connection in each worker does: a loader without persistent workers pays it every epoch."""
    time.sleep(0.25)


class BusyDataset(Dataset):
    """Each item costs `work` rounds of pure-Python arithmetic: loading that keeps a CPU
    busy the whole time (no I/O to overlap), so more workers than cores cannot help."""

    def __init__(self, n: int = 64, features: int = 8, work: int = 20_000):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=generator)
        self.y = torch.randn(n, 1, generator=generator)
        self.work = work

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        total = 0
        for step in range(self.work):
            total += step * step % 7
        return self.x[index] + total * 0.0, self.y[index]


class SlowImages(SlowDataset):
    """Small 3-channel images with class labels, each item costing `delay_s` of waiting
    (a sleep, as reading a file does): for a Conv→BatchNorm model trained in one cell."""

    def __init__(self, n: int = 128, size: int = 16, classes: int = 10, delay_s: float = 0.004):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, size, size, generator=generator)
        self.y = torch.randint(0, classes, (n,), generator=generator)
        self.delay_s = delay_s
