"""What the state guard's snapshot of plain Python objects costs on a real notebook's
namespace: Karpathy's makemore lecture 3 (hand-written layers, BatchNorm, `lossi`/`ud`).

    python benchmarks/python_state.py [--json PATH] [--repeats N]

The namespace is the lecture's, built as its cells build it: 32,032 names (random letters
of the lecture's lengths, 3-10, as names.txt is not bundled), `stoi`/`itos`, the
`Xtr`/`Ytr` (~190k x 3) split, 17 hand-written layers (Linear, BatchNorm1d, Tanh), and
`lossi`/`ud` grown by earlier training (0, then 3,000 steps: `ud` holds a list per step).
The training cell (20 steps) is the lecture's own. Timed, `--repeats` times each, min and
median: `state.take` (the whole snapshot, tensors included) and `pystate.take` (the Python
objects alone); a restore between measuring runs (`restore(written_only=True)`, after a
run) and the full restore at the end, for the whole snapshot and for its Python part.
Writes JSON (default benchmarks/results/python_state.json) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtune_magic.kernel import discovery, pystate, state

SETUP = """
import random
import torch
import torch.nn.functional as F
letters = 'abcdefghijklmnopqrstuvwxyz'
words = [''.join(random.choice(letters) for _ in range(random.randint(3, 10)))
         for _ in range(32032)]
chars = sorted(list(set(''.join(words))))
stoi = {s: i + 1 for i, s in enumerate(chars)}
stoi['.'] = 0
itos = {i: s for s, i in stoi.items()}
vocab_size = len(itos)
block_size = 3

def build_dataset(words):
    X, Y = [], []
    for w in words:
        context = [0] * block_size
        for ch in w + '.':
            ix = stoi[ch]
            X.append(context)
            Y.append(ix)
            context = context[1:] + [ix]
    return torch.tensor(X), torch.tensor(Y)

random.seed(42)
random.shuffle(words)
n1, n2 = int(0.8 * len(words)), int(0.9 * len(words))
Xtr, Ytr = build_dataset(words[:n1])
Xdev, Ydev = build_dataset(words[n1:n2])
Xte, Yte = build_dataset(words[n2:])
g = torch.Generator().manual_seed(2147483647)

class Linear:
    def __init__(self, fan_in, fan_out, bias=True):
        self.weight = torch.randn((fan_in, fan_out), generator=g) / fan_in**0.5
        self.bias = torch.zeros(fan_out) if bias else None
    def __call__(self, x):
        self.out = x @ self.weight
        if self.bias is not None:
            self.out += self.bias
        return self.out
    def parameters(self):
        return [self.weight] + ([] if self.bias is None else [self.bias])

class BatchNorm1d:
    def __init__(self, dim, eps=1e-5, momentum=0.1):
        self.eps, self.momentum, self.training = eps, momentum, True
        self.gamma, self.beta = torch.ones(dim), torch.zeros(dim)
        self.running_mean, self.running_var = torch.zeros(dim), torch.ones(dim)
    def __call__(self, x):
        if self.training:
            xmean, xvar = x.mean(0, keepdim=True), x.var(0, keepdim=True)
        else:
            xmean, xvar = self.running_mean, self.running_var
        xhat = (x - xmean) / torch.sqrt(xvar + self.eps)
        self.out = self.gamma * xhat + self.beta
        if self.training:
            with torch.no_grad():
                self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * xmean
                self.running_var = (1 - self.momentum) * self.running_var + self.momentum * xvar
        return self.out
    def parameters(self):
        return [self.gamma, self.beta]

class Tanh:
    def __call__(self, x):
        self.out = torch.tanh(x)
        return self.out
    def parameters(self):
        return []

