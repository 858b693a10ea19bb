"""The README stays true: its check table is the registry's, its option table the magic's."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from torchtune_magic.magic import PerfcheckMagics

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _check_table():
    spec = importlib.util.spec_from_file_location("check_table", REPO / "docs" / "check_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_table_is_generated_from_the_registry() -> None:
    module = _check_table()
    assert module.with_table(README) == README, "run: python docs/check_table.py --write"


def test_every_magic_option_is_documented() -> None:
    options = [
        option
        for action in PerfcheckMagics.perfcheck.parser._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    ]
    documented = set(re.findall(r"^\| `(-[-\w]+)", README, flags=re.MULTILINE))
    assert set(options) == documented


def test_the_two_commands_and_the_binder_badge() -> None:
    assert "scripts/demo.sh" in README and "scripts/test.sh" in README
    assert "labpath=notebooks/01_quickstart.ipynb" in README
    assert (REPO / "docs" / "panel.png").is_file() and "(docs/panel.png)" in README


def test_limitations_fit_a_glance_and_link_the_internals() -> None:
    """A user scanning "will this work on my notebook?" reads the limits in one screen; the
    measurement internals behind them live in docs/ and the README links that page."""
    section = README.split("## Limitations\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.strip()]
    assert len(lines) <= 15, f"{len(lines)} lines"
    links = re.findall(r"\]\((docs/[\w./-]+\.md)\)", section)
    assert links and all((REPO / link).is_file() for link in links)
    internals = (REPO / "docs" / "limitations.md").read_text()
    assert "greenlet" in internals and "greenlet" not in section
