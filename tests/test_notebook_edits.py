"""Making a fix permanent: real diffs of the earlier cells that built the objects.

In a real IPython shell with execution counts (cells stored in its history, as a kernel
does), the constructors are found in the cells that ran them: the DataLoader call gets
`num_workers`/`persistent_workers`, the convs of a class or an `nn.Sequential` get
`bias=False`, the optimizer gets `fused=True`. The report carries them per finding and
combined (`notebook_edits`), and `%perfcheck insert` carries the loader's rebuild.
"""

from __future__ import annotations

import ast
import re
import time

import jsonschema
import pytest
import torch
from torch.utils.data import Dataset

from torchtune_magic.cell import history
from torchtune_magic.cell.notebook import Inputs, Notebook
from torchtune_magic.report import Report, load_schema

CLASS_CELL = """class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.features = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.head(torch.relu(self.features(x)).mean((2, 3)))"""
MODEL_CELL = """model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)"""
LOADER_CELL = """%precision 3
loader = DataLoader(SlowImages(32), batch_size=8, shuffle=True)"""
FIXES = "dataloader-workers,conv-bias-bn,zero-grad-none"
# applied by name: the combined edits then carry these three, whatever their verdicts here
CHECKED = f"""%%perfcheck -o -q --budget 1 --checks {FIXES} --apply {FIXES}

for x, y in loader:
    opt.zero_grad(set_to_none=False)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()"""


class SlowImages(Dataset):
    """Images that take a while to load (a sleep: workers overlap it on any core count)."""

    def __init__(self, n: int):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 8, 8, generator=generator)
        self.y = torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.002)
        return self.x[index], self.y[index]


def _cells(ip) -> dict[str, int]:
    """Run the set-up as notebook cells (stored in the history); their execution counts."""
    ip.user_ns["SlowImages"] = SlowImages
    counts = {}
    for name, code in [
        ("imports", "from torch.utils.data import DataLoader"),
        ("class", CLASS_CELL),
        ("model", MODEL_CELL),
        ("loader", LOADER_CELL),
    ]:
        counts[name] = ip.execution_count
        assert ip.run_cell(code, store_history=True).error_in_exec is None
    return counts


def test_earlier_cells_get_diffs_for_the_loader_and_the_convs_with_execution_counts(ip):
    counts = _cells(ip)
    report = ip.run_cell(CHECKED, store_history=True).result
    workers = report.finding("dataloader-workers")
    k = ip.user_ns["loader"].num_workers or re.search(r"(\d+) chosen", workers.details)[1]
    loader_line = "loader = DataLoader(SlowImages(32), batch_size=8, shuffle=True, "
    loader_after = f"%precision 3\n{loader_line}num_workers={k}, persistent_workers=True)"

    (loader_cell,) = workers.code_change.cells
    assert loader_cell.execution_count == counts["loader"]
    assert loader_cell.before == LOADER_CELL  # as typed: the magic line stays a magic
    assert loader_cell.after == loader_after
    assert loader_cell.diff.splitlines()[:4] == [
        f"--- In[{counts['loader']}]",
        f"+++ In[{counts['loader']}] (optimized)",
        "@@ -1,2 +1,2 @@",
        " %precision 3",
    ]
    assert workers.code_change.elsewhere == []  # a real diff, not a hint

    convs = report.finding("conv-bias-bn")
    (class_cell,) = convs.code_change.cells
    assert class_cell.execution_count == counts["class"]
    assert class_cell.after == CLASS_CELL.replace(
        "nn.Conv2d(3, 8, 3, padding=1)", "nn.Conv2d(3, 8, 3, padding=1, bias=False)"
    ).replace("nn.Conv2d(8, 8, 3, padding=1)", "nn.Conv2d(8, 8, 3, padding=1, bias=False)")
    assert convs.code_change.elsewhere == []

    # the checked cell, its %%perfcheck line exactly as typed
    (checked,) = report.finding("zero-grad-none").code_change.cells
    assert checked.execution_count is None and checked.before == CHECKED
    assert checked.after == CHECKED.replace("set_to_none=False", "set_to_none=True")
    assert "@@ -3,3 +3,3 @@" in checked.diff  # the editor's numbering: the magic is line 1

    # the fixes applied: their cells, one entry per cell, in notebook order
    assert report.applied == sorted(FIXES.split(","))
    edits = report.notebook_edits
    assert sorted(edits.fixes) == ["conv-bias-bn", "dataloader-workers", "zero-grad-none"]
    assert [c.execution_count for c in edits.cells] == [counts["class"], counts["loader"], None]
    data = report.to_dict()
    jsonschema.validate(data, load_schema())
    assert Report.from_dict(data).notebook_edits == edits


