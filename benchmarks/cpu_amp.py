"""Does perfcheck's bf16 autocast on a CPU find the speedup a hand-written autocast gets?

    python benchmarks/cpu_amp.py [--json PATH] [--repeats N] [--rounds N] [--budget S]
                                 [--threads N]

Two cells, each measured two ways in one process: through `perfcheck(..., checks="amp")`
(its reported speedup of the `amp` fix), and as the plain cell against the same cell
written by hand under `torch.autocast("cpu", dtype=torch.bfloat16)`, timed interleaved
(A B A B …) from the same restored state. On a shared machine the load drifts by tens of
percent within minutes, so the two ways alternate too (`--repeats` times) and their medians
are compared. Target: perfcheck's speedup within 10% of the hand version's.

- a transformer block (nn.TransformerEncoderLayer, d_model 256, 4 heads, FF 1024) training
  for 3 optimizer steps on a (16, 128, 256) batch;
- a CNN (four 3x3 convs, 32-128 channels) scoring one (32, 3, 64, 64) inference batch.

Writes JSON (default benchmarks/results/cpu_amp.json) with the CPU's bf16 flags, torch's
CPU capability and thread count, and prints a table. On a CPU without native bf16, `amp`
is not applicable and the script says so. On a small machine shared with other work, run
it with `--threads 1`: a parallel region waits for its slowest thread, and a thread that
loses its core to another process stalls it, so two threads on two busy cores measure the
neighbours more than bf16 (the committed result is a one-thread run on 2 shared cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtune_magic import perfcheck
from torchtune_magic.probe import cpu

HEADER = 'with torch.autocast("cpu", dtype=torch.bfloat16):\n'


@dataclass
class Cell:
    name: str
    setup: str
    cell: str
    model: str  # the namespace name of the model whose state each run starts from
    optimizer: str | None = None

    @property
    def by_hand(self) -> str:
        """The same cell, written under autocast by hand."""
        return HEADER + textwrap.indent(self.cell, "    ")


CELLS = [
    Cell(
        "transformer block, training step",
        """
import torch
from torch import nn
torch.manual_seed(0)
block = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0, batch_first=True)
opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
x, target = torch.randn(16, 128, 256), torch.randn(16, 128, 256)
""",
        """for _ in range(3):
    opt.zero_grad()
    loss = nn.functional.mse_loss(block(x), target)
    loss.backward()
    opt.step()
""",
        "block",
        "opt",
    ),
    Cell(
        "CNN, inference batch",
        """
import torch
from torch import nn
torch.manual_seed(0)
cnn = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
    nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
    nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Linear(128, 10),
).eval()
images = torch.randn(32, 3, 64, 64)
""",
        """with torch.no_grad():
    logits = cnn(images)
""",
        "cnn",
    ),
]


def namespace(setup: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(setup), ns)
    return ns


class Restorer:
    """Puts the model (and optimizer) back to the state the cell started from."""

    def __init__(self, ns: dict[str, Any], cell: Cell):
        self.ns, self.cell = ns, cell
        self.model = copy.deepcopy(ns[cell.model].state_dict())
        self.opt = copy.deepcopy(ns[cell.optimizer].state_dict()) if cell.optimizer else None
        self.rng = torch.get_rng_state()

    def __call__(self) -> None:
        self.ns[self.cell.model].load_state_dict(self.model)
        if self.cell.optimizer and self.opt is not None:
            self.ns[self.cell.optimizer].load_state_dict(copy.deepcopy(self.opt))
        torch.set_rng_state(self.rng)


def by_hand(cell: Cell, rounds: int) -> dict[str, float]:
    """The plain cell against the hand-written autocast cell, interleaved, one warm-up each."""
    ns = namespace(cell.setup)
    restore = Restorer(ns, cell)
    code = {"plain": compile(cell.cell, "<plain>", "exec")}
    code["autocast"] = compile(cell.by_hand, "<autocast>", "exec")
    times: dict[str, list[float]] = {"plain": [], "autocast": []}
    for round_ in range(rounds + 1):
        for label in ("plain", "autocast") if round_ % 2 else ("autocast", "plain"):
            restore()
            start = time.perf_counter()
            exec(code[label], ns)
            if round_:  # round 0 warms both up
                times[label].append(time.perf_counter() - start)
    plain, fast = statistics.median(times["plain"]), statistics.median(times["autocast"])
    return {"plain_median_s": plain, "autocast_median_s": fast, "speedup": plain / fast}


def through_perfcheck(cell: Cell, budget: float) -> dict[str, Any]:
    report = perfcheck(cell.cell, namespace(cell.setup), checks="amp", budget=budget)
    skipped = {item.id: item.reason for item in report.not_applicable}
    if "amp" in skipped:
        return {"speedup": None, "why": skipped["amp"]}
    variant = report.variant_for(["amp"])
    if variant is None:
        return {"speedup": None, "why": "amp was not flagged on this cell"}
    return {
        "speedup": variant.speedup,
        "baseline_median_s": report.baseline.median_s,
        "amp_median_s": variant.median_s,
        "unit": report.sampling.unit if report.sampling else "whole cell",
        "numerics": variant.numerics.verdict,
        "max_rel_diff": variant.numerics.max_rel_diff,
        "evidence": report.finding("amp").evidence,  # type: ignore[union-attr]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="benchmarks/results/cpu_amp.json")
    parser.add_argument("--repeats", type=int, default=3, help="perfcheck / by-hand turns")
    parser.add_argument("--rounds", type=int, default=8, help="A/B rounds per by-hand turn")
    parser.add_argument("--budget", type=float, default=10.0)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    results: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cores": cpu.available_cores().detail,
        "cpu_bf16_flags": cpu.bf16_features(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cells": [],
    }
    for cell in CELLS:
        runs = []
        for _ in range(args.repeats):
            runs.append({"perfcheck": through_perfcheck(cell, args.budget)})
            runs[-1]["by_hand"] = by_hand(cell, args.rounds)
        found = [r["perfcheck"]["speedup"] for r in runs if r["perfcheck"]["speedup"]]
        hand = statistics.median(r["by_hand"]["speedup"] for r in runs)
        row: dict[str, Any] = {"cell": cell.name, "runs": runs, "by_hand": hand}
        row["perfcheck"] = statistics.median(found) if found else None
        row["ratio"] = row["perfcheck"] / hand if row["perfcheck"] else None
        results["cells"].append(row)

    flags = ", ".join(results["cpu_bf16_flags"]) or "none"
    print(f"CPU bf16 flags: {flags}; {results['cores']}; {results['threads']} torch threads")
    print("| cell | perfcheck amp | by hand | perfcheck / hand | numerics | within 10% |")
    print("|---|---|---|---|---|---|")
    met = True
    for row in results["cells"]:
        last = row["runs"][-1]["perfcheck"]
        ok = row["ratio"] is not None and abs(row["ratio"] - 1) <= 0.10
        met = met and ok
        shown = f"{row['perfcheck']:.2f}x" if row["perfcheck"] else last["why"]
        numerics = last.get("numerics", "")
        if last.get("max_rel_diff") is not None:
            numerics += f" ({last['max_rel_diff']:.1e})"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        print(
            f"| {row['cell']} | {shown} | {row['by_hand']:.2f}x | {ratio} | {numerics} | "
            f"{'yes' if ok else 'NO'} |"
        )
    results["targets_met"] = met
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
