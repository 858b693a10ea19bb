"""Apply to notebook: from the live panel, after a dialog showing the diffs, the earlier
cell that built the model and the %%perfcheck cell are edited as one notebook change, and
one undo (Ctrl+Z in command mode) restores both; the same from the saved report after a
reopen, and from the command; a cell changed since it ran is refused."""

from __future__ import annotations

import ast
import io
import tokenize

import pytest
from playwright.sync_api import expect

from .cells import panel_of_report
from .lab import LIVE_PANEL, SAVED_REPORT, Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser

APPLY_COMMAND = "torchtune-magic:apply-to-notebook"

MODEL = """\
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 8 * 8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(16, 3, 8, 8), torch.randn(16, 1)"""
# applied by name: Apply to notebook then carries both edits, whatever their verdicts here
# (with nothing applied it carries the recommended fixes only)
CHECKED = """\
%%perfcheck --budget 1 --checks conv-bias-bn,zero-grad-none --apply conv-bias-bn,zero-grad-none
for step in range(5):
    opt.zero_grad(set_to_none=False)
    loss = ((model(X) - Y) ** 2).mean()
    loss.backward()
    opt.step()"""
MODEL_AFTER = MODEL.replace(
    "nn.Conv2d(3, 8, 3, padding=1)", "nn.Conv2d(3, 8, 3, padding=1, bias=False)"
)
CHECKED_AFTER = CHECKED.replace("set_to_none=False", "set_to_none=True")


