"""Fixtures for the browser tests: one `jupyter lab` server and one Chromium per session."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_core.paths import jupyter_path

from .lab import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, Lab
from .server import JupyterLab, start_jupyter_lab

DATA = Path(__file__).resolve().parents[1] / "data"
SAMPLE_REPORT = DATA / "sample_report.json"
SAMPLE_REPORT_GPU = DATA / "sample_report_gpu.json"  # with the optional utilisation fields


def _labextension_installed() -> bool:
    return any(
        (Path(folder) / "torchtune-magic" / "package.json").exists()
        for folder in jupyter_path("labextensions")
    )


@pytest.fixture(scope="session")
def jupyter_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/install_browser.sh")
    if not _labextension_installed():
        pytest.fail("the torchtune-magic labextension is not installed: run `pip install -e .`")
    ARTIFACTS.mkdir(exist_ok=True)
    with (ARTIFACTS / "jupyter-lab.log").open("wb") as log:
        server = start_jupyter_lab(tmp_path_factory.mktemp("jupyter-lab"), log)
        shutil.copy(SAMPLE_REPORT, server.root / "sample_report.json")
        shutil.copy(SAMPLE_REPORT_GPU, server.root / "sample_report_gpu.json")
        try:
            yield server
        finally:
            server.stop()


def _driver_pids() -> list[int]:
    """Playwright's driver processes (node ... run-driver) started by this test process."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"run-driver" in command:
            pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def _driver_killed_if_stuck(seconds: float) -> Iterator[None]:
    """Playwright's stop can wait forever on its driver once Chromium is gone: a full run
    once sat idle in this teardown after its last test until the driver was killed by
    hand. Past `seconds`, kill the driver; the stop then returns and the suite ends."""

    def kill() -> None:
        for pid in _driver_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(seconds, kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(scope="session")
def browser(jupyter_lab: JupyterLab) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    try:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield chromium
        finally:
            with _driver_killed_if_stuck(30), contextlib.suppress(Exception):
                chromium.close()
    finally:
        with _driver_killed_if_stuck(30), contextlib.suppress(Exception):
            playwright.stop()


@pytest.fixture
def lab(browser: Any, jupyter_lab: JupyterLab, request: pytest.FixtureRequest) -> Iterator[Lab]:
    """A fresh page; records any alert/confirm/prompt; screenshots the end state."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    current = Lab(page=page, server=jupyter_lab, name=request.node.name)

    def on_dialog(dialog: Any) -> None:
        current.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)
    try:
        yield current
    finally:
        current.screenshot("end")
        context.close()
        jupyter_lab.shutdown_kernels()


@pytest.fixture(scope="session")
def sample_report() -> dict[str, Any]:
    return json.loads(SAMPLE_REPORT.read_text())
