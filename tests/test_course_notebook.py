"""A course notebook's habits, executed in real kernels (issue 28).

Course material builds its loaders with a comment after each argument, trains through
`train_step` functions inside a `tqdm` loop, and prints as it goes. `%%perfcheck` on the
training cell must report the loader's fix with a code change of the loader cell that keeps
every comment and parses, and every cell must print what it prints in a plain run.

The second test breaks perfcheck's own rendering and its live panel inside the kernel: the
cell still runs once, its output stays, and the report that is shown says what failed.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from torchtune_magic.report import MIME_TYPE, Report

REPO = Path(__file__).resolve().parents[1]

DATA = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from slow_data import SlowDataset

torch.manual_seed(42)
train_data = SlowDataset(n=96, features=8, delay_s=0.004)
test_data = SlowDataset(n=32, features=8, delay_s=0.004)
BATCH_SIZE = 16
"""

LOADERS = """
train_dataloader = DataLoader(train_data, # dataset to turn into iterable
    batch_size=BATCH_SIZE, # how many samples per batch?
    shuffle=True # shuffle training data on every epoch?
)

test_dataloader = DataLoader(test_data,
    batch_size=BATCH_SIZE,
    shuffle=False # don't necessarily have to shuffle the testing data
)
print(f"Length of train dataloader: {len(train_dataloader)} batches of {BATCH_SIZE}")
"""

MODEL = """
class RegressionModelV0(nn.Module):
    def __init__(self, input_shape: int, hidden_units: int, output_shape: int):
        super().__init__()
        self.layer_stack = nn.Sequential(
            nn.Linear(in_features=input_shape, out_features=hidden_units), # in
            nn.ReLU(),
            nn.Linear(in_features=hidden_units, out_features=output_shape), # out
        )

    def forward(self, x):
        return self.layer_stack(x)

torch.manual_seed(42)
model_0 = RegressionModelV0(input_shape=8, hidden_units=16, output_shape=1)
loss_fn = nn.MSELoss()
optimizer = torch.optim.SGD(params=model_0.parameters(), lr=0.1)

def train_step(model, data_loader, loss_fn, optimizer):
    train_loss = 0
    for batch, (X, y) in enumerate(data_loader):
        y_pred = model(X) # 1. Forward pass
        loss = loss_fn(y_pred, y) # 2. Calculate loss
        train_loss += loss.item()
        optimizer.zero_grad() # 3. Optimizer zero grad
        loss.backward() # 4. Loss backward
        optimizer.step() # 5. Optimizer step
    return train_loss / len(data_loader)

def test_step(model, data_loader, loss_fn):
    test_loss = 0
    model.eval()
    with torch.inference_mode():
        for X, y in data_loader:
            test_loss += loss_fn(model(X), y).item()
    model.train()
    return test_loss / len(data_loader)
"""

TRAIN = """
torch.manual_seed(42)
epochs = 3
for epoch in tqdm(range(epochs)):
    train_loss = train_step(model_0, train_dataloader, loss_fn, optimizer)
    test_loss = test_step(model_0, test_dataloader, loss_fn)
    print(f"Epoch: {epoch} | Train loss: {train_loss:.5f} | Test loss: {test_loss:.5f}")
"""

LATER = [
    "print(round(sum(p.sum().item() for p in model_0.parameters()), 6))",
    "print(f'{test_step(model_0, test_dataloader, loss_fn):.6f}')",
    "print(train_dataloader.num_workers, test_dataloader.num_workers)",
]

LOADER_COMMENTS = [
    "# dataset to turn into iterable",
    "# how many samples per batch?",
    "# shuffle training data on every epoch?",
    "# don't necessarily have to shuffle the testing data",
]


def _notebook(magic: str | None, *extra: str) -> nbformat.NotebookNode:
    train = TRAIN.strip() if magic is None else f"{magic}\n{TRAIN.strip()}"
    sources = ["%load_ext torchtune_magic", DATA, LOADERS, MODEL, *extra, train, *LATER]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source.strip()) for source in sources]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    return notebook


def _execute(notebook: nbformat.NotebookNode, cwd: Path) -> nbformat.NotebookNode:
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(cwd)}}
    )
    return client.execute()


# tqdm's bar ends with its timings and rate ("[00:01<00:00, 2.31it/s]"), which no two runs
# share: only the bar's count is compared
_TQDM_TIMES = re.compile(r"\[[^\]]*(?:it/s|s/it)[^\]]*\]")