def test_two_fixes_editing_one_earlier_cell_make_one_entry(ip):
    ip.user_ns["SlowImages"] = SlowImages
    setup = (  # the convs come from a factory, inside `nn.Sequential(...).to(device)`
        "from torch.utils.data import DataLoader\n"
        "def block(cin, cout):\n"
        "    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout))\n"
        "model = nn.Sequential(block(3, 8), nn.ReLU(), block(8, 8), nn.Flatten(),\n"
        "                      nn.LazyLinear(1)).to('cpu')\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "loader = DataLoader(SlowImages(32), batch_size=8)"
    )
    count = ip.execution_count
    ip.run_cell(setup, store_history=True)
    ip.run_cell("model(torch.zeros(1, 3, 8, 8));", store_history=True)  # materialise LazyLinear
    report = ip.run_cell(
        "%%perfcheck -o -q --budget 1 --checks dataloader-workers,conv-bias-bn "
        "--apply dataloader-workers,conv-bias-bn\n"
        "for x, y in loader:\n"
        "    loss = ((model(x) - y) ** 2).mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n",
        store_history=True,
    ).result
    (entry,) = report.notebook_edits.cells
    assert entry.execution_count == count and entry.before == setup
    assert "nn.Conv2d(cin, cout, 3, padding=1, bias=False)" in entry.after
    assert "DataLoader(SlowImages(32), batch_size=8, num_workers=" in entry.after
    assert "persistent_workers=True)" in entry.after
    changed = [line[0] for line in entry.diff.splitlines()[3:] if line[0] in "+-"]
    assert changed == ["-", "+", "-", "+"]  # the factory's conv line, then the loader's


def test_the_optimizer_constructor_gets_fused_and_its_scheduler_is_rebuilt_with_it(ip):
    """`fused-optimizer` is a CUDA check; its permanent change goes through the same lookup,
    run here on a real optimizer from a real shell's history."""
    counts = _cells(ip)
    notebook = Notebook("", "", None, _inputs(ip))
    edit = history.keyword_edit(notebook, ip.user_ns, ["opt"], {"fused": "True"})
    assert edit is not None and edit.execution_count == counts["model"] and edit.line == 2
    rebuilt, left = history.rebuilds(notebook, [("fused-optimizer", edit)])
    assert left == []
    (rebuild,) = rebuilt
    assert rebuild.names == ["opt", "sched"]  # the scheduler follows the new optimizer
    assert rebuild.text == (
        "opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)\n"
        "sched = torch.optim.lr_scheduler.StepLR(opt, 10)"
    )
    # a name bound some other way since (a loop, a tuple) is not followed to an older cell
    ip.run_cell("for opt in [opt]:\n    pass", store_history=True)
    later = Notebook("", "", None, _inputs(ip))
    assert history.keyword_edit(later, ip.user_ns, ["opt"], {"fused": "True"}) is None


def test_insert_carries_the_loader_rebuild_and_says_what_it_inserted(ip, capsys):
    counts = _cells(ip)
    ip.run_cell(CHECKED, store_history=True)
    capsys.readouterr()
    ip.rl_next_input = None
    ip.run_line_magic("perfcheck", "insert")
    inserted = ip.rl_next_input
    shown = capsys.readouterr().out
    loader_at = inserted.index("loader = DataLoader(SlowImages(32), batch_size=8, shuffle=True")
    assert loader_at < inserted.index("for x, y in loader:")  # rebuilt before the loop
    assert "persistent_workers=True)" in inserted
    assert "opt.zero_grad(set_to_none=True)" in inserted and "%%perfcheck" not in inserted
    assert f"rebuilds `loader` as In[{counts['loader']}] does" in shown
    assert "dataloader-workers" in shown
    assert "not carried: conv-bias-bn" in shown and f"In[{counts['class']}]" in shown

    before = ip.user_ns["loader"]
    assert ip.run_cell(inserted, store_history=True).error_in_exec is None
    assert ip.user_ns["loader"] is not before and ip.user_ns["loader"].persistent_workers


# anomaly mode left on by an earlier cell -----------------------------------------------------

