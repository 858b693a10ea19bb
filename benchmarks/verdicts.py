"""How fast and how safely perfcheck's paired rounds reach a verdict (`measuring/verdict.py`).

    python benchmarks/verdicts.py [--json PATH] [--busy] [--checks N] [--aa-rounds N]
                                  [--aa-repeats N] [--recordings DIR]

Two parts, both on this machine as it is (`--busy` starts one CPU-bound process beside the
measuring, and ends it after):

1. **False verdicts on A/A controls**, measured the way the 99.8 % interval was chosen
   (and for that procedure too, on the same rounds):
   three cells are timed in rounds of the real round shape (baseline, the "fix", the
   baseline again), where the "fix" is the baseline itself, for `--aa-rounds` rounds (half
   that for the slowest), with the load meter read over each round as `paired_rounds`
   reads it. Then the sequential procedure `timing.paired_rounds` follows is replayed from
   every starting round: the speedup re-read after each round, stopped at the first look
   that settles it or after 40 rounds. A "faster" or "slower" there is a false verdict.
   `--recordings DIR` keeps the recordings and replays from them, so a change to the
   procedure is judged on the very rounds the last one was.
2. **Rounds and seconds to a verdict** for cells with known effects, checked through
   `perfcheck` at the default budget, `--checks` times each: a slow loader (workers, about
   3x), a loader waiting about a quarter of the run (workers, about 1.3x), bf16 autocast on
   a small CNN (about 2x on a CPU with native bf16), and anomaly mode on a small MLP.
   Reported: each check's verdict, its rounds, and the seconds from the first measuring
   report to the last.

Writes JSON (default benchmarks/results/verdicts[-busy].json) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import random
import statistics
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from busy_process import other_busy_process

from torchtune_magic import perfcheck
from torchtune_magic.measuring import timing, verdict
from torchtune_magic.measuring.verdict import FASTER, SLOWER, Speedup
from torchtune_magic.probe import load
from torchtune_magic.report import Report

MAX_LOOKS = 40
PREVIOUS_CONFIDENCE = 0.998  # the interval alone, before the separation test

AA_CELLS = {
    "mlp step (raw tensors)": (
        """
import torch
torch.manual_seed(0)
w1, w2 = torch.randn(64, 256, requires_grad=True), torch.randn(256, 1, requires_grad=True)
x, y = torch.randn(128, 64), torch.randn(128, 1)
""",
        """
for _ in range(5):  # the same work every run: no state carried from one to the next
    loss = ((x @ w1).relu() @ w2 - y).pow(2).mean()
    loss.backward()
    w1.grad = None
    w2.grad = None
""",
    ),
    "conv forward": (
        """
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
batch = torch.randn(8, 3, 32, 32)
""",
        """
with torch.no_grad():
    for _ in range(3):
        out = net(batch)
""",
    ),
    # runs of tens of milliseconds: three rounds span the load meter's window, so the
    # separation test is in play on a quiet machine (the two above are too fast for it)
    "cnn training step": (
        """
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
""",
        """
nn.functional.cross_entropy(net(x), y).backward()
net.zero_grad(set_to_none=True)
""",
    ),
}
# the slow control's rounds: half of `--aa-rounds` (its recordings take the longest)
SLOW_CONTROLS = {"cnn training step"}

EFFECT_SETUP = {
    "slow loader (workers)": """
import torch
from torch import nn
from torch.utils.data import DataLoader
from slow_data import SlowDataset
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(SlowDataset(n=160, delay_s=0.004), batch_size=8)
""",
    "mild loader wait (workers)": """
import torch
from torch.utils.data import DataLoader
from slow_data import SlowDataset
torch.manual_seed(0)
w = torch.randn(384, 384) / 20
loader = DataLoader(SlowDataset(n=96, delay_s=0.001), batch_size=8)
""",
    "bf16 autocast (CNN)": """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                      nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
batch = torch.randn(32, 3, 48, 48)
""",
    "anomaly mode (MLP)": """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(32, 64), torch.randn(32, 64)
torch.autograd.set_detect_anomaly(True)
""",
}
EFFECT_CELLS = {
    "slow loader (workers)": ("dataloader-workers", """
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
"""),
    "mild loader wait (workers)": ("dataloader-workers", """
for epoch in range(2):
    for x, y in loader:
        h = w
        for _ in range(10):
            h = torch.tanh(h @ w)
"""),
    "bf16 autocast (CNN)": ("amp", """
