"""The live panel driven from Python as a user would: real torch, real IPython, real widgets."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from torchtune_magic.checks import Detection
from torchtune_magic.engine.fixes import Fix, Patcher
from torchtune_magic.engine.workload import Workload
from torchtune_magic.options import Options
from torchtune_magic.render import summary
from torchtune_magic.render.widget import Panel
from torchtune_magic.report import MIME_TYPE, Finding
from torchtune_magic.session import Session

BUDGET_S = 1.0

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


@pytest.fixture
def session() -> Iterator[Session]:
    """A finished %%perfcheck run of a small MLP training loop with two findings."""
    session = Session(Workload(TRAIN_CELL, _namespace()), Options(budget=BUDGET_S))
    session.run()
    yield session
    session.revert_all()
    torch.autograd.set_detect_anomaly(False)  # the cell turned it on for the whole process


@pytest.fixture
def panel(session: Session) -> Iterator[Panel]:
    assert session.report is not None
    panel = Panel()
    panel.attach(session, session.report)
    yield panel
    panel.close()


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


def test_attach_shows_a_row_per_finding_with_a_toggle_for_fixable_ones(panel: Panel) -> None:
    assert set(panel.rows) == {"debug-anomaly", "zero-grad-none"}
    assert {"ttm-live-panel", f"ttm-run-{panel.session.run_id}"} <= set(panel.root._dom_classes)
    for row in panel.rows.values():
        assert row.toggle is not None and row.toggle.value is False
        assert not row.toggle.disabled
        assert "x" in row.result.value  # a measured speedup
        assert row.finding.where in row.info.value
    assert "baseline" in panel.header.value
    assert "<svg" in panel.chart.value
    assert not panel.retime_button.disabled


def test_toggles_change_the_live_objects_at_once_and_back_exactly(
    panel: Panel, session: Session
) -> None:
    ns = session.workload.namespace
    bindings = dict(ns)
    state = {k: v.clone() for k, v in ns["model"].state_dict().items()}
    opt_state = ns["opt"].state_dict()
    assert torch.is_anomaly_enabled()  # left on by the cell, as if it ran once
    assert "zero_grad" not in vars(ns["opt"])

    panel.rows["debug-anomaly"].toggle.value = True
    panel.rows["zero-grad-none"].toggle.value = True
    assert not torch.is_anomaly_enabled()
    assert "zero_grad" in vars(ns["opt"])  # patched on the live optimizer
    assert session.applied_ids == ["debug-anomaly", "zero-grad-none"]

    panel.rows["debug-anomaly"].toggle.value = False
    panel.rows["zero-grad-none"].toggle.value = False
    assert torch.is_anomaly_enabled()
    assert "zero_grad" not in vars(ns["opt"])
    assert session.applied_ids == []
    assert ns.keys() == bindings.keys()
    assert all(ns[name] is value for name, value in bindings.items())
    for key, value in ns["model"].state_dict().items():
        assert torch.equal(value, state[key])
    assert ns["opt"].state_dict()["param_groups"] == opt_state["param_groups"]
    assert panel.log.outputs == ()


def test_code_changes_follow_the_toggles(panel: Panel, session: Session) -> None:
    panel.code_toggle.value = True
    assert "set_detect_anomaly" in panel.code_view.value  # all findings while none is on
    assert "set_to_none=True" in panel.optimized.value
    assert "%perfcheck insert" in panel.code_box.children[1].value  # how to insert it

    panel.rows["debug-anomaly"].toggle.value = True
    assert panel.optimized.value == session.optimized_cell(["debug-anomaly"])
    assert "set_to_none=False" in panel.optimized.value
    assert "set_detect_anomaly" not in panel.optimized.value


def test_retime_measures_the_toggled_set_and_updates_rows_and_chart(
    panel: Panel, session: Session
) -> None:
    first = panel.report
    bar_values: list[float] = []
    panel.bar.observe(lambda change: bar_values.append(change["new"]), "value")
    seen_disabled: list[bool] = []
    panel.retime_button.observe(lambda change: seen_disabled.append(change["new"]), "disabled")

    panel.rows["debug-anomaly"].toggle.value = True
    panel.rows["zero-grad-none"].toggle.value = True
    panel.retime_button.click()

    report = panel.report
    assert report is not first and report is session.report
    together = report.variant_for(["debug-anomaly", "zero-grad-none"])
    assert together is not None and together.speedup is not None
    assert report.variant_for(["debug-anomaly"]) is not None  # each toggled fix alone too
    assert "debug-anomaly+zero-grad-none" in panel.chart.value
    assert summary.speedup(report, together) in panel.chart.value
    assert seen_disabled[:2] == [True, False]  # disabled while measuring, then back
    assert max(bar_values) > 0
    assert session.applied_ids == ["debug-anomaly", "zero-grad-none"]  # still applied
    assert all(row.toggle.value for row in panel.rows.values())
    assert not torch.is_anomaly_enabled()
    assert panel.log.outputs == ()


def test_a_fix_that_fails_to_apply_says_why_and_switches_off(
    session: Session,
) -> None:
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
    row = panel.rows["broken"]

    row.toggle.value = True

    assert row.toggle.value is False
    assert broken.patch_calls == 1  # switched off without trying again
    assert "could not apply" in row.problem.value
    assert "RuntimeError: this model cannot be compiled here" in row.problem.value
    assert session.applied_ids == []
    assert not hasattr(session.workload.namespace["model"], "half_done")
    assert "&lt;b&gt;in&lt;/b&gt;" in row.info.value  # user-derived text is escaped
    assert panel.log.outputs == ()
    panel.close()


def test_a_slower_fix_is_never_shown_as_a_win(panel: Panel, session: Session) -> None:
    report = session.report
    assert report is not None
    for variant in report.variants:
        variant.speedup = 0.8  # as measured on a machine where the fix costs time
    panel.attach(session, report)

    for row in panel.rows.values():
        assert summary.SLOWER in row.result.value
    panel.apply_wins()
    assert session.applied_ids == []


def test_apply_all_measured_wins_then_revert_all(panel: Panel, session: Session) -> None:
    report = session.report
    assert report is not None
    report.variant_for(["debug-anomaly"]).speedup = 1.5
    report.variant_for(["zero-grad-none"]).speedup = 1.01  # within the no-change band
    panel.attach(session, report)

    panel.wins_button.click()
    assert session.applied_ids == ["debug-anomaly"]
    assert panel.rows["debug-anomaly"].toggle.value is True
    assert panel.rows["zero-grad-none"].toggle.value is False

    panel.rows["zero-grad-none"].toggle.value = True
    panel.revert_button.click()
    assert session.applied_ids == []
    assert not any(row.toggle.value for row in panel.rows.values())
    assert torch.is_anomaly_enabled()


def test_report_is_displayed_and_each_retime_updates_the_same_display_id(
    shell: Any, session: Session
) -> None:
    from IPython.utils.capture import capture_output

    assert session.report is not None
    with capture_output() as shown:
        panel = Panel(shell)
        panel.attach(session, session.report)
        panel.retime_button.click()
    display_id = f"ttm-report-{session.run_id}"
    first, *updates = shown.outputs
    assert MIME_TYPE in first.data and "text/html" in first.data and "text/plain" in first.data
    assert first.transient == {"display_id": display_id} and not first.update
    assert updates, "the re-time updates the saved report in place"
    for update in updates:  # numbers stream in: every one updates the same output
        assert update.transient == {"display_id": display_id} and update.update
    assert updates[-1].data[MIME_TYPE] == panel.report.to_dict()
    panel.close()


def test_measuring_shows_the_panel_at_once_and_close_closes_every_widget(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    with capture_output() as shown:
        panel = Panel.measuring(shell, "abc123")
    assert len(shown.outputs) == 1
    # what a front end that will not render widgets shows (and the labextension hides)
    assert shown.outputs[0].data["text/plain"] == "torchtune-magic live panel (run abc123)"
    assert "ttm-run-abc123" in panel.root._dom_classes
    assert panel.progress_box.layout.display != "none"
    panel.progress(0.5, "round 3")
    assert panel.bar.value == 0.5 and panel.status.value == "round 3"
    assert panel.retime_button.disabled

    parts = list(panel._widgets())
    panel.close()
    assert all(widget.comm is None for widget in parts)
