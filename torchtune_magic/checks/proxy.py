"""A cheap stand-in for the cell's work, for the CPU checks' quick trials.

Thread counts and allocator behaviour are properties of the process, so the CPU checks time
a representative piece of the cell without instrumentation instead of the whole cell: the
main model's forward (and, for a training cell, its backward) on a random input of the
shape the probe recorded. It leaves the kernel as it was: parameters are read, never
written (gradients come back from `torch.autograd.grad`, not into `.grad`), buffers such as
BatchNorm's running statistics are swapped for copies, and the RNG stream is put back.
User forward hooks on the model do run (as in any forward).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..engine.probe import Observation


@dataclass
class Proxy:
    """The main model and the input shape its forward was first called with."""

    module: torch.nn.Module
    path: str
    shape: tuple[int, ...]
    backward: bool  # the cell trained: time forward + backward

    def describe(self) -> str:
        what = "forward + backward" if self.backward else "forward"
        return f"{self.path} {what} on a {tuple(self.shape)} input"

    @contextlib.contextmanager
    def ready(self) -> Iterator[Callable[[], None]]:
        """A function running one step, built on a random input (RNG put back after)."""
        with torch.random.fork_rng(devices=[]):
            inputs = _input_for(self.module, self.shape)
            yield lambda: self._step(inputs)

    def _step(self, inputs: torch.Tensor) -> None:
        buffers = {name: b.clone() for name, b in self.module.named_buffers()}
        params = [p for p in self.module.parameters() if p.requires_grad]
        with torch.set_grad_enabled(self.backward and bool(params)):
            out = torch.func.functional_call(self.module, buffers, (inputs,), strict=False)
            if self.backward and params:
                result = _first_float(out)
                if result is not None and result.requires_grad:
                    torch.autograd.grad(result.float().sum(), params, allow_unused=True)


def main_model(obs: Observation, backward: bool = True) -> Proxy | None:
    """The model called from the cell with the most parameters (ties: most calls), if one
    runs on the CPU on an input the probe recorded and a trial step works; its step has a
    backward when `backward` is asked and the cell trained."""
    candidates = [
        (use, use.input_shape)
        for use in obs.modules.values()
        if use.outer_calls and use.input_shape is not None and _on_cpu(use.module)
    ]
    if not candidates:
        return None
    use, shape = max(candidates, key=lambda c: (_size(c[0].module), c[0].outer_calls))
    training = backward and obs.backward_calls > 0
    proxy = Proxy(use.module, obs.module_path(use.module), shape, training)
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


def _first_float(value: Any, depth: int = 3) -> torch.Tensor | None:
    """The first floating-point tensor in a model's output (tensor, tuple, dict, HF output)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if depth and isinstance(value, dict):
        value = list(value.values())
    if depth and isinstance(value, (tuple, list)):
        for item in value:
            found = _first_float(item, depth - 1)
            if found is not None:
                return found
    return None
