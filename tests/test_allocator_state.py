"""perfcheck's own copies of the user's tensors (state snapshots, numerics) leave glibc's
allocator as it was. glibc raises its mmap threshold whenever a mapped block is freed; if
our copies went through malloc, taking and dropping them would change how the cell's own
allocations are served — and its timings — during the measurement and after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtune_magic.engine import allocator

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import json, sys, torch
from glibc_blocks import mapped
from torchtune_magic.engine import discovery, numerics, state
MIB = 1 << 20
model = torch.nn.Module()
model.weight = torch.nn.Parameter(torch.zeros(4 * MIB))  # 16 MiB, built without temporaries
ns = {"weights": torch.zeros(4 * MIB), "model": model}
if sys.argv[1] == "ours":  # perfcheck's copies, taken and dropped after measuring
    snapshot = state.take(ns, discovery.walk(ns))
    outputs = numerics.capture(ns, {"weights"}, {"model": model})
    del snapshot, outputs
elif sys.argv[1] == "malloc":  # what a copy through malloc does
    copy = ns["weights"].clone()
    del copy
# one look per process (a mapped block, freed, moves the threshold): the imports leave it
# at 1-2 MiB, so a 4 MiB block is mapped unless something freed a bigger mapped block
print(json.dumps(mapped(4 * MIB)))
"""


@pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc only")
def _mapped_after(what: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, what],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(allocator.glibc_version() is None, reason="glibc only")
def test_taking_and_dropping_our_copies_leaves_glibcs_threshold_where_it_was() -> None:
    assert _mapped_after("nothing") is True  # glibc as the imports leave it
    assert _mapped_after("ours") is True  # our 16 MiB copies came and went: unmoved
    # the control: a 16 MiB block freed through malloc raises glibc's threshold to 16 MiB,
    # so a 4 MiB block now comes from the heap: what our copies used to do to the kernel
    assert _mapped_after("malloc") is False
