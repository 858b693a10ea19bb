"""Every kind of code edit perfcheck makes, over call shapes taken from real notebooks and
scripts: the result parses, keeps every comment (but those on a removed statement's own
line), and changes only what the fix names."""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize

import pytest

from torchtune_magic.cell import codeedit
from torchtune_magic.checks import autocast_edit
from torchtune_magic.checks.loader.edits import POSITIONAL, non_blocking_edit

WORKERS = {"num_workers": "2", "persistent_workers": "True"}
COURSE = """\
train_dataloader = DataLoader(train_data, # dataset to turn into iterable
    batch_size=BATCH_SIZE, # how many samples per batch?
    shuffle=True # shuffle training data on every epoch?
)
"""
# (cell, what with_keywords(WORKERS) must give)
LOADER_SHAPES = {
    "comments after each argument": (
        COURSE,
        """\
train_dataloader = DataLoader(train_data, # dataset to turn into iterable
    batch_size=BATCH_SIZE, # how many samples per batch?
    shuffle=True, # shuffle training data on every epoch?
    num_workers=2,
    persistent_workers=True
)
""",
    ),
    "one per line, trailing comma": (
        "loader = DataLoader(\n    ds,\n    batch_size=32,  # fits\n)\n",
        "loader = DataLoader(\n    ds,\n    batch_size=32,  # fits\n    num_workers=2,\n"
        "    persistent_workers=True,\n)\n",
    ),
    "inline trailing comma": (
        "loader = DataLoader(ds, batch_size=32,)\n",
        "loader = DataLoader(ds, batch_size=32, num_workers=2, persistent_workers=True,)\n",
    ),
    "keyword only, **kwargs": (
        "loader = DataLoader(ds, **loader_kwargs)\n",
        "loader = DataLoader(ds, **loader_kwargs, num_workers=2, persistent_workers=True)\n",
    ),
    "backslash continuation": (
        "loader = \\\n    DataLoader(ds, batch_size=8)  # the loader\n",
        "loader = \\\n    DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)"
        "  # the loader\n",
    ),
    "nested call": (
        "loader = DataLoader(Subset(ds, idx), batch_size=32)\n",
        "loader = DataLoader(Subset(ds, idx), batch_size=32, num_workers=2, "
        "persistent_workers=True)\n",
    ),
    "with header": (
        "with closing(DataLoader(ds)) as loader:  # closes\n    run(loader)\n",
        "with closing(DataLoader(ds, num_workers=2, persistent_workers=True)) as loader:"
        "  # closes\n    run(loader)\n",
    ),
    "comprehension header": (
        "batches = [b for b in DataLoader(ds)]  # all\n",
        "batches = [b for b in DataLoader(ds, num_workers=2, persistent_workers=True)]  # all\n",
    ),
    "non-ASCII before the call": (
        'x = "é"; loader = DataLoader(ds)\n',
        'x = "é"; loader = DataLoader(ds, num_workers=2, persistent_workers=True)\n',
    ),
    "tabs": (
        "if True:\n\tloader = DataLoader(\n\t\tds,\n\t\tbatch_size=8,\n\t)\n",
        "if True:\n\tloader = DataLoader(\n\t\tds,\n\t\tbatch_size=8,\n\t\tnum_workers=2,\n"
        "\t\tpersistent_workers=True,\n\t)\n",
    ),
    "replaces a keyword": (
        "loader = DataLoader(ds, num_workers=0,  # none\n    shuffle=True)\n",
        "loader = DataLoader(ds, num_workers=2,  # none\n    shuffle=True, "
        "persistent_workers=True)\n",
    ),
    "replaces a positional argument": (
        "loader = DataLoader(ds, 8, True, None, None, 0)  # positional\n",
        "loader = DataLoader(ds, 8, True, None, None, 2, persistent_workers=True)  # positional\n",
    ),
}


