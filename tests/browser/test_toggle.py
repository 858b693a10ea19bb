"""The "Toggle %%perfcheck" command from the notebook toolbar, the keyboard and the context menu."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from .lab import TOGGLE_COMMAND, TOGGLE_SHORTCUT, Lab
from .server import JupyterLab

pytestmark = pytest.mark.browser


def test_toggle_adds_and_removes_the_perfcheck_line(lab: Lab, jupyter_lab: JupyterLab) -> None:
    notebook = jupyter_lab.write_notebook(
        "toggle.ipynb", ["x = 1\ny = 2", "%%perfcheck --quick --budget 5\nz = 3"]
    )
    lab.open_notebook(notebook)
    lines = lab.cell(0).locator(".cm-line")
    button = lab.notebook_panel.locator(f".jp-Toolbar [data-command='{TOGGLE_COMMAND}']")

    lab.focus_editor(0)
    button.click()
    expect(lines).to_have_text(["%%perfcheck", "x = 1", "y = 2"])
    lab.screenshot("added")

    lab.focus_editor(0)
    lab.page.keyboard.press(TOGGLE_SHORTCUT)
    expect(lines).to_have_text(["x = 1", "y = 2"])

    lab.page.keyboard.press(TOGGLE_SHORTCUT)
    expect(lines).to_have_text(["%%perfcheck", "x = 1", "y = 2"])

    # In command mode too, and the line goes with its options.
    lab.focus_editor(1)
    lab.page.keyboard.press("Escape")
    lab.page.keyboard.press(TOGGLE_SHORTCUT)
    expect(lab.cell(1).locator(".cm-line")).to_have_text(["z = 3"])

    lab.focus_editor(0)
    lab.cell(0).locator(".cm-content").click(button="right")
    item = lab.page.locator(".lm-Menu-item", has_text="Toggle %%perfcheck")
    expect(item).to_be_visible()
    item.click()
    expect(lines).to_have_text(["x = 1", "y = 2"])
