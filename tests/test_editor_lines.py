"""Line numbers are the editor's: the `%%perfcheck` line is line 1.

Findings (`line`, "cell line N"), diffs (hunk headers), tracebacks from the cell and syntax
errors all count as the editor does, also when IPython drops blank lines after the magic
line. The Python API has no magic line: its numbers are the code's own.
"""

from __future__ import annotations

import re

from workloads import TRAIN_SETUP, namespace_with

from torchtune_magic import perfcheck

CELL = """%%perfcheck -o -q --budget 1 --checks debug-anomaly,zero-grad-none


with torch.autograd.detect_anomaly():
    for step in range(4):
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
"""


def test_findings_and_diffs_count_the_magic_line_and_the_blank_lines_after_it(ip):
    ip.run_cell(TRAIN_SETUP)
    report = ip.run_cell(CELL).result
    anomaly, zero = report.finding("debug-anomaly"), report.finding("zero-grad-none")
    assert anomaly.line == 4 and anomaly.where == "cell line 4"  # `with` is line 4 on screen
    assert zero.where == "opt, cell line 6"
    assert "@@ -4,5 +4,4 @@\n-with torch.autograd.detect_anomaly():" in anomaly.code_change.diff
    assert "@@ -5,3 +5,3 @@\n     for step in range(4):\n-        opt.zero_grad(" in (
        zero.code_change.diff
    )
    assert report.cell.startswith("with torch.autograd")  # the code as typed, no padding


def test_a_traceback_from_the_cell_points_at_the_editor_line(ip, capsys):
    ip.run_cell(TRAIN_SETUP)
    ip.run_cell("%%perfcheck\nloss = model(X).sum()\n\nraise ValueError('bad batch')\n")
    out = capsys.readouterr().out
    assert re.search(r"<perfcheck-cell-\d+>:4\b", out)
    assert re.search(r"----> 4 raise ValueError\('bad batch'\)", out)


def test_a_syntax_error_names_the_editor_line(ip, capsys):
    ip.run_cell("ran = 0")
    ip.run_cell("%%perfcheck\nran += 1\nfor\n")
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert re.search(r"<perfcheck-cell-\d+>:3\n    for\n", text) and "SyntaxError" in text
    assert ip.user_ns["ran"] == 0


def test_the_python_api_keeps_the_codes_own_numbering():
    report = perfcheck(
        "with torch.autograd.detect_anomaly():\n"
        "    for step in range(3):\n"
        "        torch.nn.functional.mse_loss(model(X), Y).backward()\n",
        namespace_with(),
        checks="debug-anomaly",
        budget=1,
    )
    (finding,) = report.findings
    assert finding.line == 1 and finding.where == "cell line 1"
    assert finding.code_change.diff.splitlines()[2].startswith("@@ -1,")
