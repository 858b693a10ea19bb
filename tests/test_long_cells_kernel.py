"""A multi-epoch cell under %%perfcheck in a real kernel: what the front end receives, in
the order it receives it — findings before any number, numbers as they are measured, the
cell's complete run last."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel
from kernel_messages import collect_until_idle
from test_long_cells import LONG_CELL, LONG_SETUP, STEPS

from torchtune_magic.report import MIME_TYPE

TESTS = Path(__file__).resolve().parent
# the probe stops after half a second here (users get 3-8 s): a 2 s cell counts as long
SHORT_PROBE = "import torchtune_magic.session\ntorchtune_magic.session.PROBE_SECONDS = (0.5, 0.5)\n"
PRINTING_CELL = LONG_CELL.replace(
    "    sched.step()\n", "    sched.step()\n    print(f'epoch {epoch} done')\n"
)


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    path = os.pathsep.join(
        p for p in (str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH")) if p
    )
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        client.execute_interactive("%load_ext torchtune_magic\n" + SHORT_PROBE, timeout=120)
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _reports(messages: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, report) for every report output or update, in arrival order."""
    return [
        (m["received"], m["content"]["data"][MIME_TYPE])
        for m in messages
        if m["msg_type"] in ("display_data", "update_display_data")
        and MIME_TYPE in m["content"].get("data", {})
    ]


def _has_numbers(report: dict[str, Any]) -> bool:
    return any(v.get("speedup") for v in report["variants"])


@pytest.mark.parametrize("flags", ["", "--no-widget"], ids=["panel", "static"])
def test_findings_are_on_screen_before_any_number_then_numbers_then_the_complete_run(
    kernel: Any, flags: str
) -> None:
    kernel.execute_interactive(LONG_SETUP, timeout=120)
    cell_id = kernel.execute(f"%%perfcheck --budget 8 {flags}\n{PRINTING_CELL}")
    messages = collect_until_idle(kernel, cell_id)
    assert not [m for m in messages if m["msg_type"] == "error"]

    reports = _reports(messages)
    first_at, first = reports[0]
    assert first["phase"] == "measuring" and not _has_numbers(first)
    assert {f["id"] for f in first["findings"]} >= {"debug-anomaly", "dataloader-workers"}
    numbered = [(at, r) for at, r in reports if _has_numbers(r)]
    assert numbered, "numbers arrive"
    measuring = [at for at, r in numbered if r.get("phase") == "measuring"]
    assert measuring, "numbers are shown while the rest is still being measured"
    done_at, done = reports[-1]
    assert "phase" not in done and done["cell_run"]["status"] == "complete"
    assert done["cell_run"]["steps"] == STEPS and done["sampling"]["unit"] == "batch"
    # the findings were on screen well before the report was done
    assert first_at < measuring[0] < done_at and done_at - first_at > 1.0
    # what the cell prints shows once, from its complete run (not the stopped probe's part)
    printed = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert [line for line in printed.splitlines() if line.endswith(" done")] == [
        f"epoch {epoch} done" for epoch in range(6)
    ]
