"""Where the time went, first (issue 31): the baseline's split into data wait, forward,
backward, optimizer and the rest, measured in its first measuring run and shown at the top
of every view and in the JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from workloads import namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.measuring import time_split
from torchtune_magic.render import html, text
from torchtune_magic.report import Report, load_schema

SAMPLE = Path(__file__).parent / "data" / "sample_report.json"


class _Slow(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.004)
        return torch.randn(8), torch.tensor(i % 2)


def test_each_part_is_timed_once_where_it_is_outermost():
    torch.manual_seed(0)
    inner = nn.Linear(8, 8)
    model = nn.Sequential(inner, nn.ReLU(), nn.Linear(8, 2))  # modules inside a module
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(_Slow(), batch_size=16)
    recorder = time_split.SplitRecorder()
    started = time.perf_counter()
    with recorder.recording():
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    wall = time.perf_counter() - started
    split = recorder.split()
    # no CUDA device in use: no host syncs to time, and no part for them
    assert split is not None and set(split) == set(time_split.PARTS) - {"host_sync"}
    # 64 items at 4 ms: the loader's wait is most of the run, and every part is counted
    assert split["data_wait"] >= 0.25
    assert all(split[part] > 0 for part in ("forward", "backward", "optimizer"))
    assert abs(sum(split.values()) - wall) < 0.05 * wall + 0.01
    # the hooks and patches are gone: nothing more is counted after the run
    assert recorder.split() == split
    model(torch.randn(2, 8)).sum().backward()
    assert recorder.split() == split
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_a_report_opens_with_its_time_split_and_the_json_carries_it():
    data = json.loads(SAMPLE.read_text())
    data["time_split"] = {
        "data_wait": 0.63,
        "forward": 0.14,
        "backward": 0.15,
        "optimizer": 0.03,
        "other": 0.05,
    }
    jsonschema.validate(data, load_schema())
    report = Report.from_dict(data)
    assert report.to_dict()["time_split"] == data["time_split"]
    lines = text.render(report).splitlines()
    assert lines[2] == (
        "where the time went (the baseline's first run): data wait 63% · forward 14% · "
        "backward 15% · optimizer 3% · other 5%"
    )
    page = html.render(report)
    assert 'class="ttm-time-split"' in page and 'title="data wait 63%"' in page
    del data["time_split"]
    assert "where the time went" not in text.render(Report.from_dict(data))  # optional


LOADER_SETUP = """
import time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.randn(16), torch.tensor(i % 4)

torch.manual_seed(0)
loader = DataLoader(Items(), batch_size=16)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""
LOADER_CELL = """
for x, y in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def test_perfcheck_reports_where_a_loader_bound_cells_time_went():
    report = perfcheck(LOADER_CELL, namespace_with(LOADER_SETUP), budget=6)
    split = report.time_split
    assert split is not None, report.warnings
    shares = {part: seconds / sum(split.values()) for part, seconds in split.items()}
    # 3 ms an item, a tiny model: the wait is the largest part (over half on a quiet
    # machine; 48 % beside a CPU-bound process, which slows the compute and not the sleep)
    assert shares["data_wait"] > 0.4, shares
    assert max(shares, key=shares.__getitem__) == "data_wait"
    assert "where the time went (the baseline's first run): data wait" in text.render(report)


@pytest.mark.gpu
def test_reads_of_a_cuda_tensor_between_the_parts_are_host_syncs():
    """`.item()` on a CUDA loss after each step waits for the step's kernels: its own part,
    where a CPU run has none."""
    model = nn.Linear(256, 256).cuda()
    x = torch.randn(512, 256, device="cuda")
    recorder, item = time_split.SplitRecorder(), torch.Tensor.item
    with recorder.recording():
        for _ in range(20):
            loss = model(x).square().mean()
            loss.backward()
            loss.item()
    split = recorder.split()
    assert split is not None and split["host_sync"] > 0
    assert torch.Tensor.item is item  # the patch is undone
