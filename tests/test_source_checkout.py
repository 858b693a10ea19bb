"""A source checkout that was never built (no `torchtune_magic/static/`, as a git clone on
PYTHONPATH has it) still runs `%%perfcheck`: the static report is shown, and in a notebook
kernel one line says the live panel needs the built front end and how to build it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel
from kernel_messages import collect_until_idle

from torchtune_magic.report import MIME_TYPE

PACKAGE = Path(__file__).resolve().parents[1] / "torchtune_magic"
CELL = "%%perfcheck --budget 0.3 --checks no-grad\nout = net(x)\n"
SETUP = "import torch\nnet = torch.nn.Linear(4, 2)\nx = torch.randn(3, 4)\n"
EXPLANATION = (
    "%%perfcheck: no live panel (the panel's front end (torchtune_magic/static/widget.js) is "
    "not built: run `pip install -e .` in the checkout, or `jlpm build` in labextension/); "
    "showing the static report"
)


@pytest.fixture
def unbuilt_checkout(tmp_path: Path) -> Path:
    """The package's sources alone, without the front end's build outputs."""
    checkout = tmp_path / "checkout"
    shutil.copytree(
        PACKAGE,
        checkout / "torchtune_magic",
        ignore=shutil.ignore_patterns("static", "labextension", "__pycache__"),
    )
    assert not (checkout / "torchtune_magic" / "static").exists()
    return checkout


def _env(checkout: Path, tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }


def test_a_notebook_kernel_shows_the_static_report_and_says_how_to_get_the_panel(
    unbuilt_checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in _env(unbuilt_checkout, tmp_path).items():
        monkeypatch.setenv(key, value)
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        loaded: list[str] = []
        setup = client.execute_interactive(
            "%load_ext torchtune_magic\nimport torchtune_magic\nprint(torchtune_magic.__file__)\n"
            + SETUP,
            timeout=120,
            output_hook=lambda m: loaded.append(m["content"].get("text", "")),
        )
        assert setup["content"]["status"] == "ok"
        assert "".join(loaded).strip() == str(unbuilt_checkout / "torchtune_magic" / "__init__.py")
        msg_id = client.execute(CELL)
        messages = collect_until_idle(client, msg_id)
        reply = client.get_shell_msg(timeout=60)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "ok", reply["content"]
    printed = "".join(
        m["content"]["text"]
        for m in messages
        if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
    )
    assert [line for line in printed.splitlines() if "live panel" in line] == [EXPLANATION]
    shown = _shown(messages)
    assert shown, "no report was displayed"
    last = shown[-1]
    assert "application/vnd.jupyter.widget-view+json" not in last
    assert last[MIME_TYPE]["findings"][0]["id"] == "no-grad"
    assert "no-grad" in last["text/html"] and "[no-grad]" in last["text/plain"]


def _shown(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The data of every display and display update the kernel sent, in order."""
    return [
        m["content"]["data"]
        for m in messages
        if m["msg_type"] in ("display_data", "update_display_data")
    ]


def test_terminal_ipython_prints_the_text_report_and_exits_cleanly(
    unbuilt_checkout: Path, tmp_path: Path
) -> None:
    script = (
        "from IPython.testing.globalipapp import start_ipython\n"
        "shell = start_ipython()\n"
        "shell.run_line_magic('load_ext', 'torchtune_magic')\n"
        "import torchtune_magic\n"
        "print('package:', torchtune_magic.__file__)\n"
        f"assert shell.run_cell({SETUP!r}).success\n"
        f"result = shell.run_cell({CELL!r})\n"
        "raise SystemExit(0 if result.success else 1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(unbuilt_checkout, tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"package: {unbuilt_checkout / 'torchtune_magic' / '__init__.py'}" in done.stdout
    assert "[no-grad]" in done.stdout and "baseline" in done.stdout  # the text report
    assert "FileNotFoundError" not in done.stderr
