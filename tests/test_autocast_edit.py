"""The placement of amp's autocast block from a cell's AST and the probe's forward lines
(the end-to-end cases, with a real probe, are in test_amp_placement.py)."""

from __future__ import annotations

import ast
import textwrap

from torchtune_magic.checks import autocast_edit

HEADER = 'with torch.autocast("cuda", dtype=torch.float16)'
SCALER = autocast_edit.Scaler("scaler", "cuda", "opt")


def _edited(cell: str, forward_lines: set[int], scaler: autocast_edit.Scaler | None = None):
    source = textwrap.dedent(cell)
    tree = ast.parse(source)
    found = autocast_edit.regions(tree, forward_lines)
    return autocast_edit.edit(source, tree, found, HEADER, "loss", scaler) if found else None


def test_backwards_in_both_arms_of_an_if_share_one_block() -> None:
    cell = """\
        for x, y in loader:
            loss = crit(model(x), y)
            if accumulate:
                (loss / 4).backward()
            else:
                loss.backward()
            opt.step()
        """
    assert _edited(cell, {2}) == textwrap.dedent(
        """\
        for x, y in loader:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y)
            if accumulate:
                (loss / 4).backward()
            else:
                loss.backward()
            opt.step()
        """
    )
    # where each backward has no block of its own, the scaler's calls have no clear place
    assert _edited(cell, {2}, SCALER) is None


def test_a_multi_line_loss_expression_is_split_out_of_backward() -> None:
    cell = """\
        for x, y in loader:
            opt.zero_grad()
            crit(
                model(x), y
            ).backward(retain_graph=False)
            opt.step()
        """
    assert _edited(cell, {4}, SCALER) == textwrap.dedent(
        """\
        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(
                    model(x), y
                )
            scaler.scale(loss).backward(retain_graph=False)
            scaler.step(opt)
            scaler.update()
        """
    )


def test_statements_between_the_loss_and_backward_stay_outside() -> None:
    cell = """\
        out = model(x)
        loss = crit(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        """
    assert _edited(cell, {1}, SCALER) == textwrap.dedent(
        """\
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
            loss = crit(out, y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        """
    )


def test_a_cell_whose_forward_lines_hold_no_backward_block_gets_no_region() -> None:
    cell = """\
        loss = train_step(x, y)
        print(loss)
        """
    assert _edited(cell, {1}) is None
