"""Apply to notebook: from the live panel, after a dialog showing the diffs, the earlier
cell that built the model and the %%perfcheck cell are edited as one notebook change, and
one undo (Ctrl+Z in command mode) restores both; a cell changed since it ran is refused."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from .lab import LIVE_PANEL, Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser

MODEL = """\
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 8 * 8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(16, 3, 8, 8), torch.randn(16, 1)"""
CHECKED = """\
%%perfcheck --budget 1 --checks conv-bias-bn,zero-grad-none
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
