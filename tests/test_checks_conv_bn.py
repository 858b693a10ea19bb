"""conv-bias-bn through the real API: perfcheck() and Session."""

from __future__ import annotations

import torch
import workloads
from torch import nn
from workloads import namespace_with

from torchtune_magic.session import Session

EVAL = """
with torch.no_grad():
    out = model(x)
"""
TRAIN = """
for _ in range(3):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
NESTED = """
torch.manual_seed(0)
model = nn.Sequential(
    nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
    nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
)
x = torch.randn(4, 3, 16, 16)
"""
CUSTOM = """
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(6)  # registered before the conv: order is no evidence
        self.act = nn.ReLU()
        self.conv = nn.Conv1d(4, 6, 3)

    def forward(self, x):
        y = self.conv(x)
        return self.act(self.norm(y))

model = Net()
x = torch.randn(4, 4, 20)
"""
FACTORY = """
torch.manual_seed(0)

def block(c_in, c_out):
    return nn.Sequential(nn.Conv3d(c_in, c_out, 3, padding=1), nn.BatchNorm3d(c_out), nn.ReLU())

model = nn.Sequential(block(2, 4), block(4, 4))
x = torch.randn(2, 2, 6, 6, 6)
"""


def namespace(setup: str) -> dict:
    return namespace_with(setup, torch=torch, nn=nn)


def detected(cell: str, ns: dict, checks: str = "conv-bias-bn") -> Session:
    return workloads.detected(cell, ns, checks=checks)


def _measured(cell: str, ns: dict):
    """The fix measured as a fix set named by the caller: the plan's own choice would leave
    it untimed here, its bias add too small a share of this run to pass the band."""
    session = workloads.detected(cell, ns, checks="conv-bias-bn", budget=2)
    return session.measure([["conv-bias-bn"]])


def _finding(cell: str, ns: dict):
    detections = detected(cell, ns).detections
    assert len(detections) == 1
    return detections[0].finding


def test_nested_sequential_in_eval_keeps_outputs():
    ns = namespace(NESTED)
    ns["model"].eval()
    report = _measured(EVAL, ns)
    finding = report.finding("conv-bias-bn")
    assert finding.fixable and finding.where == "model.0.0, model.1.0"
    assert "model.0.0 (Conv2d, 8 channels) fed model.0.1 on all 1 calls" in finding.details
    assert finding.code_change.elsewhere == [
        "model.0.0: nn.Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)",
        "model.1.0: nn.Conv2d(8, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)",
    ]
    numerics = report.variant_for(["conv-bias-bn"]).numerics
    assert numerics.verdict in ("identical", "close"), numerics
    assert numerics.detail is None or "present in one run only" not in numerics.detail


def test_custom_forward_found_by_tensor_identity_not_order():
    ns = namespace(CUSTOM)
    finding = _finding("out = model(x)\n", ns)
    assert finding.where == "model.conv"
    assert "fed model.norm" in finding.details


def test_factory_blocks_with_conv3d():
    ns = namespace(FACTORY)
    finding = _finding("out = model(x)\n", ns)
    assert finding.where == "model.0.0, model.1.0"


def test_training_cell_stays_close_and_optimizer_skips_the_bias():
    ns = namespace(NESTED + "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n")
    report = _measured(TRAIN, ns)
    numerics = report.variant_for(["conv-bias-bn"]).numerics
    assert numerics.verdict in ("identical", "close"), numerics


def test_clean_controls_stay_silent():
    relu_first = """
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8))
x = torch.randn(2, 3, 8, 8)
"""
    no_bias = """
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8))
x = torch.randn(2, 3, 8, 8)
"""
    conv_only = """
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
x = torch.randn(2, 3, 8, 8)
"""
    for setup in (relu_first, no_bias, conv_only):
        assert detected("out = model(x)\n", namespace(setup)).detections == []


def test_conv_also_feeding_functional_code_stays_silent():
    setup = """
torch.manual_seed(0)

class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        a = self.bn(self.conv(x))
        return a + self.conv(x).relu()  # the second call's output is not normalized

