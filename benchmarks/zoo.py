"""The zoo: realistic notebook cells (and clean controls) through `perfcheck`.

    python benchmarks/zoo.py [--json PATH] [--budget SECONDS] [--only NAME,...]

For each cell: which findings were expected and which came, and for each expected fix the
measured speedup, peak memory before/after, one-time cost (compile, worker start-up) and
numerics verdict, checked against the targets the issue sets. Prints a table (recall, false
alarms, per-fix numbers) and writes JSON (default `benchmarks/results/zoo.json`).

The budget per cell is 15 s: a speedup is stated once paired rounds give it an interval
(at least ten rounds, `measuring/verdict.py`), and a 0.46 s loader cell with a worker trial
needs about that much; at 4 s the loader and fusion fixes read "not enough time to tell".

Each cell runs in a fresh namespace built by its own "earlier cells" (`setup`), with every
check on, so a finding nobody expected counts as a false alarm. The inductor cache is a
fresh folder per run, so compile times are the real first-compile cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the package, and zoo_data for workers

DEFAULT_JSON = HERE / "results" / "zoo.json"


@dataclass
class Target:
    """What the issue asks of a fix on this cell: `speedup` ≥ value, or peak `memory`
    lower by ≥ value (baseline peak / fixed peak)."""

    kind: str  # "speedup" | "memory"
    value: float


@dataclass
class ZooCell:
    name: str
    setup: str  # the earlier cells
    cell: str
    expect: tuple[str, ...] = ()  # ids that must be found; () = a clean control
    also: tuple[str, ...] = ()  # true findings that may also come (not false alarms)
    targets: dict[str, Target] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    # each expected fix made by hand, as a user would after reading the finding:
    # (the earlier cells, the checked cell) — what benchmarks/engine_overhead.py times A/B
    hand_fixed: dict[str, tuple[str, str]] = field(default_factory=dict)


MLP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(256, 32), torch.randn(256, 1)
"""
TRAIN_STEP = """
for i in range(0, 256, 64):
    loss = nn.functional.mse_loss(model(X[i:i + 64]), Y[i:i + 64])
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
NEW_GELU = """
import torch
torch.manual_seed(0)
def new_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))
acts = torch.randn(1024, 4096)  # 16 MiB: past the caches, as activations are
"""
DEEP_RESIDUAL = """
import torch
from torch import nn
torch.manual_seed(0)
class Residual(nn.Module):
    def __init__(self, width=128, hidden=512):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)
    def forward(self, x):
        return x + self.down(self.act(self.up(x)))
class DeepMLP(nn.Module):
    def __init__(self, depth=16):
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(depth))
        self.head = nn.Linear(128, 1)
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
model = DeepMLP()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(1024, 128)
"""
DEEP_STEP = "loss = model(x).square().mean()\nopt.zero_grad()\nloss.backward()\nopt.step()\n"
CNN = """
import torch
from torch import nn
torch.manual_seed(0)
cnn = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
).eval()
images = torch.randn(16, 3, 64, 64)
"""
CONV_BN_BLOCK = (
    "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
    "class Block(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.bn = nn.BatchNorm2d(16)\n"
    "        self.conv = nn.Conv2d(3, 16, 3, padding=1)\n"
    "    def forward(self, x):\n"
    "        return self.bn(self.conv(x)).relu().mean()\n"
    "net = Block()\nopt = torch.optim.SGD(net.parameters(), lr=0.01)\n"
    "images = torch.randn(8, 3, 32, 32)\n"
)
CONV_BN_TRAIN = (
    "for _ in range(3):\n    opt.zero_grad()\n    net(images).backward()\n    opt.step()\n"
)
CHANNELS_LAST = (
    "cnn = cnn.to(memory_format=torch.channels_last)\n"
    "images = images.contiguous(memory_format=torch.channels_last)\n"
)
CNN_INFER = "with torch.no_grad():\n    for _ in range(3):\n        logits = cnn(images)\n"
SWIGLUISH = (
    "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
    "class SwiGLUish(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.proj = nn.Linear(256, 256)\n"
    "    def forward(self, x):\n"
    "        h = self.proj(x)\n"
    "        return h * torch.sigmoid(1.702 * h) * (1.0 + 0.1 * torch.tanh(h)) - h / 8.0\n"
)
MAKE_ACTIVATION = (
    "import torch\ntorch.manual_seed(0)\n"
    "def make_activation(alpha):\n"
    "    def activation(x):\n"
    "        return torch.exp(-alpha * x * x) * x + torch.sin(x) * alpha - x / 3.0\n"
    "    return activation\n"
)
LOADER = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zoo_data import SlowFileDataset
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""
LOADER_LOOP = """
for xb, yb in loader:
    loss = nn.functional.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

