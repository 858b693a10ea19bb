"""The MIME bundle a notebook saves: the report JSON plus HTML and text fallbacks.

A view that fails to render (a bug of ours, never the cell's) does not take the others down:
the text view stands in for the HTML one, and either says which view failed and why."""

from __future__ import annotations

from html import escape
from typing import Any

from ..report import MIME_TYPE, OwnFailure, Report
from . import html, summary, text


def render(report: Report) -> dict[str, Any]:
    try:
        plain = text.render(report)
    except Exception as error:
        failed = OwnFailure.of("rendering the text view", error)
        plain = f"%%perfcheck report ({summary.own_failure_line(failed)})"
    try:
        page = html.render(report)
    except Exception as error:
        failed = OwnFailure.of("rendering the HTML view", error)
        page = (
            f"<p>{escape(summary.own_failure_line(failed))}</p>"
            f"<details><summary>traceback</summary><pre>{escape(failed.traceback)}</pre>"
            f"</details><pre>{escape(plain)}</pre>"
        )
    return {MIME_TYPE: report.to_dict(), "text/html": page, "text/plain": plain}
