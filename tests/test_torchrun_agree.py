"""Under real torchrun (gloo, CPU, two processes) the ranks agree on what was found: a
check that decides from a measured figure decides from the ranks' mean of it, so a cell
whose op time shares differ by rank gets the same findings on both, none "found on rank
1 only" and left unmeasured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_torchrun import TESTS, _on_one_node

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch built without torch.distributed"
)


def test_a_share_that_differs_by_rank_is_decided_once_for_every_rank(tmp_path: Path) -> None:
    """Rank 1's elementwise chain is 4x rank 0's: on its own, rank 1's share crosses
    fuse-pointwise's 15% and rank 0's does not (the report then warned "found on rank 1
    only" and measured nothing). Agreed, both ranks find it and its fix is measured."""
    done = _on_one_node(str(TESTS / "agree_script.py"), str(tmp_path), "6")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert not [w for w in data["warnings"] if "found on rank" in w], data["warnings"]
    ids = [json.loads((tmp_path / f"ids-{rank}.json").read_text()) for rank in (0, 1)]
    assert ids[0] == ids[1] == ["fuse-pointwise"], ids
    (variant,) = [v for v in data["variants"] if v["fixes"] == ["fuse-pointwise"]]
    assert not variant["error"], variant
