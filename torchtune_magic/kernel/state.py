"""The state guard: snapshot what a cell can change and put it back exactly.

Measuring means running the cell many times; the user's kernel must look as if it ran once.
A snapshot holds CPU copies of every parameter, buffer, gradient, optimizer/scheduler state,
loose tensor, RNG state, the namespace bindings and the plain Python objects the namespace
reaches (lists, dicts, attributes of user objects: `pystate`). Restoring writes values back
*into the same objects* (identity kept), so references the user holds elsewhere stay valid.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import allocator, discovery, pystate, trainers

try:  # numpy is optional for the guard; torch works without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    np = None

# A snapshot may take up to this share of free host memory; past it the state is not kept
# (the session says so, a plain sample is not taken).
SNAPSHOT_SHARE_OF_FREE_MEMORY = 0.5


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Held while measuring, dropped after: kept out of malloc (see allocator.outside_copy)."""
    return allocator.outside_copy(tensor)


def _equal(tensor: torch.Tensor, saved: torch.Tensor | None) -> bool:
    if saved is None or tensor.shape != saved.shape or tensor.dtype != saved.dtype:
        return False
    return torch.equal(tensor, saved.to(tensor.device))


def _write_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    # Inference tensors (made under inference_mode) can only be written inside it.
    mode = torch.inference_mode() if target.is_inference() else torch.no_grad()
    with mode:
        if target.shape == saved.shape and target.dtype == saved.dtype:
            target.copy_(saved)
        else:  # the run replaced the storage (e.g. `p.data = ...`): put the old one back
            target.data = saved.to(target.device, copy=True)


@dataclass
class _TensorState:
    tensor: torch.Tensor
    value: torch.Tensor
    grad: torch.Tensor | None
    grad_value: torch.Tensor | None
    left: tuple[Any, ...] = ()  # `marks()` as the snapshot or the last restore left them

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _TensorState:
        grad = tensor.grad if tensor.is_leaf else None
        taken = cls(tensor, _cpu_copy(tensor), grad, None if grad is None else _cpu_copy(grad))
        taken.left = taken.marks()
        return taken

    def marks(self) -> tuple[Any, ...]:
        """What a write through torch changes: the version counters (every in-place op
        bumps them), the storage address (`.data = …` swaps it) and which tensor `.grad`
        is. A write torch does not see (through `.data`, numpy, a raw pointer) changes
        none of them."""
        tensor = self.tensor
        try:
            grad = tensor.grad if tensor.is_leaf else None
            return (
                tensor._version,
                tensor.data_ptr(),
                grad is self.grad,
                -1 if grad is None else grad._version,
            )
        except (RuntimeError, NotImplementedError):  # no storage to read: never unchanged
            return (object(),)

    def unmarked(self) -> bool:
        """No write through torch since the snapshot or the last restore."""
        return self.marks() == self.left

    def holds_start_value(self) -> bool:
        """Values (and gradient) equal to the snapshot's, bit for bit."""
        try:
            if self.grad is not None and not _equal(self.grad, self.grad_value):
                return False
            return _equal(self.tensor, self.value)
        except (RuntimeError, NotImplementedError, TypeError):
            return False

    def restore(self) -> None:
        _write_into(self.tensor, self.value)
        if self.tensor.is_leaf:
            if self.grad is None:
                self.tensor.grad = None
            else:
                _write_into(self.grad, self.grad_value)
                if self.tensor.grad is not self.grad:
                    self.tensor.grad = self.grad
        self.left = self.marks()

    @property
    def nbytes(self) -> int:
        extra = self.grad_value.nbytes if self.grad_value is not None else 0
        return self.value.nbytes + extra


def _copy_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _cpu_copy(value)
    return copy.deepcopy(value)


