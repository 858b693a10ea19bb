"""Talking to a real Jupyter kernel from tests: iopub messages in the order they came."""

from __future__ import annotations

import time
from typing import Any

from jupyter_client import KernelClient


def collect_until_idle(
    client: KernelClient, parent_id: str, timeout: float = 120
) -> list[dict[str, Any]]:
    """Every iopub message until the kernel is idle after handling `parent_id`, each with
    `received` (monotonic seconds) added, so tests can tell what was on screen when."""
    messages = []
    while True:
        message = client.get_iopub_msg(timeout=timeout)
        message["received"] = time.monotonic()
        messages.append(message)
        if (
            message["msg_type"] == "status"
            and message["content"]["execution_state"] == "idle"
            and message["parent_header"].get("msg_id") == parent_id
        ):
            return messages
