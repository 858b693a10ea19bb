"""The MIME bundle a notebook saves: the report JSON plus HTML and text fallbacks."""

from __future__ import annotations

from typing import Any

from ..report import MIME_TYPE, Report
from . import html, text


def render(report: Report) -> dict[str, Any]:
    return {
        MIME_TYPE: report.to_dict(),
        "text/html": html.render(report),
        "text/plain": text.render(report),
    }
