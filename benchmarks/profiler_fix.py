"""Does perfcheck's live fix for a profiler left running gain what stopping it by hand does?

    python benchmarks/profiler_fix.py [--json PATH] [--rounds N] [--runs N] [--budget S]
                                      [--repeats N] [--threads N]

A notebook often starts a profiler in one cell (`prof = torch.profiler.profile(...);
prof.start()`) and trains in the next, so every op of the training pays for the recording.
`debug-profiler` finds it and its live fix pauses that profiler for as long as the fix is
applied. The same training cell (an 8-layer MLP on a 4-row batch, 20 SGD steps: many tiny
ops, where the profiler's per-op cost dominates) is timed three ways, interleaved in one
process, one profiler lifetime per round:

  (a) the profiler left running, as the notebook has it;
  (b) the same, with perfcheck's fix applied live (`Session.apply("debug-profiler")`), then
      undone before the next (a);
  (c) hand-fixed: the profiler stopped before training (no profiler at all).

Each round starts the profiler as the earlier cell did, alternates (a) and (b) `--runs`
times, stops the profiler and times (c) as often. Per round, the fix's gain is (a)/(b) and the
hand fix's (a)/(c); the table shows their medians over `--rounds` rounds, and fix / hand
(target >= 0.9). perfcheck's own reported speedup comes from `perfcheck(cell, ns,
checks="debug-profiler")` with the profiler running (`--repeats` runs, median). On a shared
machine run it with `--threads 1` (the committed result is a one-thread run on 2 busy cores).

Writes JSON (default benchmarks/results/profiler_fix.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtune_magic import perfcheck
from torchtune_magic.cell.workload import Workload
from torchtune_magic.options import Options
from torchtune_magic.probe import cpu
from torchtune_magic.probe.memory import _native_stderr_silenced
from torchtune_magic.session import Session

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(8)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(4, 16)
"""
CELL = """\
for step in range(20):
    opt.zero_grad()
    model(X).square().mean().backward()
    opt.step()
"""
KINETO_STOP = "prof.stop()"
LEGACY_STOP = "prof.__exit__(None, None, None)"


@dataclass
class Profiler:
    name: str
    start: str  # the earlier cell that leaves it running
    stop: str  # the hand fix: what stops it before training


PROFILERS = [
    Profiler(
        "torch.profiler.profile()", "prof = torch.profiler.profile()\nprof.start()", KINETO_STOP
    ),
    Profiler(
        "torch.profiler.profile(record_shapes, with_stack)",
        "prof = torch.profiler.profile(record_shapes=True, with_stack=True)\nprof.start()",
        KINETO_STOP,
    ),
    Profiler(
        "torch.autograd.profiler.profile(with_stack).__enter__()",
        "prof = torch.autograd.profiler.profile(with_stack=True)\nprof.__enter__()",
        LEGACY_STOP,
    ),
    Profiler(
        "torch.profiler.profile(profile_memory)",
        "prof = torch.profiler.profile(profile_memory=True)\nprof.start()",
        KINETO_STOP,
    ),
]


def namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(SETUP), ns)
    return ns


def timed(code: Any, ns: dict[str, Any]) -> float:
    start = time.perf_counter()
    exec(code, ns)
    return time.perf_counter() - start


def interleaved(profiler: Profiler, rounds: int, runs: int) -> dict[str, Any]:
    """Per round: the profiler started as the earlier cell did, (a) and (b) alternating, then
    the profiler stopped and (c). Each round's gains come from its own medians."""
    ns = namespace()
    cell = compile(CELL, "<cell>", "exec")
    exec(cell, ns)  # warm-up, no profiler
    per_round: list[dict[str, float]] = []
    for _ in range(rounds):
        with _native_stderr_silenced():
            exec(profiler.start, ns)
        session = Session(Workload(CELL, ns), Options.build(checks="debug-profiler"))
        session.probe()
        session.detect()
        times: dict[str, list[float]] = {"left_running": [], "fix": [], "hand": []}
        for run in range(runs + 1):
            for label in ("left_running", "fix") if run % 2 else ("fix", "left_running"):
                if label == "fix":
                    session.apply("debug-profiler")
                took = timed(cell, ns)
                if label == "fix":
                    session.undo("debug-profiler")
                if run:  # run 0 warms both up
                    times[label].append(took)
        with _native_stderr_silenced():
            exec(profiler.stop, ns)
        times["hand"] = [timed(cell, ns) for _ in range(runs)]
        medians = {label: statistics.median(values) for label, values in times.items()}
        per_round.append(
            {
                **{f"{label}_median_s": value for label, value in medians.items()},
                "fix_gain": medians["left_running"] / medians["fix"],
                "hand_gain": medians["left_running"] / medians["hand"],
            }
        )
    fix = statistics.median(r["fix_gain"] for r in per_round)
    hand = statistics.median(r["hand_gain"] for r in per_round)
    return {"fix_gain": fix, "hand_gain": hand, "fix_over_hand": fix / hand, "rounds": per_round}


def through_perfcheck(profiler: Profiler, budget: float) -> dict[str, Any]:
    ns = namespace()
    with _native_stderr_silenced():
        exec(profiler.start, ns)
    try:
        report = perfcheck(CELL, ns, checks="debug-profiler", budget=budget)
    finally:
        with _native_stderr_silenced():
            exec(profiler.stop, ns)
    variant = report.variant_for(["debug-profiler"])
    if variant is None:
        return {"speedup": None, "why": "debug-profiler did not offer a fix"}
    return {
        "speedup": variant.speedup,
        "baseline_median_s": report.baseline.median_s,
        "fix_median_s": variant.median_s,
        "numerics": variant.numerics.verdict,
        "caveat": report.finding("debug-profiler").caveat,  # type: ignore[union-attr]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="benchmarks/results/profiler_fix.json")
    parser.add_argument("--rounds", type=int, default=7, help="profiler lifetimes per profiler")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each way per round")
    parser.add_argument("--repeats", type=int, default=3, help="perfcheck runs per profiler")
    parser.add_argument("--budget", type=float, default=4.0)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    results: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cores": cpu.available_cores().detail,
        "cell": CELL,
        "profilers": [],
    }
    for profiler in PROFILERS:
        row: dict[str, Any] = {"profiler": profiler.name, "start": profiler.start}
        row.update(interleaved(profiler, args.rounds, args.runs))
        runs = [through_perfcheck(profiler, args.budget) for _ in range(args.repeats)]
        found = [r["speedup"] for r in runs if r["speedup"]]
        row["perfcheck_runs"] = runs
        row["perfcheck"] = statistics.median(found) if found else None
        results["profilers"].append(row)

    print(f"{results['cores']}; {results['threads']} torch threads; torch {torch.__version__}")
    print("| profiler left running | fix gain (live) | hand gain | fix / hand | perfcheck says |")
    print("|---|---|---|---|---|")
    for row in results["profilers"]:
        said = f"{row['perfcheck']:.2f}x" if row["perfcheck"] else "-"
        print(
            f"| `{row['profiler']}` | {row['fix_gain']:.2f}x | {row['hand_gain']:.2f}x | "
            f"{row['fix_over_hand']:.2f} | {said} |"
        )
    results["targets_met"] = all(row["fix_over_hand"] >= 0.9 for row in results["profilers"])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
