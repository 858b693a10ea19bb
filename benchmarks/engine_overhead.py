"""How much does perfcheck itself cost, and do its speedups agree with a plain A/B timing?

    python benchmarks/engine_overhead.py [--json PATH] [--rounds N]

Prints a table and writes JSON (default benchmarks/results/engine_overhead.json):
Everything runs in a real IPython shell with the extension loaded, as in a notebook.
- overhead per timed run: perfcheck's baseline median vs plain runs of the same cell (target
  < 2%);
- probe cost: the whole probe vs one plain run, interleaved (target <= 3x);
- agreement: for every fix the zoo measures (benchmarks/zoo.py), perfcheck's reported
  speedup vs an A/B of the hand-fixed cell run the way a notebook runs it: the cell and its
  hand-fixed version (its earlier cells fixed too) run through the same IPython shell,
  each warmed up once (compile, worker start), then timed in turns (target within 5%);
  and perfcheck's baseline median vs the plain cell's median in that A/B.

Which side was off before (10% apart on the anomaly fix, issue 12): the A/B ran after
perfcheck in the same process, and perfcheck's snapshots had been freed through malloc,
which raised glibc's mmap threshold, so the plain runs were served differently from the
runs perfcheck timed. Its copies now live outside malloc (engine/allocator.outside_copy),
and the A/B here runs with the user namespace as a notebook has it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import textwrap
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
        ours.append(session._one_run(baseline).total_s)
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


def _namespace(setup: str) -> dict[str, Any]:
    """An earlier cell's names, as a notebook would have them after running it."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(setup), namespace)
    return namespace


def _timed_in(shell: Shell, names: dict[str, Any], cell: str) -> float:
    """One run of `cell` through the shell, with `names` bound in its user namespace."""
    shell.ip.user_ns.update(names)
    shell.ip.run_cell(TIMED.format(cell=cell), silent=True).raise_error()
    return shell.ip.user_ns["_elapsed"]


def agreement(shell: Shell, rounds: int, budget: float, only: str = "") -> list[dict[str, Any]]:
    """Every zoo fix: perfcheck's speedup vs an A/B of the hand-fixed cell."""
    from zoo import ZOO

    rows = []
    for entry in ZOO:
        if only and only not in entry.name:
            continue
        for check_id, (setup_fixed, cell_fixed) in entry.hand_fixed.items():
            plain = _namespace(entry.setup)
            shell.ip.user_ns.update(plain)
            flags = "--memory" if entry.options.get("memory") else ""
            result = shell.ip.run_cell(
                f"%%perfcheck -o -q --budget {budget} --checks {check_id} {flags}\n{entry.cell}"
            )
            result.raise_error()
            report = result.result
            variant = report.variant_for([check_id])
            finding = report.finding(check_id)
            chosen = re.search(r"(\d+) chosen", finding.evidence) if finding else None
            fixed = _namespace(setup_fixed.replace("{workers}", chosen.group(1) if chosen else "2"))
            _timed_in(shell, plain, entry.cell)  # warm-ups: compile, worker start, caches
            _timed_in(shell, fixed, cell_fixed)
            slow, fast = [], []
            for _ in range(rounds):
                slow.append(_timed_in(shell, plain, entry.cell))
                fast.append(_timed_in(shell, fixed, cell_fixed))
            independent = statistics.median(slow) / statistics.median(fast)
            reported = variant.speedup if variant else None
            rows.append(
                {
                    "cell": entry.name,
                    "fix": check_id,
                    "reported_speedup": reported,
                    "independent_speedup": independent,
                    "relative_difference": (
                        abs(reported - independent) / independent if reported else None
                    ),
                    "perfcheck_baseline_s": report.baseline.median_s,
                    "plain_median_s": statistics.median(slow),
                    "baseline_vs_plain": report.baseline.median_s / statistics.median(slow) - 1,
                    "warnings": report.warnings,
                }
            )
            print(
                f"  {entry.name} / {check_id}: perfcheck {reported or 0:.2f}x, "
                f"A/B {independent:.2f}x",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default="benchmarks/results/engine_overhead.json")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=15.0)
    parser.add_argument("--only", default="", help="zoo cells whose name contains this")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # zoo and its data module

    shell = Shell()
    results = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "probe": probe_cost(shell, args.rounds),
        "overhead": overhead(shell, args.rounds),
        "agreement": agreement(shell, args.rounds, args.budget, args.only),
    }
    o, p = results["overhead"], results["probe"]
    rows = [
        ("overhead per timed run", f"{o['overhead']:+.1%}", "< 2%", abs(o["overhead"]) < 0.02),
        ("probe cost", f"{p['probe_ratio']:.2f}x a plain run", "<= 3x", p["probe_ratio"] <= 3),
    ]
    for a in results["agreement"]:
        apart = a["relative_difference"]
        rows.append(
            (
                f"{a['fix']} ({a['cell'][:30]})",
                f"{a['reported_speedup'] or 0:.2f}x vs {a['independent_speedup']:.2f}x A/B",
                "within 5%",
                apart is not None and apart <= 0.05,
            )
        )
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
