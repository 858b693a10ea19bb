"""The kernel stays the size it was: %%perfcheck run again and again in one real IPython
process does not grow it.

Each run profiles the cell (the probe, each configuration's peak memory). The profiler kept
every run's events alive until Python's cyclic collector ran, and glibc kept the memory they
were freed from: 60 runs on an anomaly-mode training cell grew a kernel from 465 to 2,082
MiB resident. Here 30 runs of a small such cell in a fresh IPython process must leave it
within 50 MiB of where it stood after the warm-up runs (before the fix: about 4 MiB a run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = 30
WARMUP_RUNS = 5  # caches filled once (the profiler's, torch's, IPython's history)
MAX_GROWTH_MIB = 50
SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(512, 32), torch.randint(0, 10, (512,))
"""
# debug-anomaly alone keeps a run to about 1.5 s on a busy 2-core machine; the profiled
# runs, the measuring runs and the restores between them are all there whatever the checks
CELL = """%%perfcheck --budget 0.5 -q --checks debug-anomaly
torch.autograd.set_detect_anomaly(True)
for i in range(0, len(X), 16):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(X[i:i + 16]), Y[i:i + 16])
    loss.backward()
    opt.step()
torch.autograd.set_detect_anomaly(False)
"""
SCRIPT = f"""
from IPython.testing.globalipapp import start_ipython

def resident_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

shell = start_ipython()
shell.run_line_magic("load_ext", "torchtune_magic")
assert shell.run_cell({SETUP!r}).success
for _ in range({RUNS}):
    result = shell.run_cell({CELL!r})
    if not result.success:
        raise SystemExit(f"the cell failed: {{result.error_in_exec!r}}")
    print("resident", resident_mib(), flush=True)
"""


def test_thirty_runs_leave_the_kernel_the_size_it_was(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    resident = [float(line.split()[1]) for line in done.stdout.splitlines() if "resident" in line]
    assert len(resident) == RUNS
    settled = resident[WARMUP_RUNS - 1]
    growth = max(resident[WARMUP_RUNS:]) - settled
    assert growth <= MAX_GROWTH_MIB, (
        f"resident memory grew {growth:.0f} MiB over {RUNS - WARMUP_RUNS} runs after the "
        f"warm-up: {', '.join(f'{r:.0f}' for r in resident)} MiB"
    )