ZOO: list[ZooCell] = [
    ZooCell(
        "slow-io-loader",
        LOADER + "loader = DataLoader(SlowFileDataset(), batch_size=16, shuffle=True)\n",
        LOADER_LOOP,
        expect=("dataloader-workers",),
        targets={"dataloader-workers": Target("speedup", 2.0)},
        hand_fixed={
            "dataloader-workers": (
                LOADER + "loader = DataLoader(SlowFileDataset(), batch_size=16, shuffle=True,"
                " num_workers={workers}, persistent_workers=True)\n",
                LOADER_LOOP,
            )
        },
    ),
    ZooCell(
        "in-memory-loader (control)",
        LOADER + "loader = DataLoader(TensorDataset(torch.randn(96, 32), torch.randn(96, 1)),"
        " batch_size=16)\n",
        LOADER_LOOP,
    ),
    ZooCell(
        "conv-bias-before-bn",
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),"
        " nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)).eval()\n"
        "images = torch.randn(8, 3, 32, 32)\n",
        "with torch.no_grad():\n    out = net(images)\n",
        expect=("conv-bias-bn",),
        also=("channels-last",),
        hand_fixed={
            "conv-bias-bn": (
                "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
                "net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False),"
                " nn.BatchNorm2d(16), nn.ReLU(),"
                " nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)).eval()\n"
                "images = torch.randn(8, 3, 32, 32)\n",
                "with torch.no_grad():\n    out = net(images)\n",
            )
        },
    ),
    ZooCell(
        "pointwise-function (earlier cell)",
        NEW_GELU,
        "for _ in range(10):\n    y = new_gelu(acts)\n",
        expect=("fuse-pointwise",),
        targets={"fuse-pointwise": Target("speedup", 2.0)},
        hand_fixed={
            "fuse-pointwise": (
                NEW_GELU + "new_gelu = torch.compile(new_gelu)\n",
                "for _ in range(10):\n    y = new_gelu(acts)\n",
            )
        },
    ),
    ZooCell(
        "pointwise-in-user-module",
        SWIGLUISH + "block = SwiGLUish()\nx = torch.randn(512, 256)\n",
        "with torch.no_grad():\n    for _ in range(10):\n        y = block(x)\n",
        expect=("fuse-pointwise",),
        hand_fixed={
            "fuse-pointwise": (
                SWIGLUISH + "block = SwiGLUish()\nblock.compile()\nx = torch.randn(512, 256)\n",
                "with torch.no_grad():\n    for _ in range(10):\n        y = block(x)\n",
            )
        },
    ),
    ZooCell(
        "pointwise-closure (factory)",
        MAKE_ACTIVATION + "act = make_activation(0.5)\nz = torch.randn(256, 1024)\n",
        "for _ in range(10):\n    y = act(z)\n",
        expect=("fuse-pointwise",),
        hand_fixed={
            "fuse-pointwise": (
                MAKE_ACTIVATION + "act = torch.compile(make_activation(0.5))\n"
                "z = torch.randn(256, 1024)\n",
                "for _ in range(10):\n    y = act(z)\n",
            )
        },
    ),
    ZooCell(
        "matmul-heavy (control)",
        "import torch\ntorch.manual_seed(0)\na, b = torch.randn(512, 512), torch.randn(512, 512)\n",
        "for _ in range(5):\n    c = torch.relu(a @ b)\n",
    ),
    ZooCell(
        "deep-residual-mlp --memory",
        DEEP_RESIDUAL,
        DEEP_STEP,
        expect=("activation-checkpointing",),
        targets={"activation-checkpointing": Target("memory", 3.0)},
        options={"memory": True},
        hand_fixed={
            "activation-checkpointing": (
                DEEP_RESIDUAL.replace(
                    "            x = block(x)\n",
                    "            x = torch.utils.checkpoint.checkpoint(\n"
                    "                block, x, use_reentrant=False\n"
                    "            )\n",
                ),
                DEEP_STEP,
            )
        },
    ),
    ZooCell("deep-residual-mlp (control: memory not asked)", DEEP_RESIDUAL, DEEP_STEP),
    ZooCell(
        "cnn-nchw-inference",
        CNN,
        CNN_INFER,
        expect=("channels-last",),
        hand_fixed={"channels-last": (CNN + CHANNELS_LAST, CNN_INFER)},
    ),
    ZooCell(
        "cnn-channels-last (control)",
        CNN + CHANNELS_LAST,
        CNN_INFER,
    ),
    ZooCell(
        "debug-anomaly",
        MLP,
        "with torch.autograd.detect_anomaly():\n" + textwrap.indent(TRAIN_STEP, "    "),
        expect=("debug-anomaly",),
        hand_fixed={"debug-anomaly": (MLP, TRAIN_STEP)},
    ),
    ZooCell(
        "debug-profiler",
        MLP,
        "with torch.autograd.profiler.profile() as prof:\n" + textwrap.indent(TRAIN_STEP, "    "),
        expect=("debug-profiler",),
        hand_fixed={"debug-profiler": (MLP, TRAIN_STEP)},
    ),
    ZooCell(
        "gradcheck-in-loop",
        MLP + "w = torch.randn(4, 4, dtype=torch.double, requires_grad=True)\n",
        "from torch.autograd import gradcheck\n"
        + TRAIN_STEP
        + "    gradcheck(lambda t: (t * t).sum(), (w,))\n",
        expect=("debug-gradcheck",),
        hand_fixed={
            "debug-gradcheck": (
                MLP + "w = torch.randn(4, 4, dtype=torch.double, requires_grad=True)\n",
                "from torch.autograd import gradcheck\n" + TRAIN_STEP,
            )
        },
    ),
    ZooCell(
        "eval-with-grad",
        MLP,
        "for i in range(0, 256, 64):\n    pred = model(X[i:i + 64])\n",
        expect=("no-grad",),
        hand_fixed={
            "no-grad": (
                MLP,
                "with torch.no_grad():\n"
                "    for i in range(0, 256, 64):\n        pred = model(X[i:i + 64])\n",
            )
        },
    ),
    ZooCell(
        "zero-grad-in-place",
        MLP,
        TRAIN_STEP.replace("opt.zero_grad()", "opt.zero_grad(set_to_none=False)"),
        expect=("zero-grad-none",),
        hand_fixed={"zero-grad-none": (MLP, TRAIN_STEP)},
    ),
    ZooCell(
        "slow-io-loader in a trainer object",
        LOADER + "class Trainer:\n"
        "    def __init__(self):\n"
        "        self.loader = DataLoader(SlowFileDataset(), batch_size=16, shuffle=True)\n"
        "trainer = Trainer()\n",
        LOADER_LOOP.replace("in loader", "in trainer.loader"),
        expect=("dataloader-workers",),
        targets={"dataloader-workers": Target("speedup", 2.0)},
        hand_fixed={
            "dataloader-workers": (
                LOADER + "class Trainer:\n"
                "    def __init__(self):\n"
                "        self.loader = DataLoader(SlowFileDataset(), batch_size=16, shuffle=True,"
                " num_workers={workers}, persistent_workers=True)\n"
                "trainer = Trainer()\n",
                LOADER_LOOP.replace("in loader", "in trainer.loader"),
            )
        },
    ),
    ZooCell(
        "slow-io-loader behind a generator closure",
        LOADER + "def stream(loader):\n"
        "    def batches():\n"
        "        yield from loader\n"
        "    return batches\n"
        "batches = stream(DataLoader(SlowFileDataset(), batch_size=16))\n",
        LOADER_LOOP.replace("in loader", "in batches()"),
        expect=("dataloader-workers",),
        targets={"dataloader-workers": Target("speedup", 2.0)},
        hand_fixed={
            "dataloader-workers": (
                LOADER + "def stream(loader):\n"
                "    def batches():\n"
                "        yield from loader\n"
                "    return batches\n"
                "batches = stream(DataLoader(SlowFileDataset(), batch_size=16,"
                " num_workers={workers}, persistent_workers=True))\n",
                LOADER_LOOP.replace("in loader", "in batches()"),
            )
        },
    ),
    ZooCell(
        "conv-bias-bn in a custom forward (train)",
        CONV_BN_BLOCK,
        CONV_BN_TRAIN,
        expect=("conv-bias-bn",),
        also=("channels-last",),
        hand_fixed={
            "conv-bias-bn": (
                CONV_BN_BLOCK.replace(
                    "nn.Conv2d(3, 16, 3, padding=1)", "nn.Conv2d(3, 16, 3, padding=1, bias=False)"
                ),
                CONV_BN_TRAIN,
            )
        },
    ),
    ZooCell(
        "conv then relu then bn (control)",
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.BatchNorm2d(16)).eval()\n"
        "images = torch.randn(8, 3, 32, 32)\n",
        "with torch.no_grad():\n    out = net(images)\n",
        also=("channels-last",),
    ),
    ZooCell("clean-training (control)", MLP, TRAIN_STEP),
    ZooCell(
        "clean-inference (control)",
        MLP,
        "with torch.no_grad():\n"
        "    for i in range(0, 256, 64):\n"
        "        pred = model(X[i:i + 64])\n",
    ),
]


