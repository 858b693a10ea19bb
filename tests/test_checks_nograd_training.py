"""no-grad inside a training cell: the evaluation forwards (whose graphs no backward ever
reached) are found, located and put under no_grad; the training forwards never are."""

from __future__ import annotations

import textwrap

import pytest
import torch
from workloads import detected, namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.kernel.fixes import FixError

VAL_ROWS, WIDTH, HIDDEN = 4096, 256, 4
SETUP = f"""
import torch
from torch import nn
torch.manual_seed(0)
layers = [nn.Linear(32, {WIDTH}), nn.ReLU()]
for _ in range({HIDDEN} - 1):
    layers += [nn.Linear({WIDTH}, {WIDTH}), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear({WIDTH}, 1))
loss_fn = nn.MSELoss()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [(torch.randn(32, 32), torch.randn(32, 1)) for _ in range(6)]
Xv, Yv = torch.randn({VAL_ROWS}, 32), torch.randn({VAL_ROWS}, 1)
def evaluate(m, x, y):
    return loss_fn(m(x), y).item()
"""
EPOCH = """\
for xb, yb in batches:
    opt.zero_grad()
    loss_fn(model(xb), yb).backward()
    opt.step()
"""
THROUGH_LAMBDA = EPOCH + "score = lambda x, y: loss_fn(model(x), y)\nval = score(Xv, Yv).item()\n"
THROUGH_FUNCTION = (
    "for epoch in range(2):\n"
    + textwrap.indent(EPOCH, "    ")
    + ("    val = evaluate(model, Xv, Yv)\n")
)
# each evaluation forward keeps every ReLU output for a backward that never comes
SAVED_BYTES = HIDDEN * VAL_ROWS * WIDTH * 4


def no_grad_detection(session):
    return next((d for d in session.detections if d.finding.id == "no-grad"), None)


def assert_measured_memory_drop_and_identical_training(report) -> None:
    # the profiled runs of a fix meant to cut memory cover every timed step (the evaluation
    # after an epoch too) and have up to half the budget: 5 s holds them on a busy machine
    variant = report.variant_for(["no-grad"])
    assert variant.error is None
    assert variant.peak_memory_bytes is not None, (report.sampling, report.warnings)
    assert variant.peak_memory_bytes < 0.6 * report.baseline.peak_memory_bytes
    assert variant.numerics.verdict == "identical"  # model weights and the values it bound


def test_evaluation_through_a_lambda_is_found_wrapped_and_measured():
    ns = namespace_with(SETUP)
    session = detected(THROUGH_LAMBDA, ns)
    detection = no_grad_detection(session)
    assert detection is not None and detection.finding.fixable
    finding = detection.finding
    assert finding.where == "the lambda at cell line 5, called at cell line 6 (1 forward)"
    assert finding.evidence.startswith("1 forward pass of model built an autograd graph")
    assert "while 6 other forwards in the cell were trained through" in finding.details
    assert f"held {SAVED_BYTES / 2**20:.1f} MiB of saved activations" in finding.details
    assert "+score = torch.no_grad()(lambda x, y: loss_fn(model(x), y))" in (
        finding.code_change.diff
    )
    assert detection.fix.edit_source(THROUGH_LAMBDA) == detection.fixed_source
    assert_measured_memory_drop_and_identical_training(session.measure())


def test_evaluation_through_a_function_from_an_earlier_cell_is_rebound_and_measured():
    ns = namespace_with(SETUP)
    original = ns["evaluate"]
    report = perfcheck(THROUGH_FUNCTION, ns, checks="no-grad", budget=5)
    (finding,) = report.findings
    # the probe stops at a step boundary after its share of the budget: on a busy machine
    # that can be in the second epoch, and the finding counts the evaluations it saw
    sampling = report.sampling
    seen = 2 if sampling is None or sampling.probe_complete else sampling.probe_steps // 6
    forwards = "1 forward" if seen == 1 else f"{seen} forwards"
    assert finding.where == f"evaluate, called at cell line 6 ({forwards})", sampling
    assert finding.code_change.diff == ""
    assert "decorate `def evaluate`" in finding.code_change.elsewhere[0]
    assert_measured_memory_drop_and_identical_training(report)
    assert ns["evaluate"] is original  # measured, then put back


def test_the_function_fix_rebinds_and_undoes_by_identity():
    ns = namespace_with(SETUP)
    original = ns["evaluate"]
    session = detected(THROUGH_FUNCTION, ns)
    session.apply("no-grad")
    wrapped = ns["evaluate"]
    assert wrapped is not original and wrapped.__wrapped__ is original
    with torch.enable_grad():
        out = ns["model"](ns["Xv"][:4])
    assert out.requires_grad  # the model itself is untouched: training still records
    session.undo("no-grad")
    assert ns["evaluate"] is original


