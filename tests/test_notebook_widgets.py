"""A real kernel run by nbclient: the saved notebook keeps both the panel and the report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client import KernelClient
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient

from torchtune_magic.report import MIME_TYPE

REPO = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

SETUP = """\
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
X, Y = torch.randn(64, 16), torch.randn(64, 1)
"""

PERFCHECK = """\
%%perfcheck --budget 2
torch.autograd.set_detect_anomaly(True)
for step in range(3):
    opt.zero_grad(set_to_none=False)
    loss = ((model(X) - Y) ** 2).mean()
    loss.backward()
    opt.step()
"""


@pytest.fixture
def kernel_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kernel inherits these: the package importable, compile caches kept in tmp."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


def test_perfcheck_cell_saves_panel_view_and_report(kernel_env: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext torchtune_magic"),
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell(PERFCHECK),
    ]
    client = NotebookClient(
        nb,
        kernel_name="python3",
        store_widget_state=True,
        timeout=300,
        resources={"metadata": {"path": str(kernel_env)}},
    )
    client.execute()

    outputs = nb.cells[2].outputs
    assert not [o for o in outputs if o.output_type == "error"]
    views = [o for o in outputs if WIDGET_VIEW in o.get("data", {})]
    reports = [o for o in outputs if MIME_TYPE in o.get("data", {})]
    assert len(views) == 1 and len(reports) == 1
    # the report right below the panel it stands in for once widgets are gone (a reopened
    # notebook), above anything the cell printed: the order a reader saw live
    assert outputs.index(reports[0]) == outputs.index(views[0]) + 1
    report = reports[0].data[MIME_TYPE]
    assert {"text/html", "text/plain"} <= set(reports[0].data)
    assert {f["id"] for f in report["findings"]} >= {"debug-anomaly", "zero-grad-none"}
    assert report["variants"] and report["baseline"]["median_s"] > 0

    # The stored widget state holds the panel (an anywidget with the view's ES module),
    # marked for the labextension, its last state that of the finished run.
    state = nb.metadata.widgets[WIDGET_STATE]["state"]
    panel = state[views[0].data[WIDGET_VIEW]["model_id"]]["state"]
    assert {"ttm-live-panel", f"ttm-run-{report['run_id']}"} <= set(panel["_dom_classes"])
    assert panel["run_id"] == report["run_id"] and panel["attached"] and not panel["busy"]
    assert panel["report"] == report
    assert "export" in panel["_esm"] and ".ttm-report" in panel["_css"]


def _collect_until_idle(client: KernelClient, parent_id: str) -> list[dict[str, Any]]:
    """Every iopub message until the kernel is idle after handling `parent_id`."""
    messages = []
    while True:
        message = client.get_iopub_msg(timeout=120)
        messages.append(message)
        if (
            message["msg_type"] == "status"
            and message["content"]["execution_state"] == "idle"
            and message["parent_header"].get("msg_id") == parent_id
        ):
            return messages


def test_retime_click_updates_the_report_as_an_output_of_the_perfcheck_cell(
    kernel_env: Path,
) -> None:
    """A click is a comm message; the report update must still go to the %%perfcheck cell
    (JupyterLab routes an update only to the cell whose request is its parent)."""
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(kernel_env))
    try:
        client.execute_interactive("%load_ext torchtune_magic\n" + SETUP, timeout=120)
        cell_id = client.execute(PERFCHECK)
        shown = _collect_until_idle(client, cell_id)
        opened = [m for m in shown if m["msg_type"] == "comm_open"]
        panel = next(
            m["content"]["comm_id"]
            for m in opened
            if "ttm-live-panel" in m["content"]["data"]["state"].get("_dom_classes", [])
        )
        # the report fills the place held for it right below the panel
        report = next(
            m["content"]["data"][MIME_TYPE]
            for m in shown
            if m["msg_type"] == "update_display_data" and MIME_TYPE in m["content"]["data"]
        )

        # what the view's Re-time button sends (anywidget's model.send)
        click = client.session.msg(
            "comm_msg",
            {"comm_id": panel, "data": {"method": "custom", "content": {"command": "retime"}}},
        )
        client.shell_channel.send(click)
        during = _collect_until_idle(client, click["header"]["msg_id"])
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)

    updates = [m for m in during if m["msg_type"] == "update_display_data"]
    assert updates, "the re-time updates the saved report"
    for update in updates:  # numbers stream in; every update goes to the %%perfcheck cell
        assert update["content"]["transient"] == {"display_id": f"ttm-report-{report['run_id']}"}
        assert update["parent_header"]["msg_id"] == cell_id
        assert update["content"]["data"][MIME_TYPE]["run_id"] == report["run_id"]
    assert not [m for m in during if m["msg_type"] == "error"]
    notices = [
        m["content"]["data"]["state"]["notice"]
        for m in during
        if m["msg_type"] == "comm_msg" and "notice" in m["content"]["data"].get("state", {})
    ]
    assert not any(notices)  # nothing went wrong in the command (errors land in the panel)
    synced = [
        m["content"]["data"]["state"]
        for m in during
        if m["msg_type"] == "comm_msg" and "busy" in m["content"]["data"].get("state", {})
    ]
    assert [s["busy"] for s in synced][:1] == [True] and synced[-1]["busy"] is False
