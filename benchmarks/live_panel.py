"""The live panel's cost to the cell it measures: JupyterLab in headless Chromium, a kernel,
the plain cell and `%%perfcheck` on it in turns, with and without a CPU-bound process.

    python benchmarks/live_panel.py [--json PATH] [--repeats N] [--steps N]

A cell measured in a kernel with its live panel open ran far slower than the same cell in a
quiet IPython shell (issue 18: a 2.4 s cell's baseline read 35.7 s ± 11.4 s). What differs
in a kernel is the front end: every report published and every progress message is
serialised, sent over the kernel's IOPub socket and redrawn by the browser, on the same
CPUs the next timed run needs. This benchmark measures, in a real JupyterLab:

- the plain cell's time per iteration, run in the notebook (the user's own number);
- perfcheck's baseline per iteration (the saved report's JSON), and how far apart they are;
- the browser's CPU time while perfcheck measured, per second (all Chromium processes);

for two front-end rates: `paced` (what perfcheck does: progress at most once a second, a
partial report every 2 s, the progress bar moved in place) and `chatty` (a partial report
after every run and every progress message sent: the earlier behaviour's rate). Each with
nothing else running and with one CPU-bound process beside it. Prints a table and writes
JSON (default benchmarks/results/live_panel.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from real_cells import DATA, RAW_CELL, RAW_SETUP, load  # noqa: E402

from tests.browser.lab import CHROMIUM, CHROMIUM_ARGS, LIVE_PANEL, Lab  # noqa: E402
from tests.browser.server import start_jupyter_lab  # noqa: E402

RATES = {
    "paced": "",
    "chatty": (
        "import torchtune_magic.session as _s, torchtune_magic.render.widget as _w\n"
        "_s.PUBLISH_EVERY_S = 0.0\n_w.PROGRESS_EVERY_S = 0.0\n"
    ),
}
TIMED = (
    "import time as _time\n_t0 = _time.perf_counter()\n"
    "{cell}print(f'plain {{_time.perf_counter() - _t0:.6f}}')\n"
)


@dataclass
class Row:
    rate: str
    load: str
    steps: int
    plain_s: list[float] = field(default_factory=list)
    baseline_step_s: list[float] = field(default_factory=list)
    browser_cpu: list[float] = field(default_factory=list)  # CPU-s per wall second

    @property
    def apart(self) -> float:
        plain = statistics.median(self.plain_s) / self.steps
        return statistics.median(self.baseline_step_s) / plain - 1


def chromium_cpu_s() -> float:
    """CPU seconds used so far by every Chromium process on the machine."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if "chrom" not in (entry / "comm").read_text():
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return total / ticks


@contextlib.contextmanager
def browser_lab(base: Path) -> Iterator[Lab]:
    from playwright.sync_api import sync_playwright

    with (base / "jupyter-lab.log").open("wb") as log:
        server = start_jupyter_lab(base, log)
        try:
            with sync_playwright() as playwright:
                chromium = playwright.chromium.launch(
                    executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
                )
                page = chromium.new_context(viewport={"width": 1400, "height": 1000}).new_page()
                page.set_default_timeout(600_000)
                yield Lab(page=page, server=server, name="live-panel-benchmark")
                chromium.close()
        finally:
            server.stop()


def run_once(lab: Lab, rate: str, steps: int, index: int) -> tuple[float, float, float]:
    """Plain cell, then %%perfcheck on it, in a fresh notebook; (plain s, baseline per
    iteration s, browser CPU-s per wall second while perfcheck ran)."""
    cell = RAW_CELL.format(steps=steps)
    report_path = lab.server.root / f"report-{index}.json"
    name = lab.server.write_notebook(
        f"panel-{index}.ipynb",
        [
            "%load_ext torchtune_magic\n" + RATES[rate],
            DATA + RAW_SETUP,
            TIMED.format(cell=cell),
            DATA + RAW_SETUP,
            f"%%perfcheck --json {report_path}\n{cell}",
        ],
    )
    lab.open_notebook(name)
    for position in range(3):
        lab.run_cell(position, timeout=600_000)
    printed = lab.cell(2).locator(".jp-OutputArea-output").last.inner_text()
    plain = float(printed.split("plain ")[1].split()[0])
    lab.run_cell(3, timeout=600_000)
    before_cpu, before = chromium_cpu_s(), time.perf_counter()
    lab.run_cell(4, f"{LIVE_PANEL}[class*='ttm-run-']", timeout=600_000)
    while not report_path.exists():
        time.sleep(0.2)
    cpu = (chromium_cpu_s() - before_cpu) / (time.perf_counter() - before)
    report = json.loads(report_path.read_text())
    per_step = report["baseline"]["median_s"]
    if "sampling" not in report:
        per_step /= steps
    lab.server.shutdown_kernels()
    return plain, per_step, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=HERE / "results" / "live_panel.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--loads", default="quiet,busy")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as base, browser_lab(Path(base)) as lab:
        index = 0
        for kind in args.loads.split(","):
            for rate in RATES:
                row = Row(rate, kind, args.steps)
                with load(kind):
                    for _ in range(args.repeats):
                        index += 1
                        plain, per_step, cpu = run_once(lab, rate, args.steps, index)
                        row.plain_s.append(plain)
                        row.baseline_step_s.append(per_step)
                        row.browser_cpu.append(cpu)
                        print(
                            f"  {rate:6} {kind:5}: plain {plain / args.steps * 1e3:.3f} ms/it, "
                            f"baseline {per_step * 1e3:.3f} ms/it, browser {cpu:.2f} CPU",
                            flush=True,
                        )
                rows.append(row)
    lines = [
        "| front-end rate | load | plain per iteration | baseline per iteration | apart | "
        "browser CPU while measuring |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.rate} | {row.load} | "
            f"{statistics.median(row.plain_s) / row.steps * 1e3:.3f} ms | "
            f"{statistics.median(row.baseline_step_s) * 1e3:.3f} ms | {row.apart:+.1%} | "
            f"{statistics.median(row.browser_cpu):.2f} CPU |"
        )
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"rows": [asdict(r) for r in rows], "table": "\n".join(lines)}, indent=2)
    )


if __name__ == "__main__":
    main()