with torch.no_grad():
    for _ in range(8):
        scores = model(batch)
"""),
    "anomaly mode (MLP)": ("debug-anomaly", """
for step in range(60):
    opt.zero_grad()
    nn.functional.mse_loss(model(X), Y).backward()
    opt.step()
"""),
}


@contextlib.contextmanager
def spinner(busy: bool) -> Iterator[None]:
    """One CPU-bound process beside the measuring, not among our descendants (so the load
    meter counts it as another's, as it would a user's other work), ended afterwards."""
    if not busy:
        yield
        return
    with other_busy_process():
        yield


def _cell(setup: str, cell: str) -> Callable[[], float]:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(setup), namespace)
    code = compile(textwrap.dedent(cell), "<cell>", "exec")

    def run() -> float:
        started = time.perf_counter()
        exec(code, namespace)
        return time.perf_counter() - started

    return run


Recorded = list[tuple[float, float, float, float, float]]


def record_aa(setup: str, cell: str, rounds: int) -> Recorded:
    """`rounds` rounds of (baseline, the same cell as the fix, baseline again), each run in
    a place drawn at random in its round, as `timing.paired_rounds` runs them, with the
    round's wall seconds and the CPU-seconds other processes ran meanwhile
    (`timing.Rounds.loads`)."""
    run = _cell(setup, cell)
    for _ in range(5):
        run()
    recorded = []
    seed = random.SystemRandom().getrandbits(32)  # drawn anew, as each measurement's is
    for index in range(rounds):
        roles = ["base", "fix", "again"]
        random.Random(seed + index).shuffle(roles)
        began = load.reading()
        times = {role: run() for role in roles}
        seen = load.since(began, clamped=False)  # summed over rounds, as `timing` does
        window, other = (seen.window_s, seen.other_cpu_s) if seen is not None else (0.0, 0.0)
        recorded.append((times["base"], times["fix"], times["again"], window, other))
    return recorded


def replay(recorded: Recorded, start: int, before: bool = False) -> tuple[str, str | None]:
    """The verdict the sequential procedure reaches from round `start` on, and which test
    gave it (`Speedup.by`); `before`: the procedure this one replaced (the 99.8 %
    order-statistic interval alone, no A/A ratio), on the same rounds."""
    rounds = timing.Rounds("base")
    for index, (base, fix, again, *seen) in enumerate(recorded[start : start + MAX_LOOKS]):
        rounds.rounds.append({"base": base, "fix": fix})
        rounds.again[index] = again
        rounds.loads[index] = (seen[0], seen[1])
        if before:
            speedup = Speedup.of(rounds.ratios("fix"), None, PREVIOUS_CONFIDENCE)
        else:
            speedup = rounds.speedup("fix")
        if speedup is not None and speedup.settled:
            return speedup.verdict, speedup.by
    return "undecided", None


def recorded_aa(
    name: str, busy: bool, aa_rounds: int, kept: Path | None, repeat: int
) -> Recorded:
    """One recording of a control: read from `kept` when it holds this one (so a change to
    the procedure is replayed on the very rounds the last one was measured on), else
    recorded now and written there."""
    path = None
    if kept is not None:
        load = "busy" if busy else "quiet"
        slug = name.split(" (")[0].replace(" ", "-")
        path = kept / f"{load}-{slug}-{aa_rounds}-{repeat}.json"
        if path.exists():
            return [(b, f, a, w, o) for b, f, a, w, o in json.loads(path.read_text())]
    setup, cell = AA_CELLS[name]
    with spinner(busy):
        recorded = record_aa(setup, cell, aa_rounds)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(recorded))
    return recorded


def false_verdicts(
    busy: bool, aa_rounds: int, kept: Path | None = None, repeat: int = 0
) -> list[dict[str, Any]]:
    rows = []
    for name in AA_CELLS:
        rounds = aa_rounds // 2 if name in SLOW_CONTROLS else aa_rounds
        recorded = recorded_aa(name, busy, rounds, kept, repeat)
        starts = range(0, max(1, len(recorded) - MAX_LOOKS))
        replayed = [replay(recorded, s) for s in starts]
        outcomes = [outcome for outcome, _ in replayed]
        false_by = Counter(by for outcome, by in replayed if outcome in (FASTER, SLOWER))
        wrong = sum(false_by.values())
        before = [replay(recorded, s, before=True)[0] for s in starts]
        wrong_before = sum(o in (FASTER, SLOWER) for o in before)
        ratios = [row[0] / row[1] for row in recorded]
        rows.append(
            {
                "control": name,
                "rounds_recorded": len(recorded),
                "starting_points": len(outcomes),
                "false_verdicts": wrong,
                "false_share": wrong / len(outcomes),
                "false_by": dict(false_by),  # which test called them
                "false_verdicts_before": wrong_before,
                "no_clear_change": outcomes.count(verdict.NO_CLEAR_CHANGE),
                "undecided": outcomes.count("undecided"),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "run_median_s": statistics.median(row[0] for row in recorded),
                "others_cpus": sum(row[4] for row in recorded) / sum(row[3] for row in recorded),
            }
        )
    return rows


def effects(busy: bool, checks: int) -> list[dict[str, Any]]:
    rows = []
    for name, (check_id, cell) in EFFECT_CELLS.items():
        for repeat in range(checks):
            namespace: dict[str, Any] = {"__name__": "__main__"}
            exec(textwrap.dedent(EFFECT_SETUP[name]), namespace)
            seen: list[tuple[float, Report]] = []
            started = time.perf_counter()
            with spinner(busy), contextlib.redirect_stdout(io.StringIO()):
                report = perfcheck(
                    textwrap.dedent(cell),
                    namespace,
                    checks=check_id,
                    on_report=functools.partial(_keep, seen),
                )
            wall = time.perf_counter() - started
            measuring = [t for t, r in seen if r.phase == "measuring"]
            done = [t for t, r in seen if r.phase != "measuring"]
            variant = report.variant_for([check_id])
            import torch

            torch.autograd.set_detect_anomaly(False)
            rows.append(
                {
                    "cell": name,
                    "check": check_id,
                    "repeat": repeat,
                    "found": report.finding(check_id) is not None,
                    "verdict": variant.verdict if variant else None,
                    "speedup": variant.speedup if variant else None,
                    "low": variant.speedup_low if variant else None,
                    "high": variant.speedup_high if variant else None,
                    "rounds": variant.rounds if variant else None,
                    "measuring_s": (done[0] - measuring[0]) if measuring and done else None,
                    "wall_s": wall,
                    "budget_to_tell_s": variant.budget_to_tell_s if variant else None,
                }
            )
    return rows


def _keep(seen: list[tuple[float, Report]], report: Report) -> None:
    seen.append((time.perf_counter(), report))


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.2f}" if math.isfinite(value) else str(value)
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--busy", action="store_true")
    parser.add_argument("--checks", type=int, default=2)
    parser.add_argument("--aa-rounds", type=int, default=300)
    parser.add_argument("--aa-repeats", type=int, default=3, help="recordings per control")
    parser.add_argument(
        "--recordings", type=Path, help="a folder to keep the A/A recordings in and replay from"
    )
    args = parser.parse_args()
    load = "busy" if args.busy else "quiet"
    result = {
        "load": load,
        "false_verdicts": [
            row
            for repeat in range(args.aa_repeats)
            for row in false_verdicts(args.busy, args.aa_rounds, args.recordings, repeat)
        ],
        "effects": effects(args.busy, args.checks),
    }
    out = args.json or Path(__file__).parent / "results" / f"verdicts-{load}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"## A/A controls ({load})\n")
    print(
        "| control | rounds | starting points | false verdicts | before (99.8 % interval "
        "alone) | no clear change | undecided | ratio range |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in result["false_verdicts"]:
        print(
            f"| {row['control']} | {row['rounds_recorded']} | {row['starting_points']} | "
            f"{row['false_verdicts']} ({row['false_share']:.1%}"
            f"{''.join(f'; {by} {n}' for by, n in row['false_by'].items())}) | "
            f"{row['false_verdicts_before']} | {row['no_clear_change']} | "
            f"{row['undecided']} | {row['ratio_min']:.2f}–{row['ratio_max']:.2f} |"
        )
    print(f"\n## Known effects at the default budget ({load})\n")
    print("| cell | check | verdict | speedup (interval) | rounds | measuring s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for row in result["effects"]:
        interval = f"{_fmt(row['speedup'])} ({_fmt(row['low'])}–{_fmt(row['high'])})"
        print(
            f"| {row['cell']} | {row['check']} | {_fmt(row['verdict'])} | {interval} | "
            f"{_fmt(row['rounds'])} | {_fmt(row['measuring_s'])} | {_fmt(row['wall_s'])} |"
        )
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
