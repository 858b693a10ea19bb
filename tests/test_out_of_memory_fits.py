"""A cell that runs out of memory learns what makes it fit: each memory fix is run once, from
the state before the cell, to past the step that failed, with its peak memory.

A CPU has no memory limit of its own to run into, so the cell runs in a fresh process whose
address space is capped (RLIMIT_AS) a few hundred MiB above what it maps once warmed up:
the real CPU allocator then refuses the activations of a deep stack of wide blocks, as a
GPU's allocator refuses them at its memory size, and checkpointing them fits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from torch import nn
    from torchtune_magic import perfcheck
    from torchtune_magic.cell.workload import CellError
    from torchtune_magic.render import text

    torch.set_num_threads(1)  # thread stacks come out of the capped address space too
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.act = nn.GELU()

        def forward(self, x):
            return x + self.act(self.norm(x)) * torch.sigmoid(x)

    class Deep(nn.Module):
        def __init__(self, width=1024, depth=16):
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    ns = {"torch": torch, "model": Deep(), "x": torch.randn(4096, 1024)}
    ns["opt"] = torch.optim.SGD(ns["model"].parameters(), lr=0.01)
    ns["warm"] = torch.randn(64, 1024)
    # everything perfcheck maps once (profiler, allocator arenas) before the cap
    perfcheck("model(warm).sum().backward()", ns, budget=0.5)
    before = {k: v.detach().clone() for k, v in ns["model"].state_dict().items()}

    with open("/proc/self/status") as status:
        mapped = next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + int(sys.argv[1]) * 2**20, -1))

    cell = "loss = model(x).square().mean()\\nloss.backward()\\nopt.step()\\nopt.zero_grad()\\n"
    reports = []
    try:
        perfcheck(cell, ns, budget=5, on_report=reports.append)
        raised = None
    except CellError as error:
        raised = str(error.original)
    report = reports[-1]
    print(json.dumps({
        "raised": raised,
        "report": report.to_dict(),
        "phases": [r.phase for r in reports],
        "text": text.render(report),
        "loss_bound": "loss" in ns,
        "params_kept": all(
            torch.equal(v, before[k]) for k, v in ns["model"].state_dict().items()
        ),
    }))
    """
)

CAP_MIB = 1000  # the blocks keep ~1 GiB for backward, ~0.35 GiB checkpointed


def _run_capped() -> dict:
    # One malloc arena: glibc reserves 64 MiB of address space for each thread's arena
    # when that thread first allocates, which counts against the cap at a moment that
    # depends on scheduling (2 runs in 5 then ran out with the fix too). A GPU's memory
    # has no such thing; with one arena the cap holds tensors, as a GPU's memory does.
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CAP_MIB)],
        env={**os.environ, "MALLOC_ARENA_MAX": "1"},
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def capped() -> dict:
    return _run_capped()


def test_the_cell_runs_out_of_memory_and_raises_its_own_error(capped: dict) -> None:
    assert capped["raised"] and "can't allocate memory" in capped["raised"]
    oom = capped["report"]["oom"]
    assert oom["line"] == 1 and oom["requested_bytes"] >= 2**24  # a 16 MiB activation


def test_checkpointing_is_found_though_the_backward_never_ran(capped: dict) -> None:
    ids = [f["id"] for f in capped["report"]["findings"]]
    assert "no-grad" not in ids  # the cell calls backward: it just never got there
    finding = next(f for f in capped["report"]["findings"] if f["id"] == "activation-checkpointing")
    assert finding["evidence"].startswith("out of memory")
    ran = re.search(r"(\d+) × Block", finding["evidence"])  # the blocks run before it failed
    assert ran is not None and 3 <= int(ran.group(1)) <= 16


def test_the_fix_is_run_and_shown_to_make_the_cell_fit(capped: dict) -> None:
    report = capped["report"]
    variant = next(v for v in report["variants"] if v["fixes"] == ["activation-checkpointing"])
    assert variant["fits"] is True and variant["error"] is None, (variant, report["warnings"])
    assert variant["runs"] == 1 and variant["median_s"] > 0
    assert 0 < variant["peak_memory_bytes"] < CAP_MIB * 2**20
    assert capped["phases"][0] == "measuring" and capped["phases"][-1] == "done"
    assert "it fits with activation-checkpointing (" in capped["text"]
    assert "fits with this fix" in capped["text"]


def test_the_kernel_is_left_as_the_failed_plain_cell_leaves_it(capped: dict) -> None:
    # the plain cell failed in its first line: nothing after it ran, `loss` never bound,
    # and the fix's run (which got to opt.step()) left no trace
    assert capped["params_kept"]
    assert not capped["loss_bound"]
