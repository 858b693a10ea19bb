"""`ddp-no-sync` under real torchrun: perfcheck's speedup against an A/B of the hand-fixed
script, and perfcheck's per-run overhead, in one job.

    python benchmarks/distributed.py [--nproc 2] [--rounds 12] [--budget 30] [--json PATH]

Two ranks (gloo, CPU, one thread each) train a wide MLP with gradient accumulation over 8
micro-batches of 4 samples: its 16 MiB of gradients make the all-reduce a large share of
each micro-batch, as on real multi-GPU jobs where accumulation is used to reach a batch
size. In one torchrun job, rank 0 reports:

- the A/B: the cell as written (all-reduce on every micro-batch) and the same cell with the
  `no_sync()` form written by hand, in paired rounds (the order alternating), each run's
  time the slowest rank's; before and after perfcheck, so both sides see the same machine;
- perfcheck's own: `perfcheck(CELL, globals(), checks="ddp-no-sync")`, its speedup with
  interval and its baseline;
- the agreement (perfcheck's speedup against the A/B's, target within 10 %) and the
  per-run overhead (perfcheck's baseline against the plain cell's A/B time, target < 2 %).

Writes JSON (default benchmarks/results/distributed.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

JOB = r'''
import json, statistics, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

rounds, budget, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(4, 1024, generator=g), torch.randn(4, 1024, generator=g))
           for _ in range(32)]
accumulate = 8

CELL = """
for i, (x, y) in enumerate(batches):
    loss = torch.nn.functional.mse_loss(model(x), y) / accumulate
    loss.backward()
    if (i + 1) % accumulate == 0:
        opt.step()
        opt.zero_grad()
"""
FIXED = """
for i, (x, y) in enumerate(batches):
    sync = (i + 1) % accumulate == 0
    with contextlib.nullcontext() if sync else model.no_sync():
        loss = torch.nn.functional.mse_loss(model(x), y) / accumulate
        loss.backward()
    if sync:
        opt.step()
        opt.zero_grad()
"""
import contextlib


def timed(source):
    dist.barrier()
    start = time.perf_counter()
    exec(source, globals())
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, dist.ReduceOp.MAX)  # a run ends when its slowest rank's does
    return float(seconds.item())


def ab(n):
    plain, fixed, ratios = [], [], []
    for index in range(n):
        order = [CELL, FIXED] if index % 2 == 0 else [FIXED, CELL]
        times = {source: timed(source) for source in order}
        plain.append(times[CELL])
        fixed.append(times[FIXED])
        ratios.append(times[CELL] / times[FIXED])
    return plain, fixed, ratios


for source in (CELL, FIXED):  # warm both up
    timed(source)
before = ab(rounds)
from torchtune_magic import perfcheck
report = perfcheck(CELL, globals(), checks="ddp-no-sync", budget=budget)
after = ab(rounds)
if rank == 0:
    plain = before[0] + after[0]
    fixed = before[1] + after[1]
    ratios = before[2] + after[2]
    variant = report.variant_for(["ddp-no-sync"])
    json.dump({
        "ab_plain_s": statistics.median(plain),
        "ab_fixed_s": statistics.median(fixed),
        "ab_speedup": statistics.median(ratios),
        "ab_rounds": len(ratios),
        "perfcheck_speedup": variant.speedup if variant else None,
        "perfcheck_low": variant.speedup_low if variant else None,
        "perfcheck_high": variant.speedup_high if variant else None,
        "perfcheck_rounds": variant.rounds if variant else None,
        "perfcheck_baseline_s": report.baseline.median_s,
        # sampled: the baseline is per step, of this many a run
        "perfcheck_steps_per_run": report.sampling.steps_per_run if report.sampling else None,
        "findings": [f.id for f in report.findings],
        "ranks": [
            {"rank": r.rank, "baseline_s": r.baseline_s}
            for r in (report.distributed.ranks if report.distributed else [])
        ],
    }, open(out, "w"), indent=2)
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run(nproc: int, rounds: int, budget: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        script, out = Path(folder) / "job.py", Path(folder) / "result.json"
        script.write_text(JOB)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        }
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(_free_port()),
            str(script),
            str(rounds),
            str(budget),
            str(out),
        ]
        subprocess.run(command, check=True, env=env, timeout=900)
        return json.loads(out.read_text())


def table(result: dict) -> str:
    agreement = result["perfcheck_speedup"] / result["ab_speedup"] - 1
    per_run = result["perfcheck_baseline_s"] * (result["perfcheck_steps_per_run"] or 1)
    overhead = per_run / result["ab_plain_s"] - 1
    interval = f"{result['perfcheck_low']:.2f}x-{result['perfcheck_high']:.2f}x"
    return "\n".join(
        [
            "| measure | value |",
            "|---|---|",
            f"| A/B: cell as written, median run | {result['ab_plain_s'] * 1e3:.1f} ms |",
            f"| A/B: `no_sync()` by hand, median run | {result['ab_fixed_s'] * 1e3:.1f} ms |",
            f"| A/B speedup (median of {result['ab_rounds']} paired rounds) | "
            f"{result['ab_speedup']:.2f}x |",
            f"| perfcheck's ddp-no-sync speedup | {result['perfcheck_speedup']:.2f}x "
            f"({interval}, {result['perfcheck_rounds']} rounds) |",
            f"| perfcheck vs A/B (target within 10 %) | {agreement:+.1%} |",
            f"| perfcheck's baseline, a run | {per_run * 1e3:.1f} ms |",
            f"| per-run overhead vs the plain cell (target < 2 %) | {overhead:+.1%} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "distributed.json")
    args = parser.parse_args()
    result = run(args.nproc, args.rounds, args.budget)
    result["table"] = table(result)
    print(result["table"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