@dataclass
class FixResult:
    id: str
    speedup: float | None
    base_peak: int | None
    peak: int | None
    one_time_s: float | None
    break_even_runs: int | None
    numerics: str
    error: str | None
    target: str | None = None
    target_met: bool | None = None

    @property
    def memory_ratio(self) -> float | None:
        return self.base_peak / self.peak if self.base_peak and self.peak else None


@dataclass
class CellResult:
    name: str
    expected: list[str]
    found: list[str]
    missed: list[str]
    false_alarms: list[str]
    fixes: list[FixResult]
    seconds: float
    error: str | None = None


def run_cell(entry: ZooCell, budget: float) -> CellResult:
    import torchtune_magic

    namespace: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        exec(textwrap.dedent(entry.setup), namespace)
        report = torchtune_magic.perfcheck(entry.cell, namespace, budget=budget, **entry.options)
    except Exception as error:  # a broken zoo cell is reported, not fatal
        return CellResult(
            entry.name, list(entry.expect), [], list(entry.expect), [], [],
            time.perf_counter() - started, f"{type(error).__name__}: {error}",
        )  # fmt: skip
    found = [f.id for f in report.findings]
    fixes = []
    for check_id in entry.expect:
        variant = report.variant_for([check_id])
        if variant is None:
            continue
        result = FixResult(
            check_id,
            variant.speedup,
            report.baseline.peak_memory_bytes,
            variant.peak_memory_bytes,
            variant.one_time_s,
            variant.break_even_runs,
            variant.numerics.verdict,
            variant.error,
        )
        target = entry.targets.get(check_id)
        if target is not None:
            measured = result.speedup if target.kind == "speedup" else result.memory_ratio
            label = "faster" if target.kind == "speedup" else "lower peak"
            result.target = f"≥{target.value:g}x {label}"
            result.target_met = measured is not None and measured >= target.value
        fixes.append(result)
    return CellResult(
        entry.name,
        list(entry.expect),
        found,
        [i for i in entry.expect if i not in found],
        [i for i in found if i not in entry.expect and i not in entry.also],
        fixes,
        time.perf_counter() - started,
    )


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def table(results: list[CellResult]) -> str:
    rows = [f"{'cell':46} {'expected':26} {'found':40} {'miss':5} {'false alarms':20} s"]
    for r in results:
        rows.append(
            f"{r.name[:46]:46} {','.join(r.expected) or '(control)':26} "
            f"{','.join(r.found)[:40] or '–':40} {len(r.missed):<5} "
            f"{','.join(r.false_alarms) or '–':20} {r.seconds:.0f}"
            + (f"  ERROR {r.error}" if r.error else "")
        )
    rows.append("")
    rows.append(
        f"{'fix':26} {'cell':36} {'speedup':>8} {'peak mem':>22} {'one-time':>9} "
        f"{'b/even':>6} {'numerics':10} target"
    )
    for r in results:
        for f in r.fixes:
            memory = "–"
            if f.base_peak is not None and f.peak is not None:
                memory = f"{f.base_peak / 2**20:.1f}→{f.peak / 2**20:.1f} MiB"
                if f.memory_ratio:
                    memory += f" ({f.memory_ratio:.1f}x)"
            target = (
                "–" if f.target is None else f"{f.target}: {'met' if f.target_met else 'MISSED'}"
            )
            rows.append(
                f"{f.id:26} {r.name[:36]:36} {_x(f.speedup):>8} {memory:>22} "
                f"{'–' if f.one_time_s is None else f'{f.one_time_s:.2f}s':>9} "
                f"{'–' if f.break_even_runs is None else f.break_even_runs:>6} "
                f"{f.numerics:10} {target}" + (f"  error: {f.error}" if f.error else "")
            )
    return "\n".join(rows)


