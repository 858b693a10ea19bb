"""What a training framework knows about a run that the cell's own code does not show.

`trainer.fit(model, loader)` is one line: the epochs and batches it will run live in the
framework's settings. Frameworks are found by duck typing on their classes, so none of
them is imported here.
"""

from __future__ import annotations

import math
from typing import Any

LIGHTNING_MODULES = ("lightning", "pytorch_lightning")


def lightning_trainers(namespace: dict[str, Any]) -> list[Any]:
    """PyTorch Lightning `Trainer` objects bound to names in the namespace."""
    found = []
    for name, value in namespace.items():
        cls = type(value)
        root = (cls.__module__ or "").split(".")[0]
        if not name.startswith("_") and root in LIGHTNING_MODULES and cls.__name__ == "Trainer":
            found.append(value)
    return found


def lightning_total_batches(trainer: Any) -> tuple[int, str] | None:
    """Training batches one `fit` will draw, known once the fit has set its loop up, with
    how it was worked out; None before that, or when the run is bounded by time or early
    stopping rather than by epochs and steps."""
    per_epoch = getattr(trainer, "num_training_batches", math.inf)
    epochs = getattr(trainer, "max_epochs", None)
    if not isinstance(per_epoch, int) or not isinstance(epochs, int) or epochs < 1:
        return None
    total = epochs * per_epoch
    detail = f"Lightning Trainer: max_epochs={epochs} x {per_epoch} training batches"
    max_steps = getattr(trainer, "max_steps", -1)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1) or 1
    if isinstance(max_steps, int) and 0 < max_steps * accumulate < total:
        total = max_steps * accumulate
        detail = f"Lightning Trainer: max_steps={max_steps} x {accumulate} batches per step"
    return total, detail
