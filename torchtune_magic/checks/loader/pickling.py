"""Whether worker processes can load a loader's data at all, and why not.

Checked before any worker is started: an IterableDataset is not split among workers by
itself, and under spawn/forkserver the dataset is pickled, which a class defined in the
notebook (`__main__`) does not survive.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset


class _MainFinder(pickle.Pickler):
    """Pickles into nothing, noting objects whose class or function lives in `__main__`."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.main_names: set[str] = set()

    def persistent_id(self, obj: Any) -> None:
        owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        if getattr(owner, "__module__", None) == "__main__":
            self.main_names.add(getattr(owner, "__qualname__", repr(owner)))
        return None


def why_no_workers(loader: DataLoader) -> str | None:
    """Why worker processes cannot load this loader's data, or None when they can.

    Under fork (Linux's default) workers inherit the dataset; under spawn/forkserver it is
    pickled, and a class defined in the notebook (`__main__`) cannot be found by a worker.
    """
    if isinstance(loader.dataset, IterableDataset):
        return (
            "its dataset is an IterableDataset: with workers each one yields the whole stream "
            "unless the dataset splits it with torch.utils.data.get_worker_info(), so the fix "
            "is not applied automatically"
        )
    context = loader.multiprocessing_context or torch.multiprocessing.get_context()
    method = context.get_start_method()
    if method == "fork":
        return None
    finder = _MainFinder()
    try:
        finder.dump((loader.dataset, loader.collate_fn, loader.worker_init_fn))
    except Exception as error:
        return (
            f"workers start with '{method}', which pickles the dataset, and it cannot be "
            f"pickled ({type(error).__name__}: {error})"
        )
    if finder.main_names:
        names = ", ".join(sorted(finder.main_names))
        return (
            f"workers start with '{method}' and re-import classes by module, but {names} "
            "is defined in the notebook (__main__): move it to a .py module and import it"
        )
    return None
