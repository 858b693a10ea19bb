"""%%perfcheck in a real IPython shell: options, output, errors, list/revert, unload."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import torch
from workloads import LOAD_DEPENDENT, TRAIN_SETUP

from torchtune_magic import magic
from torchtune_magic.report import Report, load_schema

TRAIN = f"""%%perfcheck -o --budget 3 --skip {LOAD_DEPENDENT} {{extra}}
with torch.autograd.detect_anomaly():
    for step in range(5):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
"""

INFERENCE = f"""%%perfcheck -o --budget 1 --skip {LOAD_DEPENDENT}
preds = []
for i in range(0, 128, 32):
    preds.append(model(X[i:i + 32]))
"""


def test_training_cell_findings_with_evidence_and_json(ip, tmp_path: Path, capsys):
    ip.run_cell(TRAIN_SETUP)
    path = tmp_path / "r.json"
    result = ip.run_cell(TRAIN.format(extra=f"--json {path}"))
    assert result.error_in_exec is None
    report = result.result
    assert isinstance(report, Report)
    by_id = {f.id: f for f in report.findings}
    assert set(by_id) == {"debug-anomaly", "zero-grad-none"}  # no no-grad on a training cell
    anomaly = by_id["debug-anomaly"]
    assert "5 of 5 backward passes" in anomaly.evidence
    assert anomaly.line == 2 and anomaly.where == "cell line 2"  # the editor's numbering
    assert "-with torch.autograd.detect_anomaly():" in anomaly.code_change.diff
    zero = by_id["zero-grad-none"]
    assert "before 4 of 5 backward passes" in zero.evidence
    assert zero.where == "opt, cell line 4"
    jsonschema.validate(json.loads(path.read_text()), load_schema())
    shown = capsys.readouterr().out
    assert "[debug-anomaly]" in shown and "baseline" in shown  # the static report was displayed
    assert not torch.is_anomaly_enabled()


def test_inference_cell_gets_no_grad_and_trained_one_not(ip):
    ip.run_cell(TRAIN_SETUP)
    report = ip.run_cell(INFERENCE).result
    assert [f.id for f in report.findings] == ["no-grad"]
    finding = report.findings[0]
    assert finding.where == "model, cell line 4"
    assert "+with torch.no_grad():" in finding.code_change.diff
    variant = report.variant_for(["no-grad"])
    assert variant.numerics.verdict == "identical"
    assert len(ip.user_ns["preds"]) == 4  # names the cell binds are as after one run


def test_plain_zero_grad_and_inference_mode_decorator_are_not_flagged(ip):
    ip.run_cell(TRAIN_SETUP)
    ip.run_cell("@torch.inference_mode()\ndef evaluate(batch):\n    return model(batch)\n")
    # the process-wide checks (torch's threads, glibc's heap) read the machine, not this
    # code: on a busy machine cpu-threads rightly speaks
    report = ip.run_cell(
        "%%perfcheck -o --budget 1 --skip cpu-threads,cpu-allocator\n"
        "for step in range(4):\n"
        "    opt.zero_grad()\n"
        "    torch.nn.functional.mse_loss(model(X), Y).backward()\n"
        "    opt.step()\n"
        "scores = evaluate(X)\n"
    ).result
    assert report.findings == []


def test_anomaly_scoped_around_backward_only_is_found(ip):
    ip.run_cell(TRAIN_SETUP)
    report = ip.run_cell(
        "%%perfcheck -o --budget 1 --checks debug-anomaly\n"
        "for step in range(4):\n"
        "    loss = torch.nn.functional.mse_loss(model(X), Y)\n"
        "    with torch.autograd.set_detect_anomaly(True):\n"
        "        loss.backward()\n"
    ).result
    (finding,) = report.findings
    assert "4 of 4 backward passes" in finding.evidence
    assert finding.details.startswith("0 of")  # forward ran with it off: the details say so
    assert report.variant_for(["debug-anomaly"]).error is None


def test_cell_error_shows_normal_traceback_and_nothing_applied(ip, capsys):
    ip.run_cell(TRAIN_SETUP)
    result = ip.run_cell(
        "%%perfcheck --apply all\n"
        "opt.zero_grad(set_to_none=False)\n"
        "loss = model(X).sum()\n"
        "raise ValueError('bad batch')\n"
    )
    assert isinstance(result.error_in_exec, ValueError)
    out = capsys.readouterr().out
    assert "ValueError" in out and "bad batch" in out
    assert "raise ValueError('bad batch')" in out  # the cell's own line is in the traceback
    assert "session.py" not in out and "probe.py" not in out
    assert "zero_grad" not in vars(ip.user_ns["opt"])


def test_usage_errors_are_clear_and_run_nothing(ip, capsys):
    ip.run_cell("ran = 0")
    ip.run_cell("%%perfcheck --checks nope\nran += 1")
    ip.run_cell("%%perfcheck --budget -3\nran += 1")
    ip.run_cell("%%perfcheck --budget abc\nran += 1")
    out = capsys.readouterr()
    text = out.out + out.err
    assert "1 unknown check id: nope" in text
    assert "--budget must be a positive number" in text
    assert "%%perfcheck: argument --budget: invalid float value: 'abc'" in text
    assert ip.user_ns["ran"] == 0


def test_list_revert_apply_and_unload(ip, capsys):
    ip.run_line_magic("perfcheck", "list")
    listing = capsys.readouterr().out
    for check_id in ("debug-anomaly", "debug-profiler", "debug-gradcheck", "no-grad"):
        assert check_id in listing
    ip.run_cell(TRAIN_SETUP)
    opt = ip.user_ns["opt"]
    report = ip.run_cell(TRAIN.format(extra="--apply zero-grad-none -q")).result
    assert report.applied == ["zero-grad-none"]
    assert "zero_grad" in vars(opt)
    ip.run_line_magic("perfcheck", "revert")
    assert "reverted: zero-grad-none" in capsys.readouterr().out
    assert "zero_grad" not in vars(opt)
    assert ip.user_ns["opt"] is opt

    ip.run_line_magic("unload_ext", "torchtune_magic")
    try:
        assert "perfcheck" not in ip.magics_manager.magics["cell"]
        assert "perfcheck" not in ip.magics_manager.magics["line"]
    finally:
        ip.run_line_magic("load_ext", "torchtune_magic")
    assert "perfcheck" in ip.magics_manager.magics["cell"]


def test_help_lists_every_option(ip, capsys):
    ip.run_cell("%%perfcheck?")
    shown = capsys.readouterr().out
    assert "\n%%perfcheck [--checks IDS] [--skip IDS] [--budget SECONDS]" in shown
    assert "::" not in shown and "\n  %perfcheck [" not in shown
    doc = ip.magics_manager.magics["cell"]["perfcheck"].__doc__
    for option in (
        "--checks",
        "--skip",
        "--budget",
        "--quick",
        "--apply",
        "--json",
        "-o",
        "-q",
        "--no-widget",
        "--no-restore",
        "--device",
    ):
        assert option in doc, option


def test_insert_puts_the_optimized_cell_below(ip):
    ip.run_cell(TRAIN_SETUP)
    ip.run_cell(TRAIN.format(extra="-q"))
    ip.rl_next_input = None
    ip.run_line_magic("perfcheck", "insert")
    inserted = ip.rl_next_input
    recommended = magic._latest.recommended()
    assert "debug-anomaly" in recommended  # anomaly mode off: a clear win, results the same
    assert "detect_anomaly" not in inserted  # the recommended fixes' changes, none toggled on
    carried = "opt.zero_grad(set_to_none=True)" in inserted
    assert carried == ("zero-grad-none" in recommended)  # carried only when recommended
    compile(inserted, "inserted", "exec")
