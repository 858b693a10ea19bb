"""A notebook the way lecture notebooks are written, executed whole, with and without
`%%perfcheck` on its training cell: every later cell must print and draw what it did.

The notebook trains a character-level language model from raw tensors: a list of
parameters (`parameters = [C] + [p for layer in layers ...]`), layers written as plain
Python classes (no `nn.Module`: `self.out` kept for plotting, running statistics rebound as
attributes), manual SGD (`p.data += -lr * p.grad`), minibatches drawn with `torch.randint`
from a `torch.Generator`, an early `if i >= ...: break`, and lists made in an earlier cell
that the training cell appends to once per step (`lossi`, `stepi`, `ud`). The cells after
it plot those lists, print layer statistics and sample names from the model.

Both runs execute in real kernels through nbclient; outputs are compared cell by cell,
figures by the hash of their PNG.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]

SETUP = """
import random
import torch
import torch.nn.functional as F
import matplotlib
import matplotlib.pyplot as plt
%matplotlib inline
"""

DATA = """
# names made of syllables, shuffled with a fixed seed: the dataset is built with lists
rng = random.Random(42)
syllables = ["ka", "ri", "mo", "na", "le", "to", "su", "vi", "an", "el", "jo", "ra"]
words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
chars = sorted(set("".join(words)))
stoi = {s: i + 1 for i, s in enumerate(chars)}
stoi["."] = 0
itos = {i: s for s, i in stoi.items()}
vocab_size = len(itos)
block_size = 3

def build_dataset(words):
    X, Y = [], []
    for w in words:
        context = [0] * block_size
        for ch in w + ".":
            ix = stoi[ch]
            X.append(context)
            Y.append(ix)
            context = context[1:] + [ix]
    return torch.tensor(X), torch.tensor(Y)

n1 = int(0.9 * len(words))
Xtr, Ytr = build_dataset(words[:n1])
Xdev, Ydev = build_dataset(words[n1:])
print(Xtr.shape, Xdev.shape, vocab_size)
"""

LAYERS = """
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


n_embd, n_hidden = 10, 64
g = torch.Generator().manual_seed(2147483647)
C = torch.randn((vocab_size, n_embd), generator=g)
layers = [
    Linear(n_embd * block_size, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
    Linear(n_hidden, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh(),
    Linear(n_hidden, vocab_size, bias=False), BatchNorm1d(vocab_size),
]
with torch.no_grad():
    layers[-1].gamma *= 0.1
parameters = [C] + [p for layer in layers for p in layer.parameters()]
for p in parameters:
    p.requires_grad = True
print(sum(p.nelement() for p in parameters))
"""

LISTS = """
lossi = []
stepi = []
ud = []
"""

TRAIN = """
max_steps = 200000
batch_size = 32
for i in range(max_steps):
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
    if i % 400 == 0:
        print(f"{i:7d}/{max_steps:7d}: {loss.item():.4f}")
    stepi.append(i)
    lossi.append(loss.log10().item())
    with torch.no_grad():
        ud.append([((lr * p.grad).std() / p.data.std()).log10().item() for p in parameters])
    if i >= 1200:
        break
"""

LATER = [
    "print(len(lossi), len(stepi), len(ud), round(sum(lossi), 6))",
    "plt.figure(figsize=(6, 3)); plt.plot(stepi, lossi); plt.title('loss');",
    """
for i, layer in enumerate(layers[:-1]):
    if isinstance(layer, Tanh):
        t = layer.out
        print(i, f"{t.mean():+.4f} {t.std():.4f} {(t.abs() > 0.97).float().mean():.4f}")
        print(i, f"{t.grad.std():.6e}")
""",
    "print(layers[1].running_mean[0, :4], layers[4].running_var[0, :4])",
    """
plt.figure(figsize=(6, 3))
for i, p in enumerate(parameters):
    if p.ndim == 2:
        plt.plot([ud[j][i] for j in range(len(ud))])
""",
    """
@torch.no_grad()
def split_loss(X, Y):
    x = C[X].view(X.shape[0], -1)
    for layer in layers:
        x = layer(x)
    return F.cross_entropy(x, Y).item()

for layer in layers:
    layer.training = False
print(f"{split_loss(Xtr, Ytr):.6f} {split_loss(Xdev, Ydev):.6f}")
""",
    """
g2 = torch.Generator().manual_seed(2147483647 + 10)
for _ in range(5):
    out, context = [], [0] * block_size
    while True:
        x = C[torch.tensor([context])].view(1, -1)
        for layer in layers:
            x = layer(x)
        ix = torch.multinomial(F.softmax(x, dim=1), num_samples=1, generator=g2).item()
        context = context[1:] + [ix]
        out.append(ix)
        if ix == 0 or len(out) > 20:
            break
    print("".join(itos[i] for i in out))
""",
    "print(i, loss.item(), Xb.shape, g.initial_seed(), torch.equal(g.get_state(), g.get_state()))",
]


def _notebook(magic: str | None) -> nbformat.NotebookNode:
    cells = ["%load_ext torchtune_magic", SETUP, DATA, LAYERS, LISTS]
    train = TRAIN if magic is None else f"{magic}\n{TRAIN.lstrip()}"
    sources = [*cells, train, *LATER]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source.strip()) for source in sources]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    return notebook


def _outputs(cell: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """A cell's outputs as comparable text: streams, text results, PNGs by their hash. Text
    printed to one stream in a row is one output: the kernel sends it in as many messages as
    its flushes happen to cut it into, which timing decides, not the cell."""
    seen: list[tuple[str, str]] = []
    for output in cell.outputs:
        if output.output_type == "stream":
            if seen and seen[-1][0] == output.name:
                seen[-1] = (output.name, seen[-1][1] + output.text)
            else:
                seen.append((output.name, output.text))
        elif output.output_type in ("execute_result", "display_data"):
            data = output.data
            if "image/png" in data:
                seen.append(("png", hashlib.sha256(data["image/png"].encode()).hexdigest()))
            elif "text/plain" in data:
                seen.append(("text", data["text/plain"]))
        elif output.output_type == "error":
            seen.append(("error", f"{output.ename}: {output.evalue}"))
    return seen


def _execute(notebook: nbformat.NotebookNode, cwd: Path) -> nbformat.NotebookNode:
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(cwd)}}
    )
    return client.execute()


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


def test_every_later_cell_prints_and_draws_what_it_did_without_perfcheck(kernel_env: Path):
    plain = _execute(_notebook(None), kernel_env)
    checked = _execute(_notebook("%%perfcheck --budget 8 --no-widget"), kernel_env)
    train_at = 5
    # the checked cell: its report, and the lines the cell printed, once
    printed = "".join(text for name, text in _outputs(plain.cells[train_at]) if name == "stdout")
    report = checked.cells[train_at]
    streams = "".join(o.get("text", "") for o in report.outputs if o.output_type == "stream")
    assert printed and streams.count(printed.splitlines()[0]) == 1, streams
    assert all(line in streams for line in printed.splitlines())
    texts = [o.data.get("text/plain", "") for o in report.outputs if "data" in o]
    assert any("%%perfcheck report" in text for text in texts)
    assert any("iteration" in text for text in texts)  # sampled by its loop's iterations
    for index in range(train_at + 1, len(plain.cells)):
        assert _outputs(checked.cells[index]) == _outputs(plain.cells[index]), (
            f"cell {index} differs after %%perfcheck:\n{plain.cells[index].source}"
        )
    figures = [kind for cell in plain.cells for kind, _ in _outputs(cell) if kind == "png"]
    assert len(figures) == 2  # the comparison covered the plots