def test_a_function_rebound_since_the_probe_is_refused_and_a_newer_one_never_clobbered():
    ns = namespace_with(SETUP)
    original = ns["evaluate"]
    session = detected(THROUGH_FUNCTION, ns)
    replacement = lambda m, x, y: 0.0  # noqa: E731  (the user redefines it in a new cell)
    ns["evaluate"] = replacement
    with pytest.raises(FixError, match="was rebound since the probe ran"):
        session.apply("no-grad")
    assert ns["evaluate"] is replacement and session.applied_ids == []
    ns["evaluate"] = original  # back to the function the probe saw: the fix applies
    session.apply("no-grad")
    assert ns["evaluate"].__wrapped__ is original
    newer = lambda m, x, y: 1.0  # noqa: E731  (rebound while the fix is on)
    ns["evaluate"] = newer
    session.undo("no-grad")
    assert ns["evaluate"] is newer  # undo never puts the stale original over it


def test_a_helper_that_trains_and_evaluates_is_wrapped_only_at_the_evaluation_call():
    ns = namespace_with(
        SETUP,
        """
        def run(data, train):
            total = 0.0
            for x, y in data:
                loss = loss_fn(model(x), y)
                if train:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                total += loss.item()
            return total
        """,
    )
    cell = (
        "for epoch in range(2):\n"
        "    train_loss = run(batches, True)\n"
        "    val_loss = run([(Xv, Yv)], False)\n"
    )
    detection = no_grad_detection(detected(cell, ns))
    assert detection.finding.where == "cell line 3 (2 forwards)"
    assert detection.fixed_source == (
        "for epoch in range(2):\n"
        "    train_loss = run(batches, True)\n"
        "    with torch.no_grad():\n"
        "        val_loss = run([(Xv, Yv)], False)\n"
    )
    assert detection.fix.functions == []  # `run` trains too: never rebound


def test_evaluation_statements_in_the_epoch_loop_are_wrapped_where_they_are():
    ns = namespace_with(SETUP)
    cell = (
        "for epoch in range(2):\n"
        + textwrap.indent(EPOCH, "    ")
        + ("    model.eval()\n    val = loss_fn(model(Xv), Yv).item()\n    model.train()\n")
    )
    detection = no_grad_detection(detected(cell, ns))
    assert "+    with torch.no_grad():\n+        val = loss_fn(model(Xv), Yv).item()" in (
        detection.finding.code_change.diff
    )
    report = perfcheck(cell, ns, checks="no-grad", budget=5)
    assert_measured_memory_drop_and_identical_training(report)


@pytest.mark.parametrize(
    "cell",
    [
        EPOCH,
        EPOCH + "with torch.no_grad():\n    val = evaluate(model, Xv, Yv)\n",
        EPOCH + "with torch.inference_mode():\n    val = model(Xv).sum().item()\n",
        EPOCH + "out = model(Xv[:32])\nloss_fn(out, Yv[:32]).backward()\n",
    ],
    ids=["training-only", "under-no-grad", "under-inference-mode", "every-forward-trained"],
)
def test_silent_when_every_graph_is_backpropagated_or_none_is_built(cell: str):
    assert no_grad_detection(detected(cell, namespace_with(SETUP))) is None


def test_through_the_magic_the_evaluation_function_of_an_earlier_cell_is_located(ip):
    ip.run_cell(SETUP)  # an earlier cell defines the model and `evaluate`
    original = ip.user_ns["evaluate"]
    report = ip.run_cell(
        "%%perfcheck -o -q --budget 2 --checks no-grad\n" + THROUGH_FUNCTION
    ).result
    (finding,) = report.findings
    assert finding.where == "evaluate, called at cell line 7 (2 forwards)"  # editor's lines
    assert report.variant_for(["no-grad"]).numerics.verdict == "identical"
    assert ip.user_ns["evaluate"] is original


def test_an_evaluation_def_in_the_cell_is_decorated_under_its_other_decorators():
    cell = EPOCH + (
        "class Scorer:\n"
        "    @staticmethod\n"
        "    def score(x, y):\n"
        "        return loss_fn(model(x), y)\n"
        "val = Scorer.score(Xv, Yv).item()\n"
    )
    ns = namespace_with(SETUP)
    detection = no_grad_detection(detected(cell, ns))
    assert detection.finding.where == "score() at cell line 7, called at cell line 9 (1 forward)"
    assert "    @staticmethod\n    @torch.no_grad()\n    def score(x, y):\n" in (
        detection.fixed_source
    )
    exec(detection.fixed_source, ns)  # still a staticmethod, and its loss carries no graph
    assert not ns["Scorer"].score(ns["Xv"], ns["Yv"]).requires_grad
