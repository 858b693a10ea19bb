"""A cheap stand-in for the cell's work, for `cpu-threads`' quick trial.

The thread count is a property of the process, so the check times a representative piece
of the cell without instrumentation instead of the whole cell: the main model's forward
under no_grad on a random input of the shape the probe recorded. It leaves the kernel as
it was: parameters are read, never written, buffers such as BatchNorm's running statistics
are swapped for copies, and the RNG stream is put back. User forward hooks on the model do
run (as in any forward).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..probe.observation import Observation


@dataclass
class Proxy:
    """The main model and the input shape its forward was first called with."""

    module: torch.nn.Module
    path: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.path} forward on a {tuple(self.shape)} input"

    @contextlib.contextmanager
    def ready(self) -> Iterator[Callable[[], None]]:
        """A function running one step, built on a random input (RNG put back after)."""
        with torch.random.fork_rng(devices=[]):
            inputs = _input_for(self.module, self.shape)
            yield lambda: self._step(inputs)

    def _step(self, inputs: torch.Tensor) -> None:
        buffers = {name: b.clone() for name, b in self.module.named_buffers()}
        with torch.no_grad():
            torch.func.functional_call(self.module, buffers, (inputs,), strict=False)


def main_model(obs: Observation) -> Proxy | None:
    """The model called from the cell with the most parameters (ties: most calls), if one
    runs on the CPU on an input the probe recorded and a trial step works."""
    candidates = [
        (use, use.input_shape)
        for use in obs.modules.values()
        if use.outer_calls and use.input_shape is not None and _on_cpu(use.module)
    ]
    if not candidates:
        return None
    use, shape = max(candidates, key=lambda c: (_size(c[0].module), c[0].outer_calls))
    proxy = Proxy(use.module, obs.module_path(use.module), shape)
    try:
        with proxy.ready() as step:
            step()
    except Exception:  # an input the model does not take (several arguments, odd dtypes)
        return None
    return proxy


def seconds_per_step(step: Callable[[], None], budget_s: float, most: int = 5) -> float:
    """Median seconds of a step after one warm-up, repeated up to `most` times within
    `budget_s` (at least once)."""
    step()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < most and (not times or time.perf_counter() < deadline):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _on_cpu(module: torch.nn.Module) -> bool:
    first = next(module.parameters(), None)
    return first is not None and first.device.type == "cpu"


def _size(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _input_for(module: torch.nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    """A random float input in the model's dtype, or token ids (zeros) for a model that
    starts with an embedding."""
    leaves = [m for m in module.modules() if not list(m.children())]
    if leaves and isinstance(leaves[0], torch.nn.Embedding):
        return torch.zeros(shape, dtype=torch.long)
    return torch.randn(shape, dtype=next(module.parameters()).dtype)
