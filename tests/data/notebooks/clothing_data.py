"""A stand-in for a downloaded 28 x 28 clothing-image dataset, for the tutorial-style test
notebook beside it (the tests run offline). Each item is "read from storage" (a short wait,
as a network disk or a bucket gives) and converted to a float tensor in [0, 1], as an
image-to-tensor transform does. Items are fixed by their index, so every loader, whatever
its worker count, yields the same batches.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

CLASSES = 10


class StoredClothingImages(Dataset):
    def __init__(self, n: int, train: bool = True, read_s: float = 0.002):
        self.n, self.offset, self.read_s = n, 0 if train else 1_000_000, read_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.read_s)  # the file's bytes arriving
        generator = torch.Generator().manual_seed(self.offset + index)
        label = index % CLASSES
        pixels = torch.randint(0, 256, (1, 28, 28), generator=generator, dtype=torch.uint8)
        pixels[:, label : label + 18, 5:23] //= 2  # a class-dependent shape to learn
        return pixels.float() / 255.0, label