@dataclass
class _OptimizerState:
    optimizer: torch.optim.Optimizer
    per_param: dict[int, tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]
    groups: list[dict[str, Any]]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        per_param = {
            id(param): (param, dict(state), {k: _copy_value(v) for k, v in state.items()})
            for param, state in optimizer.state.items()
        }
        groups = [
            {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups
        ]
        return cls(optimizer, per_param, groups)

    def restore(self) -> None:
        state = self.optimizer.state
        for param in list(state.keys()):
            if id(param) not in self.per_param:
                del state[param]  # created by the measured runs (e.g. the first step)
        for param, objects, values in self.per_param.values():
            restored: dict[str, Any] = {}
            for key, value in values.items():
                original = objects[key]
                if isinstance(original, torch.Tensor):
                    _write_into(original, value)
                    restored[key] = original
                else:
                    restored[key] = copy.deepcopy(value)
            state[param] = restored
        for group, saved in zip(self.optimizer.param_groups, self.groups, strict=False):
            group.update(copy.deepcopy(saved))

    @property
    def nbytes(self) -> int:
        return sum(
            v.nbytes
            for _, _, values in self.per_param.values()
            for v in values.values()
            if isinstance(v, torch.Tensor)
        )


@dataclass
class _StateDictObject:
    """Objects whose own state_dict round-trips them (LR schedulers, GradScaler)."""

    obj: Any
    saved: dict[str, Any]

    @classmethod
    def of(cls, obj: Any) -> _StateDictObject:
        return cls(obj, copy.deepcopy(obj.state_dict()))

    def restore(self) -> None:
        self.obj.load_state_dict(copy.deepcopy(self.saved))


@dataclass
class _RNGState:
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None
    python: Any
    numpy: Any
    generators: list[tuple[torch.Generator, torch.Tensor]]

    @classmethod
    def capture(cls, generators: Iterable[torch.Generator]) -> _RNGState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(
            torch.get_rng_state(),
            cuda,
            random.getstate(),
            np.random.get_state() if np is not None else None,
            [(g, g.get_state()) for g in generators],
        )

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)
        random.setstate(self.python)
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
        for generator, state in self.generators:
            generator.set_state(state)