def comments(source: str) -> list[str]:
    """The comment tokens of `source`, in order."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.string for t in tokens if t.type == tokenize.COMMENT]


def loader_line(source: str) -> int:
    calls = codeedit.calls_named(ast.parse(source), {"DataLoader"})
    return min(call.lineno for call in calls)


@pytest.mark.parametrize("shape", list(LOADER_SHAPES))
def test_loader_keywords_over_real_call_shapes(shape: str) -> None:
    source, expected = LOADER_SHAPES[shape]
    out = codeedit.with_keywords(source, loader_line(source), {"DataLoader"}, WORKERS, POSITIONAL)
    assert out == expected
    ast.parse(out)
    assert comments(out) == comments(source)
    # the only change is the call's arguments: the same tree with them set
    (call,) = codeedit.calls_named(ast.parse(out), {"DataLoader"})
    given = {k.arg: ast.unparse(k.value) for k in call.keywords}
    if len(call.args) > POSITIONAL["num_workers"]:
        given["num_workers"] = ast.unparse(call.args[POSITIONAL["num_workers"]])
    assert {k: given[k] for k in WORKERS} == WORKERS


def test_the_course_loader_edit_parses_and_diffs_only_its_arguments() -> None:
    out = codeedit.with_keywords(COURSE, 1, {"DataLoader"}, WORKERS, POSITIONAL)
    diff = codeedit.unified_diff(COURSE, out).splitlines()
    changed = [line for line in diff[2:] if line[:1] in "+-"]
    assert changed == [
        "-    shuffle=True # shuffle training data on every epoch?",
        "+    shuffle=True, # shuffle training data on every epoch?",
        "+    num_workers=2,",
        "+    persistent_workers=True",
    ]


def test_a_call_the_edit_cannot_read_says_why() -> None:
    source = "loader = DataLoader(*args)\n"
    with pytest.raises(codeedit.EditError, match=r"\*args"):
        codeedit.with_keywords(source, 1, {"DataLoader"}, WORKERS, POSITIONAL)
    with pytest.raises(codeedit.EditError, match="does not parse"):
        codeedit.with_keywords("f(x)\n", 1, {"f"}, {"k": "1 +"})
    # no such call: the text as it is
    assert codeedit.with_keywords("f(x)\n", 1, {"g"}, {"k": "1"}) == "f(x)\n"


def test_non_blocking_copies_in_a_multi_line_loop_edit_the_last_line_first() -> None:
    source = "for x, y in loader:\n    x = x.to(\n        device,\n    )\n    y = y.to(device)\n"
    out = non_blocking_edit(source, {2, 5})
    assert out == (
        "for x, y in loader:\n    x = x.to(\n        device,\n        non_blocking=True,\n    )\n"
        "    y = y.to(device, non_blocking=True)\n"
    )


def test_replace_nodes_keeps_parentheses_and_comments() -> None:
    source = "opt.zero_grad(set_to_none=(False))  # reset\nfor p in ps: p.grad.zero_()  # z\n"
    tree = ast.parse(source)
    call = tree.body[0].value
    loop_body = tree.body[1].body[0]
    out = codeedit.replace_nodes(
        source, [(call.keywords[0].value, "True"), (loop_body, "p.grad = None")]
    )
    assert out == "opt.zero_grad(set_to_none=(True))  # reset\nfor p in ps: p.grad = None  # z\n"
    assert comments(out) == comments(source)


def test_replace_node_of_a_lambda_across_lines() -> None:
    source = "evaluate = (lambda m:  # eval\n    m(x))\n"
    node = ast.parse(source).body[0].value
    out = codeedit.replace_node(
        source, node, f"torch.no_grad()({ast.get_source_segment(source, node)})"
    )
    assert ast.parse(out) and comments(out) == comments(source)


def test_remove_statement_keeps_the_comments_above_it() -> None:
    source = textwrap.dedent(
        """\
        for x in data:
            # debugging
            torch.autograd.set_detect_anomaly(True)  # slow
        # then
        step()
        a = 1; torch.autograd.set_detect_anomaly(True); b = 2
        """
    )
    tree = ast.parse(source)
    out = codeedit.remove_statement(source, tree, tree.body[3])
    out = codeedit.remove_statement(out, ast.parse(out), tree.body[0].body[0])
    assert out == "for x in data:\n    # debugging\n    pass\n# then\nstep()\na = 1; b = 2\n"
    assert set(comments(source)) - set(comments(out)) == {"# slow"}


def test_unwrap_with_keeps_its_header_comment_and_reindents() -> None:
    source = textwrap.dedent(
        """\
        # check
        with torch.autograd.detect_anomaly():  # find the NaN
            for x in data:
                loss = f(
                    x,  # input
                )
                # tail
        done()
        """
    )
    out = codeedit.unwrap_with(source, ast.parse(source).body[0])
    assert out == textwrap.dedent(
        """\
        # check
        # find the NaN
        for x in data:
            loss = f(
                x,  # input
            )
            # tail
        done()
        """
    )
    assert comments(out) == comments(source)


def test_wrap_lines_wraps_whole_statements_and_refuses_half_ones() -> None:
    source = "model.eval()\n# score\nfor x in data:  # all\n\tscore(x)\nprint(1)\n"
    out = codeedit.wrap_lines(source, 3, 4, "with torch.no_grad()")
    assert out == (
        "model.eval()\n# score\nwith torch.no_grad():\n\tfor x in data:  # all\n\t\tscore(x)\n"
        "print(1)\n"
    )
    assert comments(out) == comments(source)
    with pytest.raises(codeedit.EditError, match="not whole statements"):
        codeedit.wrap_lines(source, 4, 5, "with torch.no_grad()")


def test_insert_after_imports_keeps_the_padding_on_top() -> None:
    source = "\n\n\nimport torch  # t\n\n# train\nfor x in data:\n    step(x)\n"
    out = codeedit.insert_after_imports(source, "torch.set_num_threads(4)")
    assert out == (
        "\n\n\nimport torch  # t\n\ntorch.set_num_threads(4)\n# train\nfor x in data:\n"
        "    step(x)\n"
    )
    assert comments(out) == comments(source)


def test_add_decorator_goes_under_the_others() -> None:
    source = "class E:\n    @staticmethod  # outer\n    def ev(m):\n        return m(x)\n"
    node = ast.parse(source).body[0].body[0]
    out = codeedit.add_decorator(source, node, "torch.no_grad()")
    assert out == (
        "class E:\n    @staticmethod  # outer\n    @torch.no_grad()\n    def ev(m):\n"
        "        return m(x)\n"
    )


AMP = 'with torch.autocast("cuda", dtype=torch.float16)'
TRAIN = """\
for x, y in loader:  # epoch
    opt.zero_grad()  # reset
    loss_fn(model(x),  # forward
            y).backward()  # backward
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clip
    opt.step()  # step
