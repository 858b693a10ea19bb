"""Cells the way real notebooks write them, under %%perfcheck: the wait against its promise,
and the baseline against the cell's own time, on a quiet machine and on a busy one.

    python benchmarks/real_cells.py [--json PATH] [--scale S] [--repeats N] [--loads quiet,busy]

The cells train character-level language models as lecture notebooks do (issue 18): raw
tensors as parameters, hand-written layer classes (no `nn.Module`), manual SGD, minibatches
drawn with `torch.randint`, lists from an earlier cell appended to every step, and an early
`if i >= n: break`. Four sizes (1 s, 3 s, 15 s, 60 s plain; `--scale 0.1` for a quick
check), each run in one real IPython shell: the plain cell, `%%perfcheck` (default
budget) and the plain cell again in turns, `--repeats` times, with nothing else running
("quiet") and with one CPU-bound process beside it ("busy": `python -c "while True: pass"`).

Per row: the plain cell's time; the whole `%%perfcheck` wait and its parts (the probe and
checks until the findings showed, the measuring, the cell's complete run); the promise
(plain + budget + 10 s) and the wait beyond the cell's own complete run; and perfcheck's
baseline, projected to the whole cell, against the plain cell (target: within 5%) and
against the complete run the same check took right after its rounds (back to back, so the
machine's drift between separate runs does not enter it). Medians over the repeats.

This machine's speed wanders by 10-15% from one run of a few seconds to the next (two
shared cores), so the plain cell is timed in blocks of at least PLAIN_BLOCK_S between the
checks (plain, check, plain, check, ..., plain), and each check is held against the median
of the blocks on both sides of it. Prints a table and writes JSON (default
benchmarks/results/real_cells.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BUDGET_S = 20.0  # the default --budget
SLACK_S = 10.0  # the promise: plain + budget + this
PLAIN_BLOCK_S = 6.0  # the plain cell is run at least this long between two checks

DATA = """
import random
import torch
import torch.nn.functional as F
rng = random.Random(42)
syllables = ["ka", "ri", "mo", "na", "le", "to", "su", "vi", "an", "el", "jo", "ra", "be"]
words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(30000)]
chars = sorted(set("".join(words)))
stoi = {s: i + 1 for i, s in enumerate(chars)}
stoi["."] = 0
vocab_size = len(stoi)
block_size = 3
X, Y = [], []
for w in words:
    context = [0] * block_size
    for ch in w + ".":
        X.append(context)
        Y.append(stoi[ch])
        context = context[1:] + [stoi[ch]]
Xtr, Ytr = torch.tensor(X), torch.tensor(Y)
g = torch.Generator().manual_seed(2147483647)
"""

RAW_SETUP = """
C = torch.randn((vocab_size, 10), generator=g)
W1 = torch.randn((30, 200), generator=g) * 0.2
b1 = torch.randn(200, generator=g) * 0.01
W2 = torch.randn((200, vocab_size), generator=g) * 0.01
b2 = torch.randn(vocab_size, generator=g) * 0
parameters = [C, W1, b1, W2, b2]
for p in parameters:
    p.requires_grad = True
lossi = []
stepi = []
"""

RAW_CELL = """\
for i in range({steps}):
    ix = torch.randint(0, Xtr.shape[0], (32,), generator=g)
    emb = C[Xtr[ix]]
    h = torch.tanh(emb.view(-1, 30) @ W1 + b1)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Ytr[ix])
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < 100000 else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    stepi.append(i)
    lossi.append(loss.log10().item())
"""

LAYERS_SETUP = """
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

