"""Long training cells under %%perfcheck: how soon the findings show, when every number is
in, whether the sampled per-step speedup agrees with a full-run A/B, and whether
`--apply wins` finishes the cell sooner than running it plain.

    python benchmarks/long_cell.py [--json PATH] [--scale S] [--rounds N]

Two cells, sized on this machine (a one-epoch calibration run) to take about 60 s and 180 s
plain (`--scale 0.1` makes both ten times shorter, for a quick check):
- cnn: a small CNN trained for epochs over a DataLoader whose items wait 2 ms each, as
  reads from slow storage do (the fix: dataloader-workers);
- mlp: an MLP trained with anomaly detection left on (the fix: debug-anomaly).
Everything runs in one real IPython shell, as in a notebook, with the default budget:
`%%perfcheck --apply wins` on a fresh set-up, then the plain cell (A) and the hand-fixed
cell (B) interleaved, A B A B. Targets (issue 10): findings on screen <= 15 s; all numbers
in <= budget + 15 s; sampled per-step speedup within 10% of the full-run A/B; the whole
`%%perfcheck --apply wins` (probe, measuring, the complete run with the wins) under 1.0x
the plain cell. Prints a table and writes JSON (default benchmarks/results/long_cell.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BUDGET_S = 20.0  # the default --budget

CNN_SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from zoo_data import SlowImageDataset
torch.manual_seed(0)
train_set = SlowImageDataset(n=1024, size=32, delay_s=0.002)
loader = DataLoader(train_set, batch_size=32, shuffle=True{loader_extra})
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
epochs = {epochs}
"""
CNN_CELL = """\
for epoch in range(epochs):
    for images, labels in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
"""

MLP_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                      nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
data = torch.randn(4096, 256)
targets = torch.randint(0, 10, (4096,))
epochs = {epochs}
"""
MLP_CELL = """\
torch.autograd.set_detect_anomaly({anomaly})
for epoch in range(epochs):
    for start in range(0, len(data), 128):
        opt.zero_grad()
        batch, labels = data[start : start + 128], targets[start : start + 128]
        loss = nn.functional.cross_entropy(model(batch), labels)
        loss.backward()
        opt.step()
