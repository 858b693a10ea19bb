"""torchtune-magic: `%%perfcheck` finds, applies and measures PyTorch tuning-guide fixes.

The engine (`perfcheck`, `Report`) imports neither IPython nor ipywidgets; the magic and
the widget panel load them only when used.
"""

from __future__ import annotations

from typing import Any

from .api import perfcheck
from .report import MIME_TYPE, SCHEMA_ID, Report

__version__ = "0.1.0"
__all__ = ["MIME_TYPE", "SCHEMA_ID", "Report", "__version__", "perfcheck"]


def load_ipython_extension(shell: Any) -> None:
    from .magic import register

    register(shell)


def unload_ipython_extension(shell: Any) -> None:
    from .magic import unregister

    unregister(shell)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "torchtune-magic"}]
