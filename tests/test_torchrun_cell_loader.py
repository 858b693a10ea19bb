"""distributed-sampler for a loader the cell builds, under real torchrun (gloo, CPU, two
processes): every run of the cell makes a new DataLoader, so the fix gives the sampler to
its constructor call in the cell text, is measured on both ranks (each rank half the
batches), and each rank's state ends as after one plain run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_torchrun import _assert_equal, _on_one_node, _state

SCRIPT = Path(__file__).resolve().parent / "ddp_cell_loader_script.py"
BUDGET_S = 15

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)


def test_a_loader_the_cell_builds_gets_the_sampler_in_its_constructor(tmp_path: Path) -> None:
    plain = _on_one_node(str(SCRIPT), "plain", str(tmp_path))
    assert plain.returncode == 0, plain.stderr[-3000:]
    checked = _on_one_node(str(SCRIPT), "perfcheck", str(tmp_path), str(BUDGET_S))
    assert checked.returncode == 0, checked.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    [finding] = [f for f in data["findings"] if f["id"] == "distributed-sampler"]
    assert finding["fixable"], finding["details"]
    assert "each of the 2 ranks iterates all 48" in finding["evidence"]
    edited = (
        "+loader = torch.utils.data.DataLoader(dataset, batch_size=16, "
        "sampler=torch.utils.data.DistributedSampler(dataset, shuffle=True))"
    )
    assert edited in finding["code_change"]["diff"], finding["code_change"]
    [sampler] = [v for v in data["variants"] if v["fixes"] == ["distributed-sampler"]]
    assert sampler["speedup"] and not sampler["error"], sampler
    # each rank trained on its half of the data in the runs with the fix: it reached them
    assert sampler["numerics"]["verdict"] == "changed", sampler["numerics"]
    assert sampler["verdict"] != "slower" and sampler["speedup"] > 1.3, sampler
    for rank in (0, 1):
        _assert_equal(
            _state(tmp_path, "perfcheck", rank), _state(tmp_path, "plain", rank), f"{rank}"
        )
