"""Synthetic image data for the demo notebooks, without torchvision.

The classes live in an importable module, not in a notebook cell: DataLoader workers
started with the spawn method (macOS, Windows) unpickle the dataset by importing its
module, and a class defined in a cell lives in `__main__`, which they cannot import.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import Dataset

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)
PAD = 4  # random crops move by up to 2 * PAD pixels


class SyntheticImages(Dataset):
    """Stands in for a folder of JPEGs: each item waits for its "file" (`read_s`, as
    storage does), then decodes and augments it with real CPU work: upsampling, a blur, a
    random crop and flip, colour jitter, normalization.

    The pixel work is numpy, single-threaded as PIL's decoding is in a real pipeline:
    made of tiny torch ops instead, each would open an intra-op parallel region, which on
    a busy machine with few cores costs far more than the work itself.

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

    def _decode(self, rng: np.random.Generator) -> np.ndarray:
        """A float image in [0, 1], 3 x (size + 2 PAD) x (size + 2 PAD)."""
        small = rng.random((3, self.size // 4, self.size // 4), dtype=np.float32)
        image = np.pad(
            small.repeat(4, axis=1).repeat(4, axis=2),
            ((0, 0), (PAD + 1,) * 2, (PAD + 1,) * 2),
            mode="reflect",
        )
        height, width = image.shape[1] - 2, image.shape[2] - 2
        blurred = sum(
            image[:, dy : dy + height, dx : dx + width] for dy in range(3) for dx in range(3)
        )
        return blurred / 9.0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.read_s)
        rng = np.random.default_rng(self.seed * 1_000_003 + index)
        image = self._decode(rng)
        top, left = rng.integers(0, 2 * PAD + 1, size=2)
        image = image[:, top : top + self.size, left : left + self.size]
        if rng.random() < 0.5:
            image = image[:, :, ::-1]
        brightness, contrast = 0.8 + 0.4 * rng.random(2, dtype=np.float32)
        mean = image.mean()
        image = np.clip((image - mean) * contrast + mean * brightness, 0.0, 1.0)
        return torch.from_numpy(np.ascontiguousarray((image - MEAN) / STD)), index % self.classes