n_hidden = 100
C = torch.randn((vocab_size, 10), generator=g)
layers = [Linear(30, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh()]
for _ in range(3):
    layers += [Linear(n_hidden, n_hidden, bias=False), BatchNorm1d(n_hidden), Tanh()]
layers += [Linear(n_hidden, vocab_size, bias=False), BatchNorm1d(vocab_size)]
parameters = [C] + [p for layer in layers for p in layer.parameters()]
for p in parameters:
    p.requires_grad = True
lossi = []
"""

LAYERS_CELL = """\
max_steps = 200000
for i in range(max_steps):
    ix = torch.randint(0, Xtr.shape[0], (32,), generator=g)
    Xb, Yb = Xtr[ix], Ytr[ix]
    x = C[Xb].view(Xb.shape[0], -1)
    for layer in layers:
        x = layer(x)
    loss = F.cross_entropy(x, Yb)
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < 150000 else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    lossi.append(loss.log10().item())
    if i >= {last}:
        break
"""


@dataclass
class Case:
    name: str
    target_s: float
    setup: str
    cell: str  # formatted with steps= (raw) or last= (layers)


CASES = [
    Case("raw tensors", 1.0, RAW_SETUP, RAW_CELL),
    Case("hand-written layers, break", 3.0, LAYERS_SETUP, LAYERS_CELL),
    Case("raw tensors", 15.0, RAW_SETUP, RAW_CELL),
    Case("hand-written layers, break", 60.0, LAYERS_SETUP, LAYERS_CELL),
]


@dataclass
class Run:
    """One `%%perfcheck` of the cell, and the plain blocks on both sides of it."""

    plain_s: float  # median of the plain runs in the blocks before and after this check
    wait_s: float
    findings_s: float  # the probe and the checks, until the findings were out
    measuring_s: float  # from the findings to the last number
    complete_s: float  # the cell's complete run (0 when the probe ran it whole)
    baseline_cell_s: float | None  # perfcheck's baseline, projected to the whole cell
    unit: str | None
    steps: int

    @property
    def promise_s(self) -> float:
        return self.plain_s + BUDGET_S + SLACK_S

    @property
    def beyond_s(self) -> float:
        """The wait beyond the cell's own complete run (the probe stands for it when it
        ran the whole cell): perfcheck's overhead, free of the drift of a separate run."""
        return self.wait_s - (self.complete_s or self.findings_s)


@dataclass
class Row:
    case: str
    load: str
    steps: int
    runs: list[Run] = field(default_factory=list)

    def median(self, name: str) -> float:
        values = [getattr(run, name) for run in self.runs if getattr(run, name) is not None]
        return statistics.median(values) if values else float("nan")

    @property
    def promise_kept(self) -> bool:
        return all(run.wait_s <= run.promise_s for run in self.runs)

    @property
    def baseline_apart(self) -> float:
        """|perfcheck's baseline for the whole cell / the plain cell's time - 1|, by medians."""
        return abs(self.median("baseline_cell_s") / self.median("plain_s") - 1)

    @property
    def baseline_apart_paired(self) -> float | None:
        """The same against the complete run each check took right after its rounds
        (median of the per-check ratios); None when the probe ran the cell whole."""
        ratios = [
            run.baseline_cell_s / run.complete_s
            for run in self.runs
            if run.baseline_cell_s is not None and run.complete_s
        ]
        return abs(statistics.median(ratios) - 1) if ratios else None


@contextlib.contextmanager
def load(kind: str) -> Iterator[None]:
    """Nothing beside the benchmark ("quiet"), or one CPU-bound process ("busy")."""
    if kind == "quiet":
        yield
        return
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        yield
    finally:
        busy.kill()
        busy.wait()


def _shell() -> Any:
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "torchtune_magic")
    return shell


def _set_up(shell: Any, case: Case) -> None:
    import torch._dynamo

    # Code a check compiled keeps names in the namespace it ran in; dropping the code first
    # lets it take them away itself, before the reset below clears the namespace under it.
    torch._dynamo.reset()
    shell.reset(new_session=False)
    for source in (DATA, case.setup):
        result = shell.run_cell(source)
        result.raise_error()


def _cell(case: Case, steps: int) -> str:
    return case.cell.format(steps=steps, last=steps - 1)


def _plain(shell: Any, case: Case, steps: int) -> float:
    _set_up(shell, case)
    started = time.perf_counter()
    shell.run_cell(_cell(case, steps)).raise_error()
    return time.perf_counter() - started


def _calibrate(shell: Any, case: Case, scale: float) -> int:
    """Steps for the case's target time on this machine, from a 300-step run."""
    seconds = _plain(shell, case, 300)
    return max(50, round(case.target_s * scale / (seconds / 300)))