n_embd, n_hidden = 10, 100
C = torch.randn((vocab_size, n_embd), generator=g)
layers = [Linear(n_embd * block_size, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh()]
for _ in range(4):
    layers += [Linear(n_hidden, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh()]
layers += [Linear(n_hidden, vocab_size, bias=False), BatchNorm1d(vocab_size)]
with torch.no_grad():
    layers[-1].gamma *= 0.1
    for layer in layers[:-1]:
        if isinstance(layer, Linear):
            layer.weight *= 5 / 3
parameters = [C] + [p for layer in layers for p in layer.parameters()]
for p in parameters:
    p.requires_grad = True
max_steps, batch_size = 200000, 32
lossi, ud = [], []
"""

TRAIN = """
for i in range({steps}):
    ix = torch.randint(0, Xtr.shape[0], (batch_size,), generator=g)
    Xb, Yb = Xtr[ix], Ytr[ix]
    emb = C[Xb]
    x = emb.view(emb.shape[0], -1)
    for layer in layers:
        x = layer(x)
    loss = F.cross_entropy(x, Yb)
    for layer in layers:
        layer.out.retain_grad()
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < 150000 else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    if i % 10000 == 0:
        print(f'{{i:7d}}/{{max_steps:7d}}: {{loss.item():.4f}}')
    lossi.append(loss.log10().item())
    with torch.no_grad():
        ud.append([((lr * p.grad).std() / p.data.std()).log10().item() for p in parameters])
"""
CELL = TRAIN.format(steps=20)


def makemore(trained_steps: int) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    random.seed(0)
    exec(SETUP, namespace)
    if trained_steps:
        _quiet(TRAIN.format(steps=trained_steps), namespace)
    return namespace


def _quiet(cell: str, namespace: dict[str, Any]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        exec(cell, namespace)


def _ms(times: list[float]) -> dict[str, float]:
    return {"min_ms": 1e3 * min(times), "median_ms": 1e3 * statistics.median(times)}


def _timed(call: Callable[[], Any], repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return _ms(times)


def _restore_after_runs(
    snapshot: state.Snapshot, restore: Callable[[], None], repeats: int
) -> dict[str, float]:
    """A run of the cell, then the restore, timed alone; the full restore after each."""
    times = []
    for _ in range(repeats):
        _quiet(CELL, snapshot.namespace)
        started = time.perf_counter()
        restore()
        times.append(time.perf_counter() - started)
        snapshot.restore()
    return _ms(times)


def measure(trained_steps: int, repeats: int) -> dict[str, Any]:
    ns = makemore(trained_steps)
    found = discovery.walk(ns)
    reads = pystate.cell_reads(CELL, ns)
    result: dict[str, Any] = {
        "lossi_entries": len(ns["lossi"]),
        "state.take": _timed(lambda: state.take(ns, found, CELL), repeats),
        "pystate.take": _timed(lambda: pystate.take(ns, reads), repeats),
    }
    snapshot = state.take(ns, found, CELL)
    python = snapshot.python
    assert python is not None and not python.not_covered
    result["python_parts"] = len(python.parts)
    result["references_copied"] = sum(part.size for part in python.parts)
    _quiet(CELL, ns)  # the probe's run
    snapshot.note_unwritten()
    snapshot.restore()
    steps = {
        "Snapshot.restore(written_only=True)": lambda: snapshot.restore(written_only=True),
        "Snapshot.restore()": snapshot.restore,
        "PyState.restore(written_only=True)": lambda: python.restore(written_only=True),
        "PyState.restore()": python.restore,
    }
    for label, restore in steps.items():
        result[label] = _restore_after_runs(snapshot, restore, repeats)
    assert len(ns["lossi"]) == trained_steps  # as before the runs
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=Path, default=Path(__file__).parent / "results/python_state.json"
    )
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    results = {f"trained {steps} steps": measure(steps, args.repeats) for steps in (0, 3000)}
    for name, result in results.items():
        print(
            f"--- {name}: {result['python_parts']} parts, "
            f"{result['references_copied']:,} references copied"
        )
        for label, value in result.items():
            if isinstance(value, dict):
                low, middle = value["min_ms"], value["median_ms"]
                print(f"  {label:38s} min {low:7.2f} ms  median {middle:7.2f} ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