model = Twice()
x = torch.randn(2, 3, 4, 4)
"""
    assert detected("out = model(x)\n", namespace(setup)).detections == []


def test_model_built_in_the_cell_is_fixed_as_each_run_builds_it():
    """Every run builds a new model: the fix reaches each run's conv, and the code change
    edits the constructor call in the cell itself."""
    ns = namespace("x = torch.randn(2, 3, 8, 8)\n")
    cell = "model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))\nout = model(x)\n"
    (detection,) = detected(cell, ns).detections
    assert detection.finding.fixable and "builds model.0 on every run" in detection.finding.details
    assert "nn.Conv2d(3, 4, 3, bias=False)" in detection.fixed_source
    assert (
        "+model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False)"
        in detection.finding.code_change.diff
    )


def test_model_built_by_code_the_cell_calls_is_fixed_and_the_constructor_named():
    """The convs are built inside a function from an earlier cell: the live fix still
    reaches them (by the cell line calling it and their order), the change is said in words."""
    setup = (
        "x = torch.randn(2, 3, 8, 8)\n"
        "def make():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))\n"
    )
    (detection,) = detected("model = make()\nout = model(x)\n", namespace(setup)).detections
    finding = detection.finding
    assert finding.fixable and detection.fixed_source is None
    assert "built by library code the cell calls" in finding.details
    assert finding.code_change.elsewhere == [
        "model.0: nn.Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), bias=False)"
    ]


def test_apply_undo_round_trip_is_exact():
    ns = namespace(NESTED + "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    model, opt = ns["model"], ns["opt"]
    session = detected(TRAIN, ns)
    conv, bn = model[0][0], model[0][1]
    bias, mean = conv.bias, bn.running_mean
    before = {k: v.clone() for k, v in model.state_dict().items()}
    session.apply("conv-bias-bn")
    assert conv.bias is None and "bias" in conv._parameters
    # the state_dict shows the model as built: same keys, same values (running_mean unfolded)
    during = model.state_dict()
    assert list(during) == list(before)
    assert all(torch.allclose(during[k].float(), v.float(), atol=1e-6) for k, v in before.items())
    session.workload.run()  # trains with the bias removed; SGD skips the grad-less bias
    session.undo("conv-bias-bn")
    assert conv.bias is bias and bn.running_mean is mean
    assert opt.param_groups[0]["params"][1] is bias
    session.apply("conv-bias-bn")
    session.undo("conv-bias-bn")
    # nothing ran in between: the fold is undone bit for bit
    assert torch.equal(bn.running_mean, mean) and conv.bias is bias


def test_untouched_round_trip_restores_bits():
    ns = namespace(NESTED)
    model = ns["model"]
    session = detected("out = model(x)\n", ns)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    session.apply("conv-bias-bn")
    session.undo("conv-bias-bn")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))


def test_composes_with_no_grad_in_any_order():
    ns = namespace(NESTED)
    ns["model"].eval()
    session = detected("out = model(x)\n", ns, checks="conv-bias-bn,no-grad")
    assert {d.finding.id for d in session.fixable} == {"conv-bias-bn", "no-grad"}
    conv = ns["model"][0][0]
    bias = conv.bias
    reference = ns["model"](ns["x"]).detach()
    for order in (["conv-bias-bn", "no-grad"], ["no-grad", "conv-bias-bn"]):
        for check_id in order:
            session.apply(check_id)
        assert torch.allclose(ns["model"](ns["x"]), reference, atol=1e-5)
        session.undo(order[0])
        session.undo(order[1])
        assert conv.bias is bias
    report = session.measure([["conv-bias-bn", "no-grad"]])
    both = report.variant_for(["conv-bias-bn", "no-grad"])
    assert both.error is None and both.numerics.verdict in ("identical", "close")


def test_model_copied_in_the_cell_is_not_fixed_and_says_why():
    """A copy is made without a constructor call the fix could follow into the next run."""
    ns = namespace("import copy\nx = torch.randn(2, 3, 8, 8)\n")
    cell = (
        "model = copy.deepcopy(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))\n"
        "out = model(x)\n"
    )
    finding = _finding(cell, ns)
    assert not finding.fixable
    assert "model.0, model.1 are made anew on every run without a constructor call" in (
        finding.details
    )