def _checked(shell: Any, case: Case, steps: int) -> Run:
    """`%%perfcheck` of the cell through the Python API on the shell's namespace, timing
    when the findings and the last number came out."""
    import torchtune_magic

    _set_up(shell, case)
    seen: dict[str, float] = {}
    started = time.perf_counter()

    def on_report(report: Any) -> None:
        now = time.perf_counter() - started
        seen.setdefault("findings", now)
        if report.phase in ("finishing", "done") and report.baseline.median_s is not None:
            seen.setdefault("numbers", now)

    report = torchtune_magic.perfcheck(_cell(case, steps), shell.user_ns, on_report=on_report)
    wait = time.perf_counter() - started
    run = report.cell_run
    complete = run.seconds if run is not None and run.status == "complete" and run.seconds else 0.0
    sampling = report.sampling
    whole = report.baseline.median_s
    if whole is not None and sampling is not None:  # sampled: seconds per step
        whole *= steps
    return Run(
        plain_s=0.0,
        wait_s=wait,
        findings_s=seen.get("findings", wait),
        measuring_s=seen.get("numbers", wait) - seen.get("findings", 0.0),
        complete_s=complete,
        baseline_cell_s=whole,
        unit=sampling.unit if sampling else None,
        steps=steps,
    )


def _plain_block(shell: Any, case: Case, steps: int) -> list[float]:
    """Plain runs of the cell, at least PLAIN_BLOCK_S of them."""
    runs = [_plain(shell, case, steps)]
    while sum(runs) < PLAIN_BLOCK_S:
        runs.append(_plain(shell, case, steps))
    return runs


def measure(shell: Any, case: Case, kind: str, steps: int, repeats: int) -> Row:
    """Plain blocks and checks in turns (plain, check, plain, ..., check, plain): each check
    is held against the plain runs on both sides of it."""
    row = Row(f"{case.name} ({case.target_s:g} s)", kind, steps)
    with load(kind):
        before = _plain_block(shell, case, steps)
        for _ in range(repeats):
            run = _checked(shell, case, steps)
            after = _plain_block(shell, case, steps)
            run.plain_s = statistics.median(before + after)
            before = after
            row.runs.append(run)
            print(
                f"  {row.case:34} {kind:5}: plain {run.plain_s:6.1f} s, %%perfcheck "
                f"{run.wait_s:6.1f} s (findings {run.findings_s:.1f}, numbers "
                f"+{run.measuring_s:.1f}, complete {run.complete_s:.1f}), baseline "
                f"{run.baseline_cell_s or 0:.2f} s",
                flush=True,
            )
    return row


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def table(rows: list[Row]) -> str:
    lines = [
        "| cell | load | checks | plain | %%perfcheck wait | findings | numbers | complete run "
        "| beyond the complete run | promise (plain + budget + 10 s) | kept | baseline "
        "(whole cell) | apart from plain | apart from its complete run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.case} | {row.load} | {len(row.runs)} | {row.median('plain_s'):.1f} s | "
            f"{row.median('wait_s'):.1f} s | {row.median('findings_s'):.1f} s | "
            f"+{row.median('measuring_s'):.1f} s | {row.median('complete_s'):.1f} s | "
            f"{row.median('beyond_s'):.1f} s | {row.median('promise_s'):.1f} s | "
            f"{'yes' if row.promise_kept else 'NO'} | {row.median('baseline_cell_s'):.2f} s | "
            f"{_percent(row.baseline_apart)} | {_percent(row.baseline_apart_paired)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=HERE / "results" / "real_cells.json")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--long-repeats",
        type=int,
        default=None,
        help="repeats of the 60 s cell (default: --repeats)",
    )
    parser.add_argument("--loads", default="quiet,busy")
    args = parser.parse_args()
    shell = _shell()
    rows = []
    for case in CASES:
        steps = _calibrate(shell, case, args.scale)
        long = case.target_s >= 60 and args.long_repeats is not None
        repeats = args.long_repeats if long else args.repeats
        for kind in args.loads.split(","):
            rows.append(measure(shell, case, kind, steps, repeats))
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "budget_s": BUDGET_S,
                "scale": args.scale,
                "repeats": args.repeats,
                "long_repeats": args.long_repeats or args.repeats,
                "rows": [
                    {
                        **asdict(row),
                        "promise_kept": row.promise_kept,
                        "baseline_apart": row.baseline_apart,
                        "baseline_apart_paired": row.baseline_apart_paired,
                    }
                    for row in rows
                ],
                "table": table(rows),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
