"""How much does perfcheck itself cost, and do its speedups agree with a plain A/B timing?

    python benchmarks/engine_overhead.py [--json PATH] [--rounds N]

Prints a table and writes JSON (default benchmarks/results/engine_overhead.json):
Everything runs in a real IPython shell with the extension loaded, as in a notebook.
- overhead per timed run: perfcheck's baseline median vs plain runs of the same cell (target
  < 2%);
- probe cost: the whole probe vs one plain run, interleaved (target <= 3x);
- agreement: perfcheck's reported speedup of the anomaly-mode fix on an MLP training loop vs
  an independent interleaved A/B timing of the hand-fixed cell (target within 10%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from torchtune_magic.engine.workload import Workload
from torchtune_magic.options import Options
from torchtune_magic.session import Session

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
inputs = torch.randn(128, 256)
targets = torch.randint(0, 10, (128,))
"""

LOOP = """\
for step in range(25):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    opt.step()
"""
WITH_ANOMALY = (
    "torch.autograd.set_detect_anomaly(True)\n"
    + LOOP
    + ("torch.autograd.set_detect_anomaly(False)\n")
)


TIMED = "_t0 = time.perf_counter()\n{cell}_elapsed = time.perf_counter() - _t0\n"
RESTORE = (
    "model.load_state_dict(_saved_model)\nopt.load_state_dict(_saved_opt)\n"
    "torch.set_rng_state(_saved_rng)\n"
)
SAVE = (
    "import copy, time\n_saved_model = copy.deepcopy(model.state_dict())\n"
    "_saved_opt = copy.deepcopy(opt.state_dict())\n_saved_rng = torch.get_rng_state()\n"
)


class Shell:
    """A real IPython shell with the extension loaded: the conditions a notebook user has
    (Python stack depth matters: anomaly mode records a traceback per autograd op).

    Plain runs restore the starting state in place with load_state_dict (independent of
    perfcheck's own state guard), so both paths run on the same, warm tensors.
    """

    def __init__(self) -> None:
        from IPython.testing.globalipapp import start_ipython

        self.ip = start_ipython()
        self.ip.run_line_magic("load_ext", "torchtune_magic")
        self.ip.run_cell(SETUP + SAVE, silent=True).raise_error()

    def plain(self, cell: str) -> float:
        """One plain run of `cell` from the starting state, timed inside the cell."""
        self.ip.run_cell(RESTORE, silent=True).raise_error()
        self.ip.run_cell(TIMED.format(cell=cell), silent=True).raise_error()
        return self.ip.user_ns["_elapsed"]

    def perfcheck(self, cell: str, options: str) -> Any:
        self.ip.run_cell(RESTORE, silent=True).raise_error()
        result = self.ip.run_cell(f"%%perfcheck -o -q {options}\n{cell}")
        result.raise_error()
        return result.result

    def session(self, cell: str) -> Session:
        self.ip.run_cell(RESTORE, silent=True).raise_error()
        return Session(Workload(cell, self.ip.user_ns), Options(budget=1))


def overhead(shell: Shell, rounds: int) -> dict[str, float]:
    """perfcheck's timed-run path vs a plain run of the same cell, interleaved A B A B."""
    session = shell.session(LOOP)
    session.probe()
    session.detect()
    baseline = session._configs([])[0]  # the configuration the baseline is timed with
    ours, plain = [], []
    for _ in range(rounds):
        ours.append(session._one_run(baseline))
        plain.append(shell.plain(LOOP))
    a, b = statistics.median(ours), statistics.median(plain)
    return {"perfcheck_median_s": a, "plain_median_s": b, "overhead": a / b - 1}


def probe_cost(shell: Shell, rounds: int) -> dict[str, float]:
    """The whole probe (discovery, snapshot, instrumented run, profiler) vs one plain run."""
    probes, plain = [], []
    for _ in range(rounds):
        session = shell.session(LOOP)
        start = time.perf_counter()
        session.probe()
        probes.append(time.perf_counter() - start)
        plain.append(shell.plain(LOOP))
    ratio = statistics.median(probes) / statistics.median(plain)
    return {
        "plain_run_s": statistics.median(plain),
        "probe_s": statistics.median(probes),
        "probe_ratio": ratio,
    }


def agreement(shell: Shell, rounds: int, budget: float) -> dict[str, float]:
    """The anomaly fix as perfcheck reports it vs hand-fixed code timed A/B interleaved."""
    report = shell.perfcheck(WITH_ANOMALY, f"--budget {budget} --checks debug-anomaly")
    reported = report.variant_for(["debug-anomaly"]).speedup
    slow, fast = [], []
    for _ in range(rounds):
        slow.append(shell.plain(WITH_ANOMALY))
        fast.append(shell.plain(LOOP))
    independent = statistics.median(slow) / statistics.median(fast)
    return {
        "reported_speedup": reported,
        "independent_speedup": independent,
        "relative_difference": abs(reported - independent) / independent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="benchmarks/results/engine_overhead.json")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=15.0)
    args = parser.parse_args()

    shell = Shell()
    results = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "probe": probe_cost(shell, args.rounds),
        "overhead": overhead(shell, args.rounds),
        "agreement": agreement(shell, args.rounds, args.budget),
    }
    o, p, a = results["overhead"], results["probe"], results["agreement"]
    rows = [
        ("overhead per timed run", f"{o['overhead']:+.1%}", "< 2%", abs(o["overhead"]) < 0.02),
        ("probe cost", f"{p['probe_ratio']:.2f}x a plain run", "<= 3x", p["probe_ratio"] <= 3),
        ("anomaly fix, perfcheck", f"{a['reported_speedup']:.2f}x", "", True),
        ("anomaly fix, independent A/B", f"{a['independent_speedup']:.2f}x", "", True),
        (
            "agreement",
            f"{a['relative_difference']:.1%} apart",
            "within 10%",
            a["relative_difference"] <= 0.10,
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':{width}}  {'value':>24}  {'target':>20}  ok")
    for name, value, target, ok in rows:
        print(f"{name:{width}}  {value:>24}  {target:>20}  {'yes' if ok else 'NO'}")
    results["targets_met"] = all(r[3] for r in rows)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