"""


@pytest.mark.parametrize("scaled", [False, True])
def test_autocast_edit_splits_a_commented_multi_line_backward(scaled: bool) -> None:
    tree = ast.parse(TRAIN)
    found = autocast_edit.regions(tree, {3})
    scaler = autocast_edit.Scaler("scaler", "cuda", "opt") if scaled else None
    out = autocast_edit.edit(TRAIN, tree, found, AMP, "loss", scaler)
    assert out is not None
    ast.parse(out)
    assert comments(out) == comments(TRAIN)
    backward = "scaler.scale(loss).backward()" if scaled else "loss.backward()"
    expected = [
        "for x, y in loader:  # epoch",
        "    opt.zero_grad()  # reset",
        f"    {AMP}:",
        "        loss = loss_fn(model(x),  # forward",
        "                y)",
        f"    {backward}  # backward",
        "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clip",
        "    opt.step()  # step",
    ]
    if scaled:
        expected[6:8] = [
            "    scaler.unscale_(opt)",
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clip",
            "    scaler.step(opt)  # step",
            "    scaler.update()",
        ]
        expected.insert(0, 'scaler = torch.amp.GradScaler("cuda")')
    assert out.splitlines() == expected


def test_combine_of_several_edits_parses_and_drops_what_clashes() -> None:
    source = COURSE + "model.eval()\nfor x in data:\n    score(x)  # s\n"
    loader = codeedit.with_keywords(source, 1, {"DataLoader"}, WORKERS, POSITIONAL)
    wrapped = codeedit.wrap_lines(source, 6, 7, "with torch.no_grad()")
    threads = codeedit.insert_after_imports(source, "torch.set_num_threads(2)")
    out = codeedit.combine(source, [loader, wrapped, threads])
    ast.parse(out)
    assert comments(out) == comments(source)
    assert "persistent_workers=True\n)" in out and "with torch.no_grad():" in out
    assert out.startswith("torch.set_num_threads(2)\n")
    # a version that would merge into text Python cannot read is dropped
    broken = source.replace("model.eval()", "model.eval(")
    assert codeedit.combine(source, [loader, broken]) == loader
