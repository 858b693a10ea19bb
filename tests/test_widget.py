"""The live panel driven from Python as a user would: real torch, real IPython, a real
anywidget. The view sends commands as comm messages; the tests send the same messages."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from workloads import LOAD_DEPENDENT

from torchtune_magic.cell.workload import Workload
from torchtune_magic.checks import Detection
from torchtune_magic.kernel.fixes import Fix, Patcher
from torchtune_magic.options import Options
from torchtune_magic.render.widget import Panel
from torchtune_magic.report import MIME_TYPE, Finding, Report
from torchtune_magic.session import Session

BUDGET_S = 2.0

TRAIN_CELL = textwrap.dedent(
    """
    torch.autograd.set_detect_anomaly(True)
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        opt.step()
    """
)


def _namespace() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return {
        "torch": torch,
        "model": model,
        "opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        "X": torch.randn(64, 16),
        "Y": torch.randn(64, 1),
    }


@pytest.fixture(scope="module")
def shell(ipython_shell):
    """The real IPython shell the test suite shares (one per process)."""
    return ipython_shell


def _finished(budget_s: float) -> Iterator[Session]:
    """A finished %%perfcheck run of a small MLP training loop with two findings."""
    options = Options(budget=budget_s, skip=[LOAD_DEPENDENT])
    session = Session(Workload(TRAIN_CELL, _namespace()), options)
    session.run()
    yield session
    session.revert_all()
    torch.autograd.set_detect_anomaly(False)  # the cell turned it on for the whole process


def _attached(session: Session) -> Iterator[Panel]:
    assert session.report is not None
    panel = Panel()
    panel.attach(session, session.report)
    yield panel
    panel.close()


@pytest.fixture
def session() -> Iterator[Session]:
    yield from _finished(BUDGET_S)


@pytest.fixture
def panel(session: Session) -> Iterator[Panel]:
    yield from _attached(session)


@pytest.fixture
def settled_panel() -> Iterator[Panel]:
    """A panel whose run had room for a verdict: beside a CPU-bound process the rank test
    needs seven rounds before it calls even a 3x fix, more than `BUDGET_S` buys (the
    verdict still comes as soon as the evidence allows, so a quiet run stops far sooner)."""
    for session in _finished(12.0):
        yield from _attached(session)


def send(panel: Panel, **command: Any) -> None:
    """What the view does on a click: a comm message with a custom payload (anywidget's
    `model.send`), handled as ipywidgets handles every message from the front end."""
    message = {"content": {"data": {"method": "custom", "content": command}}, "buffers": []}
    panel.widget._handle_msg(message)


def shown(panel: Panel) -> Report:
    """The report the view draws now (the synced dict, as the browser receives it)."""
    assert panel.widget.report is not None
    return Report.from_dict(panel.widget.report)


class _BrokenFix(Fix):
    """Changes a live object, then fails: as a fix that cannot apply to this model would."""

    check_id = "broken"

    def __init__(self) -> None:
        super().__init__()
        self.patch_calls = 0

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        self.patch_calls += 1
        patcher.setattr(namespace["model"], "half_done", True)
        raise RuntimeError("this model cannot be compiled here")


def test_attach_syncs_the_report_and_turns_the_controls_on(panel: Panel, session: Session) -> None:
    widget = panel.widget
    assert shown(panel).to_dict() == session.report.to_dict()
    assert {f.id for f in shown(panel).findings} == {"debug-anomaly", "zero-grad-none"}
    assert widget.attached and not widget.busy
    assert widget.run_id == session.run_id
    assert {"ttm-live-panel", f"ttm-run-{session.run_id}"} <= set(widget._dom_classes)
    # the ES module and its styles are the labextension's view, bundled by the jlpm build
    assert "render" in widget._esm and ".ttm-report" in widget._css


def test_toggles_change_the_live_objects_at_once_and_back_exactly(
    panel: Panel, session: Session
) -> None:
    ns = session.workload.namespace
    bindings = dict(ns)
    state = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    opt_state = ns["opt"].state_dict()
    assert torch.is_anomaly_enabled()  # left on by the cell, as if it ran once
    assert "zero_grad" not in vars(ns["opt"])

    send(panel, command="toggle", id="debug-anomaly", on=True)
    send(panel, command="toggle", id="zero-grad-none", on=True)
    assert not torch.is_anomaly_enabled()
    assert "zero_grad" in vars(ns["opt"])  # patched on the live optimizer
    assert session.applied_ids == ["debug-anomaly", "zero-grad-none"]
    assert shown(panel).applied == ["debug-anomaly", "zero-grad-none"]  # the view follows

    send(panel, command="toggle", id="debug-anomaly", on=False)
    send(panel, command="toggle", id="zero-grad-none", on=False)
    assert torch.is_anomaly_enabled()
    assert "zero_grad" not in vars(ns["opt"])
    assert session.applied_ids == [] and shown(panel).applied == []
    assert ns.keys() == bindings.keys()
    assert all(ns[name] is value for name, value in bindings.items())
    for key, value in ns["model"].state_dict().items():
        assert torch.equal(value, state[key])
    assert ns["opt"].state_dict()["param_groups"] == opt_state["param_groups"]
    assert panel.widget.notice == "" and panel.widget.messages == {}


def test_code_changes_follow_the_applied_fixes(settled_panel: Panel) -> None:
    panel = settled_panel
    send(panel, command="show_code", open=True)
    assert panel.widget.code_open
    report = shown(panel)
    assert "debug-anomaly" in report.recommended  # a clear win with the same results
    edits = report.notebook_edits  # with nothing applied: the recommended fixes' edits
    assert edits is not None and sorted(edits.fixes) == sorted(report.recommended)

    send(panel, command="toggle", id="zero-grad-none", on=True)  # recommended or not
    edits = shown(panel).notebook_edits
    assert edits is not None and edits.fixes == ["zero-grad-none"]
    send(panel, command="show_code", open=False)
    assert not panel.widget.code_open


def test_retime_measures_the_applied_set_and_keeps_every_earlier_measurement(
    panel: Panel, session: Session
) -> None:
    first = shown(panel)
    progress: list[str] = []
    panel.widget.observe(lambda change: progress.append(change["new"]), "progress_message")
    busy: list[bool] = []
    panel.widget.observe(lambda change: busy.append(change["new"]), "busy")

    send(panel, command="toggle", id="debug-anomaly", on=True)
    send(panel, command="toggle", id="zero-grad-none", on=True)
    send(panel, command="retime")

    report = shown(panel)
    together = report.variant_for(["debug-anomaly", "zero-grad-none"])
    assert together is not None and together.speedup is not None
    assert together.measured_at and together.baseline_median_s
    # each applied fix alone again, and the first run's measurements are all still there
    assert len(report.variants) == len(first.variants) + 3
    assert report.variants[: len(first.variants)] == first.variants
    assert busy[:1] == [True] and busy[-1] is False  # controls off while measuring
    assert any(message.startswith("round ") and " of " in message for message in progress)
    assert session.applied_ids == ["debug-anomaly", "zero-grad-none"]  # still applied
    assert report.applied == ["debug-anomaly", "zero-grad-none"]
    assert not torch.is_anomaly_enabled()
    assert panel.widget.notice == ""


def test_a_fix_that_cannot_apply_says_why_in_its_row_and_stays_off(session: Session) -> None:
    finding = Finding(
        id="broken",
        title="A fix that cannot apply here",
        evidence="seen <b>in</b> the test",
        where="model",
        fixable=True,
        guide="test",
    )
    broken = _BrokenFix()
    session.detections.append(Detection(finding, broken))
    assert session.report is not None
    session.report.findings.append(finding)
    panel = Panel()
    panel.attach(session, session.report)

    send(panel, command="toggle", id="broken", on=True)

    message = panel.widget.messages["broken"]
    assert message["kind"] == "refused" and message["rerun"] is True
    assert message["text"] == "could not apply: RuntimeError: this model cannot be compiled here"
    assert broken.patch_calls == 1
    assert session.applied_ids == [] and "broken" not in shown(panel).applied  # toggle off
    assert not hasattr(session.workload.namespace["model"], "half_done")
    # toggling it off again clears the message
    send(panel, command="toggle", id="broken", on=False)
    assert "broken" not in panel.widget.messages
    panel.close()


def test_a_slower_fix_is_never_applied_as_a_win(panel: Panel, session: Session) -> None:
    report = session.report
    assert report is not None
    for variant in report.variants:  # as measured on a machine where the fix costs time
        variant.speedup, variant.verdict = 0.8, "slower"
    panel.attach(session, report)
    send(panel, command="apply_wins")
    assert session.applied_ids == []


def test_apply_all_measured_wins_then_revert_all(panel: Panel, session: Session) -> None:
    report = session.report
    assert report is not None
    won, tied = report.variant_for(["debug-anomaly"]), report.variant_for(["zero-grad-none"])
    won.speedup, won.verdict = 1.5, "faster"
    tied.speedup, tied.verdict = 1.01, "no clear change"  # its interval straddles 1
    panel.attach(session, report)

    send(panel, command="apply_wins")
    assert session.applied_ids == ["debug-anomaly"]
    assert shown(panel).applied == ["debug-anomaly"]

    send(panel, command="toggle", id="zero-grad-none", on=True)
    send(panel, command="revert_all")
    assert session.applied_ids == [] and shown(panel).applied == []
    assert torch.is_anomaly_enabled()


def test_a_failing_command_lands_in_the_panel(panel: Panel) -> None:
    send(panel, command="explode")
    assert panel.widget.notice == "explode: ValueError: unknown panel command 'explode'"
    send(panel, command="show_code", open=True)
    assert panel.widget.notice == ""  # the next command clears it


def test_report_is_displayed_and_each_retime_updates_the_same_display_id(
    shell: Any, session: Session
) -> None:
    from IPython.utils.capture import capture_output

    assert session.report is not None
    with capture_output() as output:
        panel = Panel(shell)
        panel.attach(session, session.report)
        send(panel, command="retime")
    display_id = f"ttm-report-{session.run_id}"
    first, *updates = output.outputs
    assert MIME_TYPE in first.data and "text/html" in first.data and "text/plain" in first.data
    assert first.transient == {"display_id": display_id} and not first.update
    assert updates, "the re-time updates the saved report in place"
    for update in updates:  # numbers stream in: every one updates the same output
        assert update.transient == {"display_id": display_id} and update.update
    assert updates[-1].data[MIME_TYPE] == panel.widget.report
    panel.close()


def test_measuring_shows_the_panel_at_once_and_close_closes_it(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    with capture_output() as output:
        panel = Panel.measuring(shell, "abc123")
    widget, report_place = output.outputs
    assert "application/vnd.jupyter.widget-view+json" in widget.data
    # what a front end that will not render widgets shows (and the labextension hides)
    assert widget.data["text/plain"] == "torchtune-magic live panel (run abc123)"
    # the saved report's place, held right below the panel (so what the cell prints comes
    # after both, live and after a reload): empty until the findings are in
    assert report_place.data == {} and not report_place.update
    assert report_place.transient == {"display_id": "ttm-report-abc123"}
    assert "ttm-run-abc123" in panel.widget._dom_classes
    assert panel.widget.busy and not panel.widget.attached
    assert panel.widget.report is None  # the view says "running the cell, then measuring…"
    panel.progress(0.5, "round 3 of 6: debug-anomaly")
    assert panel.widget.progress == 0.5
    assert panel.widget.progress_message == "round 3 of 6: debug-anomaly"

    report = json.loads((Path(__file__).parent / "data" / "sample_report.json").read_text())
    with capture_output() as output:
        panel.update(Report.from_dict({**report, "run_id": "abc123"}))
    (filled,) = output.outputs  # the findings fill the place held for them
    assert filled.update and filled.transient == {"display_id": "ttm-report-abc123"}
    assert MIME_TYPE in filled.data

    panel.close()
    assert panel.widget.comm is None


def test_a_kernel_where_the_panel_cannot_render_says_why_in_one_line(
    ip: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A front end is there (the shell has a kernel) but the panel's ES module is not: the
    output says so, and how to get the panel, then shows the static report."""
    from torchtune_magic.render import front_end

    monkeypatch.setattr(front_end, "STYLES", front_end.STATIC / "missing.css")
    monkeypatch.setattr(ip, "kernel", object(), raising=False)
    ip.run_cell("%%perfcheck --budget 0.3 --skip cpu-allocator\nx = 1 + 1")
    said = [line for line in capsys.readouterr().out.splitlines() if "no live panel" in line]
    assert said == [
        "%%perfcheck: no live panel (the panel's front end (torchtune_magic/static/missing.css) "
        "is not built: run `pip install -e .` in the checkout, or `jlpm build` in "
        "labextension/); showing the static report"
    ]