"""

TIMED = "_t0 = time.perf_counter()\n{cell}_elapsed = time.perf_counter() - _t0\n"


@dataclass
class Case:
    name: str
    fix: str
    target_s: float
    setup: str  # format with epochs= (and loader_extra= for the cnn)
    cell: str  # the plain cell
    fixed_cell: str  # the cell with the fix made by hand
    fixed_setup_extra: str = ""  # cnn: the hand-fixed loader's keywords, {workers} filled in


@dataclass
class Result:
    name: str
    fix: str
    epochs: int
    plain_s: list[float] = field(default_factory=list)
    fixed_s: list[float] = field(default_factory=list)
    findings_s: float | None = None
    numbers_s: float | None = None
    perfcheck_s: float | None = None
    per_step_speedup: float | None = None
    projected_speedup: float | None = None
    chosen: str = ""
    sampling: dict[str, Any] | None = None
    cell_run: dict[str, Any] | None = None

    @property
    def ab_speedup(self) -> float:
        return statistics.mean(self.plain_s) / statistics.mean(self.fixed_s)

    @property
    def agreement(self) -> float:
        """|per-step speedup / full-run A/B - 1|."""
        return abs((self.per_step_speedup or 0.0) / self.ab_speedup - 1)

    @property
    def wall_ratio(self) -> float:
        return (self.perfcheck_s or 0.0) / statistics.mean(self.plain_s)


CASES = [
    Case(
        "cnn",
        "dataloader-workers",
        60.0,
        CNN_SETUP,
        CNN_CELL,
        CNN_CELL,
        fixed_setup_extra=", num_workers={workers}, persistent_workers=True",
    ),
    Case(
        "mlp",
        "debug-anomaly",
        180.0,
        MLP_SETUP,
        MLP_CELL.format(anomaly="True"),
        MLP_CELL.format(anomaly="False"),
    ),
]


def _shell() -> Any:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "torchtune_magic")
    sys.path.insert(0, str(HERE))
    return shell


def _run(shell: Any, code: str) -> None:
    result = shell.run_cell(code, silent=True)
    if not result.success:
        raise RuntimeError(f"cell failed: {result.error_in_exec or result.error_before_exec}")


def _set_up(shell: Any, case: Case, epochs: int, extra: str = "") -> None:
    shell.run_line_magic("perfcheck", "revert")
    _run(shell, "import time\n" + case.setup.format(epochs=epochs, loader_extra=extra))


def _timed(shell: Any, cell: str) -> float:
    _run(shell, TIMED.format(cell=cell))
    return float(shell.user_ns["_elapsed"])


def _perfcheck(shell: Any, case: Case, result: Result) -> Any:
    """`%%perfcheck --apply wins` on the plain cell, timing when each report is published."""
    from torchtune_magic.session import Session

    seen: list[tuple[float, str]] = []
    publish = Session.publish

    def timed_publish(session: Session, report: Any) -> None:
        seen.append((time.perf_counter(), report.phase))
        publish(session, report)

    Session.publish = timed_publish  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        magic = f"get_ipython().run_cell_magic('perfcheck', '-o -q --apply wins', {case.cell!r})"
        _run(shell, f"_report = {magic}")
        result.perfcheck_s = time.perf_counter() - start
    finally:
        Session.publish = publish  # type: ignore[method-assign]
    report = shell.user_ns["_report"]
    result.findings_s = seen[0][0] - start
    result.numbers_s = next(at for at, phase in seen if phase in ("finishing", "done")) - start
    variant = report.variant_for([case.fix])
    result.per_step_speedup = variant.speedup if variant else None
    if variant and variant.projected_cell_s and report.baseline.projected_cell_s:
        result.projected_speedup = report.baseline.projected_cell_s / variant.projected_cell_s
    result.sampling = asdict(report.sampling) if report.sampling else None
    result.cell_run = asdict(report.cell_run) if report.cell_run else None
    finding = report.finding(case.fix)
    chosen = re.search(r"(\d+) chosen", finding.evidence) if finding else None
    result.chosen = chosen.group(1) if chosen else ""
    return report


def measure(case: Case, scale: float, rounds: int) -> Result:
    shell = _shell()
    _set_up(shell, case, 1)
    epoch_s = _timed(shell, case.cell)
    epochs = max(2, round(case.target_s * scale / epoch_s))
    result = Result(case.name, case.fix, epochs)
    print(f"{case.name}: one epoch {epoch_s:.2f} s -> {epochs} epochs", flush=True)

    _set_up(shell, case, epochs)
    _perfcheck(shell, case, result)
    print(f"{case.name}: %%perfcheck --apply wins {result.perfcheck_s:.1f} s", flush=True)
    fixed_extra = case.fixed_setup_extra.format(workers=result.chosen or 4)
    for _ in range(rounds):
        _set_up(shell, case, epochs)
        result.plain_s.append(_timed(shell, case.cell))
        _set_up(shell, case, epochs, fixed_extra)
        result.fixed_s.append(_timed(shell, case.fixed_cell))
        print(
            f"{case.name}: A {result.plain_s[-1]:.1f} s, B {result.fixed_s[-1]:.1f} s", flush=True
        )
    return result


def _table(results: list[Result]) -> str:
    rows = [
        "| cell | plain | findings (≤ 15 s) | numbers in (≤ 35 s) | sampled per-step | "
        "projected cell | full-run A/B | apart (≤ 10%) | `--apply wins` / plain (< 1.0) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.name} ({r.fix}) | {statistics.mean(r.plain_s):.1f} s | {r.findings_s:.1f} s | "
            f"{r.numbers_s:.1f} s | {r.per_step_speedup:.2f}x | "
            f"{(r.projected_speedup or 0):.2f}x | {r.ab_speedup:.2f}x | {r.agreement:.1%} | "
            f"{r.wall_ratio:.2f}x ({r.perfcheck_s:.1f} s) |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(HERE / "results" / "long_cell.json"))
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the cells' length")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds per cell")
    parser.add_argument("--cases", default="cnn,mlp", help="which cells (comma list)")
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.cwd() / ".bench-inductor"))
    wanted = set(args.cases.split(","))
    results = [measure(case, args.scale, args.rounds) for case in CASES if case.name in wanted]
    table = _table(results)
    print(table)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "budget_s": BUDGET_S,
                "cpu_count": os.cpu_count(),
                "load_average": os.getloadavg(),
                "results": [
                    {
                        **asdict(r),
                        "ab_speedup": r.ab_speedup,
                        "agreement": r.agreement,
                        "wall_ratio": r.wall_ratio,
                    }
                    for r in results
                ],
                "table": table,
            },
            indent=2,
        )
    )
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