# tiny ops: anomaly mode's record of each one costs several times the op
TINY_MODEL = """layers = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(8)]
model = nn.Sequential(*layers)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(4, 16)"""
DEBUG_CELL = """DEBUG = True
# chasing a NaN last week
torch.autograd.set_detect_anomaly(True)  # on while debugging
if DEBUG:
    torch.autograd.set_detect_anomaly(mode=True)
def debug_on():  # turns it on only when called
    torch.autograd.set_detect_anomaly(True)
lr = 0.1"""
STEPS = """for step in range(20):
    opt.zero_grad()
    model(X).square().mean().backward()
    opt.step()"""


@pytest.fixture
def anomaly_off(ip):
    """Anomaly mode is process-wide: off again after the test, whatever it left (the fix
    left applied is reverted first: its undo turns anomaly mode back on)."""
    yield
    ip.run_line_magic("perfcheck", "revert")
    torch.autograd.set_detect_anomaly(False)


@pytest.mark.usefixtures("anomaly_off")
def test_anomaly_mode_left_on_by_an_earlier_cell_is_removed_there(ip, capsys):
    """The fix names the cell that turned anomaly mode on: its edit removes both calls that
    ran (comments kept, `pass` where the block would be empty; a function's call is left,
    it ran only if called), and it is one more cell of the fixes' notebook edits, which
    Apply to notebook applies as one change."""
    assert ip.run_cell(TINY_MODEL, store_history=True).error_in_exec is None
    count = ip.execution_count
    assert ip.run_cell(DEBUG_CELL, store_history=True).error_in_exec is None
    # applied by name: the edits then carry it whatever its verdict here (the recommended
    # fixes' edits are made the same way, of the fixes measured clear wins)
    checked = "%%perfcheck -o -q --budget 2 --checks debug-anomaly --apply debug-anomaly\n"
    report = ip.run_cell(checked + STEPS, store_history=True).result
    finding = report.finding("debug-anomaly")
    assert finding.where == f"In[{count}] lines 3, 5"
    assert f"enabled at In[{count}] lines 3, 5" in finding.details
    assert finding.segment == "backward"

    (cell,) = finding.code_change.cells
    assert cell.execution_count == count and cell.before == DEBUG_CELL
    assert cell.after == DEBUG_CELL.replace(
        "torch.autograd.set_detect_anomaly(True)  # on while debugging\n", ""
    ).replace("    torch.autograd.set_detect_anomaly(mode=True)", "    pass")
    assert "def debug_on():  # turns it on only when called\n    torch" in cell.after
    ast.parse(cell.after)
    assert cell.diff.startswith(f"--- In[{count}]\n+++ In[{count}] (optimized)\n")
    assert finding.code_change.elsewhere == []  # a real edit, not a hint to make one

    assert report.applied == ["debug-anomaly"]
    assert report.notebook_edits.fixes == ["debug-anomaly"]
    assert report.notebook_edits.cells == [cell]
    data = report.to_dict()
    jsonschema.validate(data, load_schema())
    assert Report.from_dict(data).notebook_edits == report.notebook_edits

    capsys.readouterr()
    ip.run_line_magic("perfcheck", "insert")  # a new cell cannot carry that edit: said
    shown = capsys.readouterr().out
    removes = f"removes the set_detect_anomaly(...) call at In[{count}] line 5"
    assert f"not carried: debug-anomaly {removes}" in shown


@pytest.mark.usefixtures("anomaly_off")
def test_anomaly_mode_turned_on_in_the_checked_cell_is_removed_from_it(ip):
    assert ip.run_cell(TINY_MODEL, store_history=True).error_in_exec is None
    checked = (
        "%%perfcheck -o -q --budget 2 --checks debug-anomaly --apply debug-anomaly\n"
        "torch.autograd.set_detect_anomaly(mode=True)\n" + STEPS
    )
    report = ip.run_cell(checked, store_history=True).result
    finding = report.finding("debug-anomaly")
    assert finding.where == "cell line 2"  # the editor's numbering
    (cell,) = report.notebook_edits.cells
    assert cell.execution_count is None and cell.before == checked
    assert cell.after == checked.replace("torch.autograd.set_detect_anomaly(mode=True)\n", "")
    assert "-torch.autograd.set_detect_anomaly(mode=True)" in cell.diff
    assert finding.code_change.cells == [cell]


def _inputs(ip) -> Inputs:
    """The shell's stored cells, the last one having the count before the next prompt's."""
    return Inputs.of_history(ip.history_manager, ip.execution_count - 1)