@dataclass(frozen=True)
class TorchSwitches:
    """Process-wide torch modes a cell can flip and leave flipped: a run stopped at a step
    (or interrupted) never reaches the line that flips them back, so every run after it
    would start in the wrong mode (anomaly detection left on, say)."""

    anomaly: tuple[bool, bool]
    grad_enabled: bool
    default_dtype: torch.dtype
    deterministic: tuple[bool, bool]
    matmul_precision: str
    cudnn: tuple[bool, bool, bool]
    threads: int

    @classmethod
    def capture(cls) -> TorchSwitches:
        cudnn = torch.backends.cudnn
        return cls(
            (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            torch.is_grad_enabled(),
            torch.get_default_dtype(),
            (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            torch.get_float32_matmul_precision(),
            (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32),
            torch.get_num_threads(),
        )

    def restore(self) -> None:
        """Set back each switch that differs (setting one can cost: threads, for one)."""
        now = TorchSwitches.capture()
        if now == self:
            return
        if now.anomaly != self.anomaly:
            torch.autograd.set_detect_anomaly(*self.anomaly)
        if now.grad_enabled != self.grad_enabled:
            torch.set_grad_enabled(self.grad_enabled)
        if now.default_dtype != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        if now.deterministic != self.deterministic:
            enabled, warn_only = self.deterministic
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if now.matmul_precision != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if now.cudnn != self.cudnn:
            cudnn = torch.backends.cudnn
            cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = self.cudnn
        if now.threads != self.threads:
            torch.set_num_threads(self.threads)


@dataclass
class Snapshot:
    """Everything needed to put the kernel back as it was when the snapshot was taken."""

    namespace: dict[str, Any]
    bindings: dict[str, Any]
    tensors: list[_TensorState] = field(default_factory=list)
    training_flags: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    optimizers: list[_OptimizerState] = field(default_factory=list)
    stateful: list[_StateDictObject] = field(default_factory=list)
    rng: _RNGState | None = None
    switches: TorchSwitches | None = None
    trainers: trainers.TrainerState | None = None  # Hugging Face Trainers' bookkeeping
    python: pystate.PyState | None = None  # lists, dicts, attributes, closures, …
    # the tensors a run of the cell was seen to leave as they were (`note_unwritten`)
    unwritten: set[int] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        python = self.python.nbytes if self.python is not None else 0
        tensors = sum(t.nbytes for t in self.tensors)
        return tensors + sum(o.nbytes for o in self.optimizers) + python

    @property
    def not_covered(self) -> list[str]:
        """Python objects a bound of the snapshot left out, or a restore could not write
        back, one line each (for the report's warnings): what the measuring runs change in
        them stays changed."""
        return list(self.python.not_covered) if self.python is not None else []

    @property
    def reaches_one_way_state(self) -> bool:
        """Whether the names the cell reads reach something no restore can put back if a
        run changes it (a generator, an iterator, a file, a socket): a run of the cell that
        stops part-way could then not be undone."""
        return bool(self.python is not None and self.python.markers)

    def unrestorable_changes(self) -> list[str]:
        """After a run of the cell from this snapshot: what it changed that no restore can
        undo (a generator or iterator advanced, a file read or written, a socket the cell
        can use), one line each naming the object and why; empty when the cell can be run
        again without the user seeing it. Only what the names the cell reads reach (`take`'s
        `cell`) is watched. Call it after the probe's run, before any other run."""
        return self.python.unrestorable_changes() if self.python is not None else []

    def note_unwritten(self) -> None:
        """After a run of the cell from this snapshot: note the tensors it left exactly as
        they were — values and the marks a write through torch leaves. Restores between
        measuring runs (`restore(written_only=True)`) pass over them while their marks stay
        unchanged: copying back a dataset or a frozen model the cell only reads cost a copy
        per run and, worse, evicted the CPU caches before every timed run (32 MiB of
        unrelated tensors made the runs of a 6 ms cell 5-10% slower than the plain cell)."""
        self.unwritten = {
            i for i, t in enumerate(self.tensors) if t.unmarked() and t.holds_start_value()
        }
        if self.python is not None:
            self.python.note_unwritten()

    def written_unseen(self) -> list[torch.Tensor]:
        """Tensors passed over that no longer hold their start values: written in a way
        torch does not see (through `.data`, numpy), so the runs after that write started
        from the changed values. A full `restore()` still puts them back."""
        return [
            self.tensors[i].tensor
            for i in sorted(self.unwritten)
            if self.tensors[i].unmarked() and not self.tensors[i].holds_start_value()
        ]

    def written_unseen_objects(self) -> list[str]:
        """Python containers passed over between runs (`note_unwritten`: big ones the
        probe's run left as they were, while their length and end items are unchanged)
        that no longer hold their start contents, by where they are bound: an item replaced
        in place, a numpy array written, so the runs after that write started from it. A
        full `restore()` still puts them back."""
        return self.python.written_unseen() if self.python is not None else []

    def rebound(self) -> set[str]:
        """The public names the namespace binds now to another object than at the snapshot,
        or newly: those a run of the cell (re)bound."""
        return {
            name
            for name, value in self.namespace.items()
            if not name.startswith("_") and self.bindings.get(name, _MISSING) is not value
        }

    def restore(self, written_only: bool = False) -> None:
        """Rebind names, then write values back into the same objects; with `written_only`,
        not into tensors or big Python containers noted unwritten whose marks are unchanged
        (`note_unwritten`)."""
        ns = self.namespace
        for name in [n for n in ns if n not in self.bindings and not n.startswith("_")]:
            del ns[name]
        for name, value in self.bindings.items():
            if ns.get(name, _MISSING) is not value:
                ns[name] = value
        if self.python is not None:
            self.python.restore(written_only)
        if self.trainers is not None:
            self.trainers.restore()
        for i, tensor_state in enumerate(self.tensors):
            if not (written_only and i in self.unwritten and tensor_state.unmarked()):
                tensor_state.restore()
        for module, training in self.training_flags:
            module.training = training
        for optimizer_state in self.optimizers:
            optimizer_state.restore()
        for obj in self.stateful:
            obj.restore()
        if self.rng is not None:
            self.rng.restore()
        if self.switches is not None:
            self.switches.restore()


_MISSING = object()


def estimate_bytes(found: dict[int, discovery.Found]) -> int:
    """What a snapshot of these objects would hold, without copying anything. The copies
    of Python objects (numpy arrays, tensors deeper in lists and user objects) are not
    counted: `take` bounds them itself to a share of what these leave free."""
    total = 0
    for tensor in _tensors_of(found):
        total += tensor.nbytes
        if tensor.is_leaf and tensor.grad is not None:
            total += tensor.grad.nbytes
    for entry in discovery.of_type(found, torch.optim.Optimizer):
        for state in entry.obj.state.values():
            total += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _tensors_of(found: dict[int, discovery.Found]) -> list[torch.Tensor]:
    tensors: dict[int, torch.Tensor] = {}
    for entry in discovery.of_type(found, torch.nn.Module):
        for tensor in [*entry.obj.parameters(), *entry.obj.buffers()]:
            tensors[id(tensor)] = tensor
    for entry in discovery.of_type(found, torch.Tensor):
        tensors.setdefault(id(entry.obj), entry.obj)
    return list(tensors.values())


def take(
    namespace: dict[str, Any], found: dict[int, discovery.Found], cell: str | None = None
) -> Snapshot:
    """Snapshot the namespace and the objects `found` in it. `cell`: the cell's source, whose
    names are walked first for Python objects and watched for what cannot be restored
    (`Snapshot.unrestorable_changes`); without it, every name is."""
    known = _tensors_of(found)
    free = available_memory_bytes()
    room = None
    if free is not None:
        room = max(0, int(pystate.SHARE_OF_FREE_MEMORY * (free - estimate_bytes(found))))
    python = pystate.take(
        namespace,
        reads=None if cell is None else pystate.cell_reads(cell, namespace),
        known_tensors=[id(t) for t in known],
        bounds=pystate.Bounds(nbytes=room),
    )
    modules = {
        id(sub): sub
        for top in [*(e.obj for e in discovery.of_type(found, torch.nn.Module)), *python.modules]
        for sub in top.modules()
    }
    generators = {id(e.obj): e.obj for e in discovery.of_type(found, torch.Generator)}
    for entry in discovery.of_type(found, torch.utils.data.DataLoader):
        for owner in (entry.obj, getattr(entry.obj, "sampler", None)):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator):
                generators[id(generator)] = generator
    generators.update((id(g), g) for g in python.generators)
    stateful_types = (torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)
    return Snapshot(
        namespace=namespace,
        bindings={k: v for k, v in namespace.items() if not k.startswith("_")},
        tensors=[_TensorState.of(t) for t in [*known, *python.tensors]],
        training_flags=[(m, m.training) for m in modules.values()],
        optimizers=[
            _OptimizerState.of(e.obj) for e in discovery.of_type(found, torch.optim.Optimizer)
        ],
        stateful=[
            _StateDictObject.of(e.obj) for e in found.values() if isinstance(e.obj, stateful_types)
        ],
        rng=_RNGState.capture(generators.values()),
        switches=TorchSwitches.capture(),
        trainers=trainers.TrainerState.take(namespace),
        python=python,
    )


def available_memory_bytes() -> int | None:
    """Free host memory (MemAvailable), or None where the OS does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def too_big(found: dict[int, discovery.Found]) -> tuple[int, int] | None:
    """(bytes a snapshot of `found` would need, bytes of free host memory) when it would take
    more than SNAPSHOT_SHARE_OF_FREE_MEMORY of what is free; None when it fits or free
    memory is unknown."""
    free = available_memory_bytes()
    if free is None:
        return None
    needed = estimate_bytes(found)
    return (needed, free) if needed > SNAPSHOT_SHARE_OF_FREE_MEMORY * free else None
