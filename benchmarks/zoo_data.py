"""Datasets for the zoo, in an importable module so DataLoader workers can unpickle them
(a class defined in `__main__` or a notebook cell cannot be loaded by a spawned worker)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class SlowFileDataset(Dataset):
    """Stands in for images read from a slow disk: each item blocks for `delay_s` (a sleep,
    as I/O does, so workers overlap it even on a machine with two cores)."""

    def __init__(self, n: int = 96, features: int = 32, delay_s: float = 0.004):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=generator)
        self.y = torch.randn(n, 1, generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.x[index], self.y[index]


class SlowImageDataset(Dataset):
    """Small labelled images read from a slow disk: each item blocks for `delay_s` first."""

    def __init__(self, n: int = 512, size: int = 32, classes: int = 10, delay_s: float = 0.002):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, size, size, generator=generator)
        self.labels = torch.randint(0, classes, (n,), generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.images[index], self.labels[index]
