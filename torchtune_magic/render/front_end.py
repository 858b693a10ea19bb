"""Where the live panel's built front end lives, and whether this install has it.

The panel's ES module and styles (`torchtune_magic/static/`) are build outputs of the
labextension's `jlpm build`, shipped inside the wheel. A source checkout that was never
built (a git clone on PYTHONPATH) lacks them, and anywidget reads both files when the
panel's widget class is defined: so whether the panel can be shown is decided here,
without importing the widget module (or anywidget) at all.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
STATIC = PACKAGE / "static"
ES_MODULE = STATIC / "widget.js"
STYLES = STATIC / "widget.css"


def missing_front_end() -> str | None:
    """Why the panel's front end cannot be served (a source checkout not built), in words
    that say how to get it; None when it is there."""
    missing = next((path for path in (ES_MODULE, STYLES) if not path.is_file()), None)
    if missing is None:
        return None
    return (
        f"the panel's front end ({missing.relative_to(PACKAGE.parent)}) is not built: "
        "run `pip install -e .` in the checkout, or `jlpm build` in labextension/"
    )
