"""The GPU pass: amp, tf32, cudnn-benchmark, host-sync, non-blocking-copy, fused-optimizer,
tensor-on-device, and model FLOPs / utilisation.

On CPU every GPU check must say "not applicable" in a real run (`amp` applies to CPUs with
native bf16: tests/test_checks_cpu.py); the logic that does not depend on CUDA runs for real
here (detection from a CPU probe, CPU autocast, CPU fused optimizers, the flop counter).
Tests marked `gpu` need a CUDA device (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch
from workloads import detected, namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.checks import registry
from torchtune_magic.checks.cuda import CudnnBenchmarkFix, factory_moves
from torchtune_magic.checks.optimizer import FusedOptimizerFix
from torchtune_magic.checks.precision import AmpFix, TF32Fix
from torchtune_magic.measuring import utilisation
from torchtune_magic.probe.observation import HostCopy
from torchtune_magic.render import text
from torchtune_magic.report import Report, load_schema

GPU_IDS = [
    "amp",
    "tf32",
    "cudnn-benchmark",
    "host-sync",
    "non-blocking-copy",
    "fused-optimizer",
    "tensor-on-device",
]
ADAM_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
X, Y = torch.randn(64, 16), torch.randn(64, 1)
"""
TRAIN = """
for _ in range(4):
    loss = ((model(X) - Y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    print(loss.item())
"""
try:  # the device image has no jsonschema: validate where it is installed (CI, here)
    import jsonschema
except ImportError:
    jsonschema = None


def _valid(report: Report) -> None:
    if jsonschema is not None:
        jsonschema.validate(report.to_dict(), load_schema())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _observed(cell: str, ns: dict):
    """A CPU probe of `cell` (the checks' own detection is called directly)."""
    return detected(cell, ns, checks="no-grad").observation


def test_every_gpu_check_is_not_applicable_on_cpu_in_a_real_run():
    ns = namespace_with(ADAM_SETUP)
    report = perfcheck(TRAIN, ns, budget=1, quick=True)
    reasons = {item.id: item.reason for item in report.not_applicable}
    for check_id in GPU_IDS:
        if check_id == "amp":  # applies to CPUs with native bf16: tests/test_checks_cpu.py
            continue
        assert reasons[check_id].startswith("not applicable on CPU")
    assert not {f.id for f in report.findings} & set(GPU_IDS)
    _valid(report)


def test_flops_and_achieved_rate_on_cpu_with_no_peak():
    ns = namespace_with(ADAM_SETUP)
    report = perfcheck(TRAIN, ns, budget=1, quick=True)
    # 4 steps of fwd (2·64·16·32 + 2·64·32·1) and bwd (weights of both, input of the 2nd)
    forward = 2 * 64 * 16 * 32 + 2 * 64 * 32
    backward = forward + 2 * 64 * 32
    assert report.baseline.flops == 4 * (forward + backward)
    assert report.baseline.flops_breakdown == {"float32 matmul": report.baseline.flops}
    assert report.baseline.achieved_tflops > 0
    assert report.baseline.utilisation is None
    assert report.environment["peak_tflops"] is None
    assert "CPU" in report.environment["peak_tflops_source"]
    assert "FLOP/run" in text.render(report)
    again = Report.from_dict(report.to_dict())
    assert again.baseline.flops == report.baseline.flops


