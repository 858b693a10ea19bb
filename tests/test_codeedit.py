"""Cell edits keep the user's formatting and compose."""

from __future__ import annotations

import ast

from torchtune_magic.cell import codeedit

CELL = "a = 1\nwith ctx():\n    x(a)\n    y(a)\nz = 2\n"


def test_unwrap_with_dedents_the_body():
    tree = ast.parse(CELL)
    assert codeedit.unwrap_with(CELL, tree.body[1]) == "a = 1\nx(a)\ny(a)\nz = 2\n"


def test_remove_statement_keeps_blocks_valid():
    source = "for i in r:\n    f(i)\n"
    tree = ast.parse(source)
    out = codeedit.remove_statement(source, tree, tree.body[0].body[0])
    assert out == "for i in r:\n    pass\n"


def test_wrap_lines_and_unified_diff():
    out = codeedit.wrap_lines(CELL, 5, 5, "with torch.no_grad()")
    assert out.endswith("with torch.no_grad():\n    z = 2\n")
    diff = codeedit.unified_diff(CELL, out)
    assert "+with torch.no_grad():" in diff and "-z = 2" in diff


def test_replace_nodes_applies_bottom_up_on_one_line():
    source = "f(False); g(False)\n"
    tree = ast.parse(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    edits = [(call.args[0], "True") for call in calls]
    assert codeedit.replace_nodes(source, edits) == "f(True); g(True)\n"


def test_combine_applies_independent_edits_and_drops_clashes():
    first = CELL.replace("a = 1\n", "")
    second = CELL.replace("z = 2", "z = 3")
    clash = CELL.replace("a = 1", "a = 5")
    assert codeedit.combine(CELL, [first, second, clash]) == (
        "with ctx():\n    x(a)\n    y(a)\nz = 3\n"
    )


def test_combine_applies_an_edit_inside_a_block_another_edit_reindents():
    source = "with anomaly():\n    for i in r:\n        zero(False)\n        step()\n"
    tree = ast.parse(source)
    unwrapped = codeedit.unwrap_with(source, tree.body[0])
    flipped = source.replace("zero(False)", "zero(True)")
    assert codeedit.combine(source, [unwrapped, flipped]) == (
        "for i in r:\n    zero(True)\n    step()\n"
    )


def test_a_keyword_renamed_takes_the_place_of_the_old_one_or_is_appended():
    """`sampler=` in the place of `shuffle=` (a DataLoader refuses both), the call's layout
    and comments kept; appended, one argument per line, where the call has no `shuffle=`."""
    source = (
        "a = DataLoader(ds, batch_size=16, shuffle=True)  # train\n"
        "b = DataLoader(\n    ds,\n    batch_size=4,\n)\n"
    )
    new = "DistributedSampler(ds)"
    first = codeedit.with_keyword_renamed(source, 1, {"DataLoader"}, "shuffle", "sampler", new)
    assert (
        first.splitlines()[0]
        == "a = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds))  # train"
    )
    second = codeedit.with_keyword_renamed(source, 2, {"DataLoader"}, "shuffle", "sampler", new)
    assert second.endswith("    batch_size=4,\n    sampler=DistributedSampler(ds),\n)\n")
