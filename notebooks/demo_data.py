"""Synthetic image data for the demo notebooks, without torchvision.

The classes live in an importable module, not in a notebook cell: DataLoader workers
started with the spawn method (macOS, Windows) unpickle the dataset by importing its
module, and a class defined in a cell lives in `__main__`, which they cannot import.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class SyntheticImages(Dataset):
    """Stands in for a folder of JPEGs: each item waits for its "file" (`read_s`, as
    storage does), then decodes and augments it with real CPU work (upsampling, a blur,
    a random crop and flip, colour jitter, normalization), as an image pipeline would.

    Augmentation draws from a generator seeded by (seed, index), so an item looks the
    same whichever process loads it: results do not depend on the worker count (the price:
    an item gets the same augmentation every epoch, fine for a demo).
    """

    def __init__(
        self,
        n: int = 256,
        size: int = 64,
        classes: int = 10,
        read_s: float = 0.002,
        seed: int = 0,
    ):
        self.n, self.size, self.classes, self.read_s, self.seed = n, size, classes, read_s, seed

    def __len__(self) -> int:
        return self.n

    def _decode(self, g: torch.Generator) -> torch.Tensor:
        """A float image in [0, 1], 3 x (size + 8) x (size + 8)."""
        small = torch.rand(1, 3, self.size // 4, self.size // 4, generator=g)
        big = F.interpolate(small, size=self.size + 8, mode="bicubic", align_corners=False)
        kernel = torch.ones(3, 1, 3, 3) / 9.0
        return F.conv2d(big, kernel, padding=1, groups=3).clamp_(0, 1)[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.read_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = self._decode(g)
        top, left = torch.randint(0, 9, (2,), generator=g).tolist()
        image = image[:, top : top + self.size, left : left + self.size]
        if torch.rand((), generator=g) < 0.5:
            image = image.flip(-1)
        brightness, contrast = 0.8 + 0.4 * torch.rand(2, generator=g)
        image = ((image - image.mean()) * contrast + image.mean() * brightness).clamp(0, 1)
        return (image - MEAN) / STD, index % self.classes
