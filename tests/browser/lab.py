"""Driving JupyterLab in headless Chromium: open notebooks, run and read cells."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Locator, Page, expect

from .server import JupyterLab

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

REPORT_MIME = "application/vnd.torchtune-magic.report.v1+json"
SAVED_REPORT = ".ttm-ReportRenderer .ttm-report"  # the report MIME renderer's view
LIVE_PANEL = ".ttm-live-panel"  # the anywidget panel's view (the same view, plus controls)
# The view's text without the live panel's controls (toggles, buttons, progress, row
# messages): what must read the same in the live panel and the saved report.
VIEW_TEXT = """node => {
  const copy = node.cloneNode(true);
  copy.querySelectorAll('.ttm-live-only').forEach(n => n.remove());
  return copy.textContent.replace(/\\s+/g, ' ').trim();
}"""
# What no view of the report may show: markdown's backticks, "(s)" plurals, internal words;
# and the view's whole text, every folded part opened.
RAW_TEXT = re.compile(r"`|\(s\)|not-compared|provisional")
ALL_TEXT = (
    "v => { v.querySelectorAll('details').forEach(d => (d.open = true)); return v.textContent; }"
)
TOGGLE_COMMAND = "torchtune-magic:toggle-perfcheck"
TOGGLE_SHORTCUT = "Control+Shift+Y"
NOT_RUN_PROMPT = re.compile(r"^\[\s*\]:$")
RAN_PROMPT = re.compile(r"^\[\d+\]:$")


def retry(action: Callable[[], None], attempts: int = 3) -> None:
    """Run a UI step that waits on a selector, again if it timed out (cold starts flake)."""
    for attempt in range(attempts):
        try:
            action()
            return
        except (PlaywrightError, AssertionError):
            if attempt == attempts - 1:
                raise


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


@dataclass
class Lab:
    """One browser page on the test server."""

    page: Page
    server: JupyterLab
    name: str
    dialogs: list[str] = field(default_factory=list)

    @property
    def notebook_panel(self) -> Locator:
        """The notebook in the current tab."""
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")

    def goto_notebook(self, notebook: str) -> None:
        """Load JupyterLab with this notebook alone, in a workspace of this test's own."""
        workspace = re.sub(r"[^A-Za-z0-9-]+", "-", self.name)
        self.page.goto(f"{self.server.url}/lab/workspaces/{workspace}/tree/{notebook}")

    def open_notebook(self, notebook: str) -> None:
        """Open a notebook and wait until its kernel is idle."""
        idle = self.notebook_panel.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")

        def attempt() -> None:
            self.goto_notebook(notebook)
            self.cell(0).locator(".cm-content").wait_for(state="visible", timeout=30_000)

            def ready() -> bool:
                self.accept_kernel_dialog()
                return idle.count() > 0

            wait_until(ready, 30, "the notebook's kernel to be idle")

        retry(attempt)

    def accept_kernel_dialog(self) -> None:
        """Take the default of JupyterLab's "Select Kernel" dialog if it is up. A notebook
        with a kernelspec can still meet it, even after its kernel was idle (seen in two
        fresh-clone runs, a dozen notebooks into the browser tests); it blocks every click."""
        asks = self.page.locator(".jp-Dialog:has-text('Select Kernel') .jp-mod-accept")
        if asks.count() and asks.first.is_visible():
            asks.first.click()

    def cell(self, index: int) -> Locator:
        return self.notebook_panel.locator(".jp-Notebook .jp-Cell").nth(index)

    def focus_editor(self, index: int) -> None:
        self.cell(index).locator(".cm-content").click()

    def run_cell(self, index: int, until: str | None = None, timeout: float = 30_000) -> Locator:
        """Run a cell (Ctrl+Enter) until `until` appears in it (default: until it has run);
        return that element.

        Right after the page loads the kernel can look idle before the notebook is
        connected to it, and the run is then silently skipped: retry when the prompt
        did not change to [*] or a number.
        """
        prompt = self.cell(index).locator(".jp-InputPrompt")
        target = prompt if until is None else self.cell(index).locator(until).first

        def attempt() -> None:
            self.accept_kernel_dialog()
            self.focus_editor(index)
            self.page.keyboard.press("Control+Enter")
            expect(prompt).not_to_have_text(NOT_RUN_PROMPT, timeout=5_000)
            if until is None:
                expect(prompt).to_have_text(RAN_PROMPT, timeout=timeout)
            else:
                target.wait_for(state="attached", timeout=timeout)

        retry(attempt)
        return target

    def source(self, index: int) -> str:
        lines = self.cell(index).locator(".cm-content .cm-line").all_inner_texts()
        return "\n".join(line.replace("\u200b", "") for line in lines)

    def save(self, notebook: str) -> None:
        """Save with the keyboard and wait until the file on disk has the report output."""
        self.focus_editor(0)
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("Control+s")

        def saved() -> bool:
            nb = self.server.read_notebook(notebook)
            return any(
                REPORT_MIME in output.get("data", {})
                for cell in nb.cells
                for output in cell.get("outputs", [])
            )

        wait_until(saved, 20, f"{notebook} to be saved with its outputs")

    def command(self, command: str, args: dict | None = None, *, wait: bool = True) -> None:
        """Run a JupyterLab command as its menu item would. `wait=False` for a command
        that opens a dialog: its promise settles only once the dialog is answered."""
        script = (
            "([id, args]) => window.jupyterapp.commands.execute(id, args)"
            if wait
            else "([id, args]) => { window.jupyterapp.commands.execute(id, args); }"
        )
        self.page.evaluate(script, [command, args or {}])

    def screenshot(self, step: str, of: Locator | None = None) -> Path:
        """Keep a picture of the page (or of one element, scrolled into view) as an artifact."""
        ARTIFACTS.mkdir(exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.name}-{step}")
        path = ARTIFACTS / f"{safe}.png"
        if of is None:
            self.page.screenshot(path=str(path), full_page=True)
        else:
            of.screenshot(path=str(path))
        return path