def test_flop_buckets_agree_with_flop_counter_mode_and_see_autocast_dtype():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 2)
    )
    x = torch.randn(2, 3, 6, 6)
    reference = torch.utils.flop_counter.FlopCounterMode(display=False)
    with reference:
        model(x).sum().backward()
    counted = utilisation.count(lambda: model(x).sum().backward())
    assert counted.total == reference.get_total_flops()
    assert sum(counted.buckets.values()) == counted.total
    assert set(counted.buckets) == {"float32 conv", "float32 matmul"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = utilisation.count(lambda: model(x))
    assert "bfloat16 matmul" in low.buckets


def test_utilisation_is_ideal_time_over_measured_time_per_precision():
    peaks, source = utilisation.peaks_for("cuda", "NVIDIA H200")
    assert peaks["bf16"] == 989.4 and "H200" in source
    assert utilisation.peaks_for("cuda", "NVIDIA H100 PCIe")[0]["fp32"] == 51.2
    assert utilisation.peaks_for("cuda", "NVIDIA A100-SXM4-80GB")[0]["tf32"] == 156.0
    assert utilisation.peaks_for("cuda", "Some Future GPU")[0] is None
    flops = utilisation.FlopCount(10**12, {"float32 matmul": 10**12})
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        plain = utilisation.throughput(flops, 0.1, peaks, [])
        assert plain.achieved_tflops == pytest.approx(10.0)
        assert plain.peak_tflops == pytest.approx(66.9)
        assert plain.utilisation == pytest.approx(10.0 / 66.9)
        assert utilisation.throughput(flops, 0.1, peaks, ["tf32"]).peak_tflops == pytest.approx(
            494.7
        )
        amp = utilisation.throughput(flops, 0.1, peaks, ["amp"], "bfloat16")
        assert amp.peak_tflops == pytest.approx(989.4)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert utilisation.throughput(flops, 0.1, None, []).utilisation is None


def test_fp16_amp_scales_backward_and_routes_steps_through_the_scaler_then_undoes():
    ns = namespace_with(ADAM_SETUP)
    opt, sched = ns["opt"], ns["sched"]
    scheduler_step = opt.step
    backward = torch.Tensor.backward
    fix = AmpFix("cpu", torch.float16, scaled=True)
    scales = []
    with fix.run_context(ns):
        assert opt.step is not scheduler_step
        assert torch.Tensor.backward is not backward
        exec(TRAIN.replace("print(loss.item())", "scales.append(1)"), {**ns, "scales": scales})
    assert opt.step is scheduler_step and torch.Tensor.backward is backward
    assert len(scales) == 4
    assert opt.state[next(ns["model"].parameters())]["step"].item() > 0
    assert sched.last_epoch == 4


@pytest.mark.parametrize("start", ["highest", "medium"])
def test_tf32_fix_undoes_the_exact_previous_setting(start):
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(start)
        fix = TF32Fix()
        fix.apply({})
        assert torch.get_float32_matmul_precision() == "high"
        fix.undo()
        assert torch.get_float32_matmul_precision() == start
    finally:
        torch.set_float32_matmul_precision(previous)


def test_cudnn_benchmark_fix_is_reversible_and_detection_wants_fixed_shapes():
    before = torch.backends.cudnn.benchmark
    fix = CudnnBenchmarkFix()
    fix.apply({})
    assert torch.backends.cudnn.benchmark is True
    fix.undo()
    assert torch.backends.cudnn.benchmark is before
    ns = namespace_with(
        "import torch\nfrom torch import nn\nnet = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())"
    )
    fixed = _observed("for _ in range(3):\n    y = net(torch.randn(2, 3, 8, 8))\n", ns)
    [found] = registry.get("cudnn-benchmark").detect(fixed)
    assert "each with one input shape" in found.finding.evidence
    assert "input shapes such as (2, 3, 8, 8)" in found.finding.details
    varying = _observed("for s in (8, 9, 10):\n    y = net(torch.randn(2, 3, s, s))\n", ns)
    assert registry.get("cudnn-benchmark").detect(varying) == []


def test_host_sync_counts_reads_per_step_from_the_cells_own_code():
    ns = namespace_with(ADAM_SETUP)
    obs = _observed(TRAIN + "final = loss.item()\nif loss > 0:\n    print(loss)\n", ns)
    [found] = registry.get("host-sync").detect(obs)
    assert "4 host reads of cpu tensors in one run, 1.0 per step over 4 steps" in (
        found.finding.evidence
    )
    # the reads after the loop run once: not flagged
    assert ".item() ×4 at line 8" in found.finding.details
    assert found.fix is None and not found.finding.fixable
    assert registry.get("host-sync").not_applicable(obs).startswith("not applicable on CPU")


def test_copy_checks_from_recorded_host_copies():
    cell = (
        "for _ in range(2):\n"
        "    noise = torch.randn(4, 8).to(dev)\n"
        "    ones = torch.ones(3, dtype=torch.float32).to(device=dev)\n"
        "    x = xp.to(dev)\n"
    )
    ns = namespace_with("import torch", dev="cpu", xp=torch.zeros(2))
    obs = _observed(cell, ns)
    obs.host_copies = [  # what a CUDA probe records for these lines (the copies need a GPU)
        HostCopy(2, False, False, False, 128),
        HostCopy(3, False, False, False, 12),
        HostCopy(4, True, False, False, 8),
    ] * 2
    [on_device] = registry.get("tensor-on-device").detect(obs)
    edited = on_device.fix.edit_source(cell)
    assert "torch.randn(4, 8, device=dev)" in edited
    assert "torch.ones(3, dtype=torch.float32, device=dev)" in edited
    [(_, cuda_text, _)] = factory_moves("y = torch.zeros(2,).cuda()\n", {1})
    assert cuda_text == 'torch.zeros(2, device="cuda",)'  # the call's trailing comma kept
    assert "xp.to(dev)" in edited and "draws from the CUDA generator" in on_device.finding.caveat
    [blocking] = registry.get("non-blocking-copy").detect(obs)
    assert blocking.fix.edit_source(cell).count("non_blocking=True") == 1
    assert "x = xp.to(dev, non_blocking=True)" in blocking.fix.edit_source(cell)
    assert factory_moves("y = torch.randn(2).to(torch.float16)\n", {1}) == []


def test_fused_optimizer_rebuilds_with_state_repoints_scheduler_and_undoes_exactly():
    ns = namespace_with(ADAM_SETUP, holder={})
    exec("holder['opt'] = opt", ns)
    obs = _observed(TRAIN, ns)
    [found] = registry.get("fused-optimizer").detect(obs)
    assert "Adam opt stepped 4 times" in found.finding.evidence
    fix = found.fix
    assert isinstance(fix, FusedOptimizerFix)
    original, sched = ns["opt"], ns["sched"]
    first = next(ns["model"].parameters())
    moment = original.state[first]["exp_avg"]
    steps_before = original.state[first]["step"].item()
    fix.apply(ns)
    fused = ns["opt"]
    assert fused is not original and ns["holder"]["opt"] is fused and sched.optimizer is fused
    assert fused.param_groups[0]["fused"] is True
    assert torch.equal(fused.state[first]["exp_avg"], moment)
    exec(TRAIN.replace("print(loss.item())", "pass"), ns)
    lr_after = fused.param_groups[0]["lr"]
    fix.undo()
    assert ns["opt"] is original and ns["holder"]["opt"] is original and sched.optimizer is original
    assert original.state[first]["exp_avg"] is moment  # state carried back into its tensors
    assert original.state[first]["step"].item() == steps_before + 4
    assert original.param_groups[0]["lr"] == lr_after
    assert not original.param_groups[0]["fused"]


def test_fused_optimizer_measured_close_on_cpu():
    ns = namespace_with(ADAM_SETUP)
    session = detected(TRAIN, ns, checks="no-grad")
    session.detections = registry.get("fused-optimizer").detect(session.observation)
    report = session.measure(budget_s=1.0)
    variant = report.variant_for(["fused-optimizer"])
    assert variant.error is None
    assert variant.numerics.verdict in ("identical", "close")
    assert ns["opt"] is session.observation.optimizers[0]


# on a CUDA device -----------------------------------------------------------------------------

CNN_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
torch.backends.cudnn.benchmark = False
torch.set_float32_matmul_precision("highest")
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
X = torch.randn(64, 3, 32, 32).pin_memory()
Y = torch.randint(0, 10, (64,))
"""
CNN_TRAIN = """
for _ in range(5):
    x, y = X.cuda(), Y.cuda()
    noise = torch.randn(64, 10).cuda()
    loss = nn.functional.cross_entropy(model(x) + 0 * noise, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(loss.item())
"""


@pytest.mark.gpu
@cuda
def test_gpu_checks_find_measure_and_report_utilisation_on_cuda():
    ns = namespace_with(CNN_SETUP)
    report = perfcheck(CNN_TRAIN, ns, budget=8)
    found = {f.id for f in report.findings}
    assert set(GPU_IDS) <= found, found
    for check_id in ("amp", "tf32", "cudnn-benchmark", "fused-optimizer"):
        variant = report.variant_for([check_id])
        assert variant is not None and variant.error is None, (check_id, variant)
    amp = report.variant_for(["amp"])
    assert amp.numerics.verdict in ("close", "changed")
    assert report.baseline.utilisation is not None and 0 < report.baseline.utilisation < 1
    assert report.environment["peak_tflops"]
    assert torch.backends.cudnn.benchmark is False
    assert torch.get_float32_matmul_precision() == "highest"
    _valid(report)


@pytest.mark.gpu
@cuda
def test_fused_optimizer_on_cuda_rebuilds_and_carries_state_back():
    ns = namespace_with(CNN_SETUP)
    obs = detected(CNN_TRAIN, ns, checks="no-grad").observation
    [found] = registry.get("fused-optimizer").detect(obs)
    original = ns["opt"]
    found.fix.apply(ns)
    exec(CNN_TRAIN.replace("print(loss.item())", "pass"), ns)
    assert ns["opt"].param_groups[0]["fused"] is True
    found.fix.undo()
    assert ns["opt"] is original
    step = original.state[next(ns["model"].parameters())]["step"]
    assert step.device.type == "cpu" and step.item() == 10


DATA_PARALLEL_SETUP = """
import torch
from torch import nn
model = nn.DataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, Y = torch.randn(64, 16).cuda(), torch.randn(64, 1).cuda()
"""
DATA_PARALLEL_TRAIN = """
for _ in range(4):
    loss = ((model(X) - Y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_data_parallel_is_not_applicable_without_two_gpus():
    """On CPU (or one GPU) nn.DataParallel runs the module as it is: nothing to move to DDP."""
    ns = namespace_with(DATA_PARALLEL_SETUP.replace(".cuda()", ""))
    report = perfcheck(DATA_PARALLEL_TRAIN, ns, budget=1, quick=True, checks="data-parallel")
    (item,) = report.not_applicable
    assert item.id == "data-parallel" and item.reason.startswith("not applicable on CPU")
    assert report.findings == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_data_parallel_over_two_gpus_gives_the_torchrun_form():
    ns = namespace_with(DATA_PARALLEL_SETUP)
    obs = _observed(DATA_PARALLEL_TRAIN, ns)
    (found,) = registry.get("data-parallel").detect(obs)
    assert "over 2 GPUs, called 4 times" in found.finding.evidence
    assert found.fix is None and not found.finding.fixable
    assert "torchrun --nproc-per-node 2" in found.finding.code_change.elsewhere[0]
