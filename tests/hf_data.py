"""Tokenized datasets for the Hugging Face tests, in an importable module so DataLoader
workers can load them under any start method (classes defined in a notebook cell live in
`__main__`). Token ids are made with torch: no tokenizer, nothing from the hub."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class TokenDataset(Dataset):
    """Random token ids with binary labels, as a tokenized text-classification set; each
    item costs `delay_s` of blocking I/O-like waiting (a sleep, so workers overlap it even
    on a machine with few cores; 0 for in-memory data)."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 1000, delay_s: float = 0.0):
        generator = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, vocab, (n, length), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        ids = self.input_ids[index]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": self.labels[index],
        }