def _streams(cell: nbformat.NotebookNode) -> dict[str, str]:
    """What a cell printed, per stream, with tqdm's timings left out."""
    printed: dict[str, str] = {}
    for output in cell.outputs:
        if output.output_type == "stream":
            printed[output.name] = printed.get(output.name, "") + output.text
    if "stderr" in printed:
        last = printed["stderr"].replace("\r", "\n").strip().splitlines()[-1:]
        printed["stderr"] = _TQDM_TIMES.sub("", "".join(last)).strip()
    return printed


def _report(cell: nbformat.NotebookNode) -> Report:
    found = [o.data[MIME_TYPE] for o in cell.outputs if MIME_TYPE in o.get("data", {})]
    assert found, f"no report in the cell's outputs: {[o.output_type for o in cell.outputs]}"
    return Report.from_dict(found[-1])


def _comments(source: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.string for t in tokens if t.type == tokenize.COMMENT]


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    parts = (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in parts if p))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TQDM_MININTERVAL", "60")  # one bar at the start and one at the end
    return tmp_path


def test_a_loader_with_a_comment_after_each_argument_gets_a_code_change_that_keeps_them(
    kernel_env: Path,
) -> None:
    plain = _execute(_notebook(None), kernel_env)
    checked = _execute(
        _notebook("%%perfcheck --budget 6 --skip cpu-threads,cpu-allocator"), kernel_env
    )

    train = len(plain.cells) - len(LATER) - 1
    for index, (mine, theirs) in enumerate(zip(checked.cells, plain.cells, strict=True)):
        assert not [o for o in mine.outputs if o.output_type == "error"], f"cell {index}"
        assert _streams(mine) == _streams(theirs), f"cell {index} printed something else"

    report = _report(checked.cells[train])
    assert report.failures == []
    workers = report.finding("dataloader-workers")
    assert workers is not None, [f.id for f in report.findings]
    assert workers.code_change is not None
    loader_cell = checked.cells[2]
    count = loader_cell.execution_count
    edits = [c for c in workers.code_change.cells if c.execution_count == count]
    assert len(edits) == 1, workers.code_change
    edit = edits[0]
    assert edit.before == loader_cell.source
    ast.parse(edit.after)  # the edited cell parses
    assert _comments(edit.after) == LOADER_COMMENTS  # every comment kept, in place
    assert "num_workers=" in edit.after
    # only the train loader's call changes, and in it only what the fix names
    before_test = LOADERS.strip().split("test_dataloader =")[1]
    assert edit.after.split("test_dataloader =")[1] == before_test
    kept = ["train_dataloader = DataLoader(train_data, # dataset to turn into iterable",
            "    batch_size=BATCH_SIZE, # how many samples per batch?"]
    assert all(line in edit.after.splitlines() for line in kept)


BREAK_RENDERING = """
import torchtune_magic.render.html as _html

def _broken_html(report):
    raise RuntimeError("injected into the HTML view")

_html.render = _broken_html
"""

BREAK_PANEL = """
import torchtune_magic.render.widget as _widget

def _broken_update(self, report):
    raise RuntimeError("injected into the panel")

_widget.Panel.update = _broken_update
"""


@pytest.mark.parametrize(
    ("breaking", "shown"),
    [
        (
            BREAK_RENDERING,
            "rendering the HTML view failed: RuntimeError: injected into the HTML view",
        ),
        (BREAK_PANEL, "the panel failed: RuntimeError: injected into the panel"),
    ],
    ids=["rendering", "the panel"],
)
def test_a_broken_view_of_ours_leaves_the_cell_and_the_rest_of_the_report(
    kernel_env: Path, breaking: str, shown: str
) -> None:
    plain = _execute(_notebook(None, "pass"), kernel_env)
    checked = _execute(
        _notebook("%%perfcheck --budget 4 --checks dataloader-workers", breaking), kernel_env
    )

    train = len(plain.cells) - len(LATER) - 1
    for index, (mine, theirs) in enumerate(zip(checked.cells, plain.cells, strict=True)):
        assert not [o for o in mine.outputs if o.output_type == "error"], f"cell {index}"
        assert _streams(mine) == _streams(theirs), f"cell {index} printed something else"
    cell = checked.cells[train]
    html = "".join(o.data.get("text/html", "") for o in cell.outputs if "data" in o)
    assert shown in html
    report = _report(cell)
    assert report.finding("dataloader-workers") is not None
    assert {tuple(v.fixes) for v in report.variants} == {("dataloader-workers",)}
    assert report.cell_run is not None and report.cell_run.status in ("probe", "complete")