def test_apply_to_notebook_edits_both_cells_as_one_undoable_change(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook(
        "apply.ipynb", ["%load_ext torchtune_magic", MODEL, CHECKED]
    )
    lab.open_notebook(notebook)
    lab.run_cell(0)
    lab.run_cell(1)
    panel = lab.run_cell(2, f"{LIVE_PANEL}[class*='ttm-run-']", timeout=120_000)
    expect(panel.locator(".ttm-progress")).to_have_count(0, timeout=120_000)

    panel.get_by_role("button", name="Show code").click()
    edits = panel.locator(".ttm-notebook-edits")
    expect(edits.locator(".ttm-code-block .ttm-code-caption span")).to_have_text(
        ["In[2]", "this cell (%%perfcheck)"]
    )
    edits.get_by_role("button", name="Apply to notebook").click()

    # The dialog shows what will change, cell by cell, before anything does.
    dialog = lab.page.locator(".jp-Dialog")
    expect(dialog.locator(".ttm-apply-preview .ttm-code-caption")).to_have_text(
        ["In[2]", "this cell (%%perfcheck)"]
    )
    expect(dialog.locator(".ttm-diff-add")).to_contain_text(["bias=False", "set_to_none=True"])
    assert lab.source(1) == MODEL and lab.source(2) == CHECKED
    lab.screenshot("dialog")
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()

    expect(edits.locator(".ttm-apply-outcome")).to_have_text(
        "Edited In[2] and this cell (%%perfcheck). One notebook undo (Z or Ctrl/Cmd+Z in "
        "command mode) restores them."
    )
    expect(lab.cell(1).locator(".cm-content")).to_contain_text("padding=1, bias=False)")
    expect(lab.cell(2).locator(".cm-content")).to_contain_text("set_to_none=True")
    assert lab.source(1) == MODEL_AFTER and lab.source(2) == CHECKED_AFTER
    lab.screenshot("applied")

    # One undo restores both cells.
    lab.page.keyboard.press("Control+z")
    expect(lab.cell(1).locator(".cm-content")).not_to_contain_text("bias=False")
    expect(lab.cell(2).locator(".cm-content")).to_contain_text("set_to_none=False")
    assert lab.source(1) == MODEL and lab.source(2) == CHECKED

    # Reopened without the kernel: the saved report (the same view) offers the same edit,
    # found by the execution counts saved in the notebook; the command finds it too.
    lab.save(notebook)
    jupyter_lab.shutdown_kernels()
    lab.page.reload()
    saved = lab.cell(2).locator(SAVED_REPORT)
    expect(saved).to_be_visible()
    lab.focus_editor(2)
    lab.page.keyboard.press("Escape")
    lab.command(APPLY_COMMAND, wait=False)
    expect(lab.page.locator(".jp-Dialog .ttm-apply-preview .ttm-code-caption")).to_have_text(
        ["In[2]", "this cell (%%perfcheck)"]
    )
    lab.page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-reject").click()  # Cancel
    expect(lab.page.locator(".jp-Dialog")).to_have_count(0)
    assert lab.source(1) == MODEL and lab.source(2) == CHECKED

    edits = saved.locator(".ttm-notebook-edits")
    edits.get_by_role("button", name="Apply to notebook").click()
    lab.page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click()
    expect(edits.locator(".ttm-apply-outcome")).to_contain_text("Edited In[2] and this cell")
    expect(lab.cell(1).locator(".cm-content")).to_contain_text("padding=1, bias=False)")
    assert lab.source(1) == MODEL_AFTER and lab.source(2) == CHECKED_AFTER
    lab.page.keyboard.press("Control+z")
    expect(lab.cell(1).locator(".cm-content")).not_to_contain_text("bias=False")
    assert lab.source(1) == MODEL and lab.source(2) == CHECKED

    # A cell changed since it ran: refused, nothing edited.
    lab.focus_editor(1)
    lab.page.keyboard.press("Control+End")
    lab.page.keyboard.type("\nlr = 0.01")
    edits.get_by_role("button", name="Apply to notebook").click()
    expect(edits.locator(".ttm-apply-outcome")).to_have_text(
        "Not applied: In[2] has changed since it ran. Re-run the cells and the %%perfcheck "
        "cell, then apply again."
    )
    expect(lab.page.locator(".jp-Dialog")).to_have_count(0)
    assert lab.source(2) == CHECKED


ANOMALY_ON = """\
import torch
# left on while chasing a NaN
torch.autograd.set_detect_anomaly(True)
print("anomaly detection on")"""
# applied by name, as above: the edits carried are the same code path as the recommended
CHECKED_ANOMALY = """\
%%perfcheck --budget 1 --checks debug-anomaly --apply debug-anomaly
for step in range(5):
    opt.zero_grad()
    loss = ((model(X) - Y) ** 2).mean()
    loss.backward()
    opt.step()"""


def test_apply_to_notebook_turns_off_anomaly_mode_in_the_cell_that_turned_it_on(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    """debug-anomaly's permanent change is in the earlier cell that called
    set_detect_anomaly(True): Apply to notebook removes that call (its comment and the
    rest of the cell stay), and one undo puts it back."""
    notebook = jupyter_lab.write_notebook(
        "anomaly.ipynb", ["%load_ext torchtune_magic", ANOMALY_ON, MODEL, CHECKED_ANOMALY]
    )
    lab.open_notebook(notebook)
    for index in range(3):
        lab.run_cell(index)
    panel = lab.run_cell(3, f"{LIVE_PANEL}[class*='ttm-run-']", timeout=120_000)
    expect(panel.locator(".ttm-progress")).to_have_count(0, timeout=120_000)
    panel.get_by_role("button", name="Show code").click()
    edits = panel.locator(".ttm-notebook-edits")
    expect(edits.locator(".ttm-code-block .ttm-code-caption span").first).to_have_text("In[2]")
    edits.get_by_role("button", name="Apply to notebook").click()
    dialog = lab.page.locator(".jp-Dialog")
    expect(dialog.locator(".ttm-diff-del")).to_contain_text(["set_detect_anomaly(True)"])
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
    expect(edits.locator(".ttm-apply-outcome")).to_contain_text("Edited In[2]")
    expect(lab.cell(1).locator(".cm-content")).not_to_contain_text("set_detect_anomaly")
    after = lab.source(1)
    assert "import torch" in after and 'print("anomaly detection on")' in after
    assert "# left on while chasing a NaN" in after
    ast.parse(after)
    lab.screenshot("anomaly-applied")

    lab.page.keyboard.press("Control+z")
    expect(lab.cell(1).locator(".cm-content")).to_contain_text("set_detect_anomaly(True)")
    assert lab.source(1) == ANOMALY_ON and lab.source(3) == CHECKED_ANOMALY


# What a front end without the labextension sees (VS Code, Colab): no button that could
# do nothing, but how to make the change instead.
NO_LABEXTENSION = "document.body.removeAttribute('data-ttm-notebook-edits')"
EDITS = """\
report["notebook_edits"] = {"fixes": ["zero-grad-none"], "cells": [{
    "execution_count": None, "before": "%%perfcheck\\nopt.zero_grad(set_to_none=False)",
    "after": "%%perfcheck\\nopt.zero_grad(set_to_none=True)",
    "diff": "-opt.zero_grad(set_to_none=False)\\n+opt.zero_grad(set_to_none=True)\\n"}]}
"""


def test_without_the_labextension_the_view_says_how_to_make_the_change(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook("no-lab.ipynb", [panel_of_report("nolab-1", edit=EDITS)])
    lab.open_notebook(notebook)
    lab.page.evaluate(NO_LABEXTENSION)
    lab.run_cell(0, f"{LIVE_PANEL} .ttm-notebook-edits")
    lab.cell(0).locator(LIVE_PANEL).get_by_role("button", name="Show code").click()
    edits = lab.cell(0).locator(f"{LIVE_PANEL} .ttm-notebook-edits")
    expect(edits).to_be_visible()
    expect(edits.get_by_role("button", name="Apply to notebook")).to_have_count(0)
    expect(edits.locator(".ttm-no-notebook-edits")).to_have_text(
        "Apply to notebook needs JupyterLab or Notebook 7 with the torchtune-magic extension; "
        "here, copy the cells below, or run %perfcheck insert in a cell."
    )
    expect(edits.locator(".ttm-no-notebook-edits code")).to_have_text("%perfcheck insert")
    expect(edits.get_by_role("button", name="Copy cell")).to_have_count(1)


# A course notebook's loader, a comment after each argument (issue 28)
COURSE_DATA = """\
import time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class SlowData(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, index):
        time.sleep(0.004)
        return torch.full((8,), float(index)), torch.ones(1)

train_data = SlowData()
BATCH_SIZE = 8
torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.001)"""
COURSE_LOADER = """\
train_dataloader = DataLoader(train_data, # dataset to turn into iterable
    batch_size=BATCH_SIZE, # how many samples per batch?
    shuffle=True # shuffle training data on every epoch?
)"""
COURSE_TRAIN = """\
%%perfcheck --budget 2 --checks dataloader-workers --apply dataloader-workers
for epoch in range(2):
    for X, y in train_dataloader:
        loss = ((model(X) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()"""
COURSE_COMMENTS = [
    "# dataset to turn into iterable",
    "# how many samples per batch?",
    "# shuffle training data on every epoch?",
]


def test_apply_to_notebook_keeps_the_comments_after_each_loader_argument(
    lab: Lab, jupyter_lab: JupyterLab
) -> None:
    notebook = jupyter_lab.write_notebook(
        "course.ipynb", ["%load_ext torchtune_magic", COURSE_DATA, COURSE_LOADER, COURSE_TRAIN]
    )
    lab.open_notebook(notebook)
    for index in range(3):
        lab.run_cell(index)
    panel = lab.run_cell(3, f"{LIVE_PANEL}[class*='ttm-run-']", timeout=120_000)
    expect(panel.locator(".ttm-progress")).to_have_count(0, timeout=120_000)

    panel.get_by_role("button", name="Show code").click()
    edits = panel.locator(".ttm-notebook-edits")
    expect(edits.locator(".ttm-code-block .ttm-code-caption span")).to_have_text(["In[3]"])
    edits.get_by_role("button", name="Apply to notebook").click()
    lab.page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click()
    expect(edits.locator(".ttm-apply-outcome")).to_have_text(
        "Edited In[3]. One notebook undo (Z or Ctrl/Cmd+Z in command mode) restores it."
    )

    after = lab.source(2)
    ast.parse(after)  # the edited cell parses
    tokens = tokenize.generate_tokens(io.StringIO(after).readline)
    assert [t.string for t in tokens if t.type == tokenize.COMMENT] == COURSE_COMMENTS
    assert "num_workers=" in after and "persistent_workers=True" in after
    assert after.splitlines()[:2] == COURSE_LOADER.splitlines()[:2]  # untouched lines

    lab.page.keyboard.press("Control+z")  # one undo restores the cell
    expect(lab.cell(2).locator(".cm-content")).not_to_contain_text("num_workers")
    assert lab.source(2) == COURSE_LOADER