def summary(results: list[CellResult]) -> dict[str, Any]:
    expected = sum(len(r.expected) for r in results)
    hits = sum(len(r.expected) - len(r.missed) for r in results)
    controls = [r for r in results if not r.expected]
    targets = [f for r in results for f in r.fixes if f.target is not None]
    return {
        "cells": len(results),
        "controls": len(controls),
        "recall": hits / expected if expected else None,
        "expected_findings": expected,
        "false_alarms": sum(len(r.false_alarms) for r in results),
        "controls_with_false_alarms": sum(1 for r in controls if r.false_alarms),
        "targets_met": f"{sum(1 for f in targets if f.target_met)}/{len(targets)}",
        "errors": sum(1 for r in results if r.error),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--budget", type=float, default=15.0, help="perfcheck budget per cell")
    parser.add_argument("--only", default="", help="comma list of cell names (substrings)")
    args = parser.parse_args(argv)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo-inductor-")
    import torch

    wanted = [w for w in args.only.split(",") if w]
    cells = [c for c in ZOO if not wanted or any(w in c.name for w in wanted)]
    started = time.perf_counter()
    results = []
    for entry in cells:
        result = run_cell(entry, args.budget)
        print(f"  {entry.name}: {result.seconds:.1f} s", file=sys.stderr, flush=True)
        results.append(result)
    totals = summary(results)
    totals["total_seconds"] = round(time.perf_counter() - started, 1)
    print(table(results))
    print()
    print(
        f"recall {totals['recall']:.0%} ({totals['expected_findings']} expected findings), "
        f"false alarms {totals['false_alarms']} "
        f"({totals['controls_with_false_alarms']} of {totals['controls']} controls), "
        f"targets met {totals['targets_met']}, errors {totals['errors']}, "
        f"{totals['total_seconds']:.0f} s total"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": {
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "budget_s": args.budget,
        },
        "summary": totals,
        "cells": [asdict(r) | {"fixes": [asdict(f) for f in r.fixes]} for r in results],
    }
    args.json.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
