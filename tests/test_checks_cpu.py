"""The guide's CPU part: bf16 `amp` on CPUs that have it, `cpu-threads`, `cpu-allocator`.

Everything runs for real on this CPU. Timing is asserted only where the effect is several
times the noise of a shared 2-core machine; elsewhere a test asserts that a speedup was
measured and what a user sees (evidence, verdicts, settings put back).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from busy_process import other_busy_process
from workloads import detected, namespace_with

from torchtune_magic import perfcheck
from torchtune_magic.checks import registry
from torchtune_magic.checks.allocator import FAULT_SHARE, PLAIN_RUN_S, PLAIN_RUNS
from torchtune_magic.checks.precision import AMP_TOLERANCE
from torchtune_magic.checks.threads import LOAD_MIN_WINDOW_S, OTHER_CORE_SHARE, ThreadsFix
from torchtune_magic.kernel import allocator
from torchtune_magic.probe import cpu, load, plain_sample

TESTS = Path(__file__).resolve().parent
MLP_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                    nn.Linear(1024, 10))
opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
X, Y = torch.randn(256, 512), torch.randint(0, 10, (256,))
"""
MLP_TRAIN = """
for _ in range(6):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(mlp(X), Y)
    loss.backward()
    opt.step()
"""
CNN_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
cnn = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                    nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).eval()
images = torch.randn(16, 3, 64, 64)
"""
CNN_INFERENCE = """
with torch.no_grad():
    for _ in range(3):
        out = cnn(images)
"""
BF16 = cpu.bf16_features()
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU has no native bf16")
CORES = cpu.available_cores().count
needs_cores = pytest.mark.skipif(CORES < 2, reason="needs at least 2 available cores")


@pytest.fixture
def thread_count():
    """Whatever a test does to torch's thread count, the next test starts with the old one."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


# amp on the CPU --------------------------------------------------------------------------


@needs_bf16
def test_bf16_autocast_on_an_mlp_training_cell_is_measured_with_its_numerics():
    ns = namespace_with(MLP_SETUP)
    session = detected(MLP_TRAIN, ns, checks="amp", budget=6)
    [found] = session.detections
    evidence, details = found.finding.evidence, found.finding.details
    assert re.fullmatch(
        r"float32 matmuls and convolutions took \d+% of the cell's time, with autocast off",
        evidence,
    )
    assert details.startswith("Linear ×18 ran in float32")
    assert f"this CPU runs bf16 in hardware ({', '.join(BF16)} in its flags)" in details
    assert found.finding.segment == "forward"
    assert found.fix.compute_dtype == torch.bfloat16 and not found.fix.scaled  # no GradScaler
    # the forward and the loss only: backward and the step stay outside the block
    assert found.finding.code_change.diff.endswith(
        '+    with torch.autocast("cpu", dtype=torch.bfloat16):\n'
        "+        loss = nn.functional.cross_entropy(mlp(X), Y)\n"
        "     loss.backward()\n"
    )
    caveat = found.finding.caveat
    assert f"relative tolerance of {AMP_TOLERANCE:g}" in caveat and "validation" in caveat
    report = session.measure()
    variant = report.variant_for(["amp"])
    assert variant.error is None and variant.speedup is not None
    # bf16 really ran (results moved), within bf16's tolerance
    assert variant.numerics.verdict == "close"
    assert 0 < variant.numerics.max_rel_diff <= AMP_TOLERANCE
    assert variant.flops == report.baseline.flops
    assert not torch.is_autocast_enabled("cpu")


@needs_bf16
def test_bf16_autocast_on_a_cnn_inference_cell_is_measured(thread_count):
    # one thread: another process on this shared 2-core machine cannot stall a parallel
    # region, so the 1.6-2.3x of bf16 convolutions stands well clear of the noise
    torch.set_num_threads(1)
    ns = namespace_with(CNN_SETUP)
    report = perfcheck(CNN_INFERENCE, ns, checks="amp", budget=6)
    [finding] = report.findings
    assert finding.id == "amp" and "Conv2d ×6" in finding.details
    variant = report.variant_for(["amp"])
    assert variant.error is None and variant.speedup > 1.2
    assert variant.numerics.verdict == "close"


@needs_bf16
def test_a_cell_already_under_autocast_is_not_flagged():
    ns = namespace_with(CNN_SETUP)
    cell = 'with torch.autocast("cpu", dtype=torch.bfloat16):\n' + textwrap.indent(
        CNN_INFERENCE, "    "
    )
    report = perfcheck(cell, ns, checks="amp", budget=1, quick=True)
    assert report.findings == [] and report.not_applicable == []


def test_a_cpu_without_bf16_lists_amp_as_not_applicable_and_says_why(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse4_2", "avx2", "fma"}))
    session = detected(CNN_INFERENCE, namespace_with(CNN_SETUP), checks="amp")
    [entry] = session.not_applicable
    assert entry.id == "amp" and session.detections == []
    assert entry.reason.startswith("not applicable on this CPU: this CPU has no native bfloat16")
    assert "amx_bf16, avx512_bf16, bf16" in entry.reason
    monkeypatch.setattr(cpu, "cpu_flags", lambda: None)
    session = detected(CNN_INFERENCE, namespace_with(CNN_SETUP), checks="amp")
    assert "could not be read" in session.not_applicable[0].reason


def test_bf16_features_are_read_from_x86_flags_and_arm_features(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu, "CPUINFO", info)
    cases = {
        "flags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n": ["amx_bf16", "avx512_bf16"],
        "Features\t: fp asimd sve bf16 i8mm\n": ["bf16"],
        "flags\t\t: fpu sse avx2\n": [],
    }
    for text, expected in cases.items():
        info.write_text("processor\t: 0\n" + text)
        cpu.cpu_flags.cache_clear()
        assert cpu.bf16_features() == expected
    cpu.cpu_flags.cache_clear()


SWISH_CNN_SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x) * 0.5 + x * 0.5
cnn = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), Swish(), nn.Conv2d(64, 64, 3, padding=1),
                    Swish(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).eval()
images = torch.randn(16, 3, 64, 64)
"""


@needs_bf16
def test_bf16_amp_composes_with_channels_last_and_compile(monkeypatch, thread_count):
    torch.set_num_threads(1)
    # as in a kernel, the namespace is the __main__ module's: torch.compile's guards look up
    # the globals of `Swish.forward` through it
    main = types.ModuleType("__main__")
    exec(textwrap.dedent(SWISH_CNN_SETUP), main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    ns = main.__dict__
    cnn = ns["cnn"]
    # 45 s: a compile on a cold inductor cache takes 10-25 s of it
    session = detected(CNN_INFERENCE, ns, checks="amp,channels-last,fuse-pointwise", budget=45)
    found = {d.finding.id for d in session.fixable}
    assert found == {"amp", "channels-last", "fuse-pointwise"}, found
    report = session.measure([["amp", "channels-last", "fuse-pointwise"]])
    together = report.variant_for(["amp", "channels-last", "fuse-pointwise"])
    assert together.error is None and together.speedup is not None
    assert together.numerics.verdict == "close"  # amp's tolerance, the loosest of the three
    assert not torch.is_autocast_enabled("cpu") and ns["cnn"] is cnn
    assert cnn[0].weight.is_contiguous()  # channels_last undone too


# cpu-threads ------------------------------------------------------------------------------


@needs_cores
def test_a_forgotten_set_num_threads_1_is_flagged_and_measured_then_put_back(thread_count):
    torch.set_num_threads(1)
    session = detected(MLP_TRAIN, namespace_with(MLP_SETUP), checks="cpu-threads", budget=4)
    obs = session.observation
    if not session.detections:  # others kept a core busy meanwhile: 1 thread was right then
        assert obs.load is not None and obs.load.busy_cpus >= OTHER_CORE_SHARE
        obs.load = None  # as where the load cannot be read
        session.detect()
    report = session.measure()
    [finding] = report.findings
    assert finding.id == "cpu-threads" and finding.fixable
    assert "torch runs 1 intra-op thread" in finding.evidence
    assert f"this process may use {CORES} (" in finding.evidence
    assert "quick trial on mlp forward on a (256, 512) input (no_grad)" in finding.details
    assert "+torch.set_num_threads(" in finding.code_change.diff
    variant = report.variant_for(["cpu-threads"])
    assert variant.error is None and variant.speedup is not None
    assert variant.numerics.verdict in ("identical", "close")
    assert torch.get_num_threads() == 1  # measured, then undone: the user's setting stands


LOADED_CELL = "%%perfcheck -o -q --checks cpu-threads --budget 2\n" + MLP_TRAIN


@needs_cores
def test_another_busy_process_beside_a_training_cell_asks_for_fewer_threads(ip, thread_count):
    """CPU-bound processes of someone else's on the cores torch's threads use: the finding
    says how busy the machine was and offers fewer threads, for now.

    Two of them: the check reads the CPU time others were given, and one spinner competing
    with torch's two threads on two cores is given 0.57-0.81 of a CPU (measured here), on
    both sides of the 0.75 the check fires at; two are given a CPU or more."""
    torch.set_num_threads(CORES)
    ip.run_cell(MLP_SETUP)
    with other_busy_process(), other_busy_process():
        report = ip.run_cell(LOADED_CELL).result
    [finding] = report.findings
    assert finding.id == "cpu-threads" and finding.fixable
    assert f"torch runs {CORES} intra-op threads" in finding.evidence
    details = finding.details
    assert "other processes kept " in details and "during the probe's run" in details
    assert "of other processes' work on" in details
    busy = float(details.split("other processes kept ")[1].split(" of")[0])
    # one core is taken per 0.75 CPU other processes keep busy
    assert busy >= 0.75
    assert "quick trial on mlp forward" in details and "during the trial other processes" in details
    assert "when that work stops, the old count is faster again, so re-check then" in finding.caveat
    [chosen] = re.findall(r"^\+torch\.set_num_threads\((\d+)\)$", finding.code_change.diff, re.M)
    assert int(chosen) < CORES
    assert report.variant_for(["cpu-threads"]).error is None
    assert torch.get_num_threads() == CORES  # measured, then undone


def test_threads_matching_the_cores_stay_silent_unless_other_processes_took_one():
    """torch's default on this machine: silent while others leave the cores free. The test
    machine may itself be busy, so the rule is checked on the load the probe measured, and
    on loads given to the same observation."""
    if torch.get_num_threads() != CORES:
        pytest.skip(f"torch's default here is {torch.get_num_threads()} threads, not {CORES}")
    session = detected(MLP_TRAIN, namespace_with(MLP_SETUP), checks="cpu-threads", budget=1)
    obs, check = session.observation, registry.get("cpu-threads")
    assert obs.load is not None and obs.load.window_s > 0
    if obs.load.window_s >= LOAD_MIN_WINDOW_S and obs.load.busy_cpus >= OTHER_CORE_SHARE:
        [found] = session.detections  # the machine was busy: fired, for that reason
        assert obs.load.describe() in found.finding.details
    else:
        assert session.detections == []
    obs.load = load.Load(1.0, 0.4 * OTHER_CORE_SHARE, CORES)  # a quiet second
    assert check.detect(obs) == []
    obs.load = load.Load(0.1, 0.098, CORES)  # a busy CPU, but too short to tell
    assert check.detect(obs) == []
    obs.load = load.Load(1.0, 0.98, CORES)  # someone else's process on one core
    [found] = check.detect(obs)
    assert f"other processes kept 0.98 of this kernel's {CORES} CPUs busy" in found.finding.details
    assert found.fix.threads < CORES


@needs_cores
def test_too_many_threads_get_fewer_and_a_cell_s_own_call_is_edited(thread_count):
    too_many = 4 * CORES
    cell = f"torch.set_num_threads({too_many})\n" + MLP_TRAIN
    ns = namespace_with(MLP_SETUP)
    session = detected(cell, ns, checks="cpu-threads", budget=1)
    [found] = session.detections
    evidence = found.finding.evidence
    assert (
        f"torch runs {too_many} intra-op threads (set by torch.set_num_threads at cell line 1)"
        in evidence
    )
    assert found.finding.where == "cell line 1"
    chosen = found.fix.threads
    assert chosen < too_many
    assert found.fixed_source.startswith(f"torch.set_num_threads({chosen})\n")
    assert found.fix.edit_source(cell) == found.fixed_source  # the run sets k itself
    assert torch.get_num_threads() == too_many  # the trial put the count back


def test_threads_fix_undo_puts_back_the_exact_count(thread_count):
    for start in (1, 3):
        torch.set_num_threads(start)
        fix = ThreadsFix(2)
        fix.apply({})
        assert torch.get_num_threads() == 2
        fix.undo()
        assert torch.get_num_threads() == start


@needs_cores
def test_busy_loader_workers_next_to_all_threads_ask_for_fewer_threads():
    ns = namespace_with(
        MLP_SETUP,
        "from torch.utils.data import DataLoader\nfrom slow_data import SlowDataset\n"
        "loader = DataLoader(SlowDataset(n=48, features=512, delay_s=0.01), batch_size=8, "
        f"num_workers={CORES})\n",
    )
    if torch.get_num_threads() != CORES:
        pytest.skip("needs torch's default thread count")
    cell = "for xb, _ in loader:\n    out = mlp(xb)\n"
    session = detected(cell, ns, checks="cpu-threads", budget=1)
    [found] = session.detections
    assert f"{CORES} DataLoader workers were busy loading" in found.finding.details
    assert found.fix.threads == 1


def test_cores_count_physical_cores_in_the_affinity_mask_under_the_cgroup_quota(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    for cpu_id in cpus:  # all of them hyperthreads of one core
        topology = sys_root / "devices/system/cpu" / f"cpu{cpu_id}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text("0\n")
    (proc / "self").mkdir(parents=True)
    (proc / "self/cgroup").write_text("0::/\n")
    (sys_root / "fs/cgroup").mkdir(parents=True)
    cores = cpu.available_cores(sys_root, proc)
    assert cores.count == 1 and cores.detail.startswith("1 physical core in the affinity mask")
    for index, cpu_id in enumerate(cpus):  # separate cores again, and a 1.5-CPU v2 quota
        topology = sys_root / "devices/system/cpu" / f"cpu{cpu_id}" / "topology"
        (topology / "core_id").write_text(f"{index}\n")
    (proc / "self/cgroup").write_text("0::/user/job\n")
    (sys_root / "fs/cgroup/user/job").mkdir(parents=True)
    (sys_root / "fs/cgroup/user/job/cpu.max").write_text("150000 100000\n")
    (sys_root / "fs/cgroup/cpu.max").write_text("max 100000\n")
    cores = cpu.available_cores(sys_root, proc)
    assert cores.count == min(len(cpus), 2) and "1.5 CPUs" in cores.detail
    (proc / "self/cgroup").write_text("4:cpu,cpuacct:/docker/abc\n")  # v1, quota on a parent
    v1 = sys_root / "fs/cgroup/cpu,cpuacct/docker"
    (v1 / "abc").mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu.available_cores(sys_root, proc).count == 1


def test_cpu_checks_are_not_applicable_to_cuda_work():
    obs = detected(MLP_TRAIN, namespace_with(MLP_SETUP), checks="no-grad").observation
    obs.device = "cuda"
    for check_id in ("cpu-threads", "cpu-allocator"):
        reason = registry.get(check_id).not_applicable(obs)
        assert reason == "not applicable on CUDA: this only matters for work on the CPU"
    assert registry.get("amp").not_applicable(obs) is None


# cpu-allocator ----------------------------------------------------------------------------

ALLOCATOR_RUN = """
import json, torch
from glibc_blocks import mapped
from workloads import detected, namespace_with
from torchtune_magic.checks import registry
from torchtune_magic.checks.allocator import AllocatorFix
from torchtune_magic.measuring.verdict import Speedup
from torchtune_magic.measuring import figures
from torchtune_magic.report import Variant
torch.set_num_threads(1)  # a busy machine's stalled threads would blur the fault share

SETUP = '''
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(32, 1024)
'''
CELL = '''
for _ in range(20):
    opt.zero_grad(set_to_none=True)
    model(X).square().mean().backward()
    opt.step()
'''


# first, while the heap is small: the fix applied, then undone
fix = AllocatorFix()
fix.apply({})
applied = mapped(30 << 20)  # the fix: blocks up to 32 MiB stay on the heap
fix.undo()
undone = mapped(30 << 20)

ns = namespace_with(SETUP)
session = detected(CELL, ns, checks="cpu-allocator", budget=30)  # rounds stop once it tells
report = session.measure()
variant = report.variant_for(["cpu-allocator"])
findings = [f.__dict__ | {"code_change": f.code_change.__dict__} for f in report.findings]

# where the heap falls so that the fix wins nothing, the finding goes; until that is
# settled (more rounds could still tell) it stays
def measured(ratios, budget_to_tell_s=None):
    fixed = Variant(fixes=["cpu-allocator"], median_s=1.0, budget_to_tell_s=budget_to_tell_s)
    figures.set_speedup(fixed, Variant(fixes=[], median_s=1.0), Speedup.of(ratios))
    return fixed

kept, _ = registry.without_win(
    session.detections, [measured([1.3, 0.8, 1.1], budget_to_tell_s=20.0)], []
)
settled = [measured([1.0 + 0.01 * (i % 3 - 1) for i in range(12)])]
after_applied, _ = registry.without_win(session.detections, settled, ["cpu-allocator"])
after_settled, dropped = registry.without_win(session.detections, settled, [])
print(json.dumps({
    "findings": findings,
    "kept_unsettled": [d.finding.id for d in kept],
    "kept_applied": [d.finding.id for d in after_applied],
    "after_settled": [d.finding.id for d in after_settled],
    "dropped": [n.__dict__ for n in dropped],
    "variants": [v.fixes for v in report.variants],
    "speedup": variant and variant.speedup, "win": bool(variant and variant.is_win),
    "low": variant and variant.speedup_low, "high": variant and variant.speedup_high,
    "rounds": variant and variant.rounds,
    "error": variant and variant.error, "verdict": variant and variant.numerics.verdict,
    "mapped_applied": applied, "mapped_undone": undone,
}))
"""


def _in_fresh_process(script: str, **env: str) -> dict:
    """glibc's thresholds are process-wide and cannot be read back: the allocator's test runs
    in a process of its own, so this test process keeps glibc as it was."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(allocator.glibc_version() is None, reason="needs glibc")
def test_set_to_none_churn_shows_its_page_faults_and_mallopt_fix_is_undone_to_defaults():
    result = _in_fresh_process(ALLOCATOR_RUN)
    if not result["win"]:
        # seen once in 40-odd runs, in a CI run only: the fix measured 1.006x (its
        # faults not gone in the timed runs); one more process, and what both measured
        first = {k: result[k] for k in ("speedup", "low", "high", "rounds", "mapped_applied")}
        first["evidence"] = result["findings"][0]["evidence"] if result["findings"] else None
        result = _in_fresh_process(ALLOCATOR_RUN)
        result["first_try"] = first
    [finding] = result["findings"]
    assert finding["id"] == "cpu-allocator" and finding["fixable"]
    share = int(re.match(r"minor page faults cost ≈ (\d+)% of a plain run", finding["evidence"])[1])
    assert share >= FAULT_SHARE * 100
    details = finding["details"]
    assert "plain run of the cell took" in details and "µs per fault measured here" in details
    assert "the instrumented probe saw" in details
    assert "M_MMAP_THRESHOLD to 32 MiB and M_TRIM_THRESHOLD to 128 MiB" in details
    defaults = "its documented defaults (M_MMAP_THRESHOLD 128 KiB, M_TRIM_THRESHOLD 128 KiB)"
    assert defaults in finding["caveat"]
    elsewhere = " ".join(finding["code_change"]["elsewhere"])
    assert "LD_PRELOAD=" in elsewhere and "libjemalloc.so.2" in elsewhere
    assert "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728" in elsewhere
    assert ["cpu-allocator"] in result["variants"]
    assert result["error"] is None and result["win"], (result["speedup"], result.get("first_try"))
    assert result["verdict"] == "identical"
    assert result["kept_unsettled"] == result["kept_applied"] == ["cpu-allocator"]
    assert result["after_settled"] == []
    [dropped] = result["dropped"]
    assert (
        "the fix measured 1.00x, 0.99x-1.01x over 12 rounds (no clear change)"
        in (dropped["reason"])
    )
    # applied: blocks up to 32 MiB come from the heap; undone: glibc's 128 KiB default again
    assert result["mapped_applied"] is False and result["mapped_undone"] is True


def test_thresholds_the_process_started_with_are_what_undo_puts_back(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert allocator.starting_thresholds() == allocator.DEFAULTS
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0x8000000")
    assert allocator.starting_thresholds() == {
        allocator.M_MMAP_THRESHOLD: 4 << 20,
        allocator.M_TRIM_THRESHOLD: 128 << 20,
    }


MAKEMORE_SETUP = """
import torch
import torch.nn.functional as F
g = torch.Generator().manual_seed(2147483647)
Xtr = torch.randint(0, 27, (182000, 3), generator=g)
Ytr = torch.randint(0, 27, (182000,), generator=g)
C = torch.randn((27, 10), generator=g)
W1 = torch.randn((30, 200), generator=g)
b1 = torch.randn(200, generator=g)
W2 = torch.randn((200, 27), generator=g)
b2 = torch.randn(27, generator=g)
parameters = [C, W1, b1, W2, b2]
for p in parameters:
    p.requires_grad = True
lossi = []
"""
MAKEMORE_TRAIN = """
for i in range(1000):
    ix = torch.randint(0, Xtr.shape[0], (32,))
    emb = C[Xtr[ix]]
    h = torch.tanh(emb.view(-1, 30) @ W1 + b1)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Ytr[ix])
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < 100000 else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    lossi.append(loss.log10().item())
"""


def test_a_raw_tensor_loop_whose_page_faults_are_the_probe_s_own_has_no_allocator_finding(
    thread_count,
):
    """A makemore-style MLP trained on raw tensors: the probe's instrumentation takes
    hundreds of thousands of faults over it, a plain run a few dozen, and raising glibc's
    thresholds measured no gain (0.96-0.98x by A/B). Plain runs decide: no finding."""
    torch.set_num_threads(1)  # the cell's own speed is not the question here
    session = detected(MAKEMORE_TRAIN, namespace_with(MAKEMORE_SETUP), checks="cpu-allocator")
    assert session.detections == []
    samples = plain_sample.runs(session.workload, PLAIN_RUNS, PLAIN_RUN_S)
    assert samples is not None
    plain = min(samples, key=lambda sample: sample.faults_per_s)
    assert plain.faults * allocator.fault_cost_s() < FAULT_SHARE * plain.seconds
    # what the probe counted was mostly its own
    assert session.observation.minor_faults > 10 * max(sample.faults for sample in samples)


def test_a_small_cell_has_no_allocator_finding():
    report = perfcheck(MLP_TRAIN, namespace_with(MLP_SETUP), checks="cpu-allocator", budget=1)
    assert report.findings == [] and report.not_applicable == []


# where each check applies -----------------------------------------------------------------


def test_perfcheck_list_shows_where_each_check_applies(ip, capsys):
    ip.run_line_magic("perfcheck", "list")
    lines = capsys.readouterr().out.splitlines()

    def applies(check_id: str) -> str:
        index = next(i for i, line in enumerate(lines) if line.startswith(check_id + " "))
        return lines[index + 1].split("applies to: ")[1].split(" · ")[0]

    assert applies("cpu-threads") == applies("cpu-allocator") == "CPU"
    assert applies("amp") == applies("no-grad") == "CPU, CUDA"
    assert applies("tf32") == applies("pin-memory") == "CUDA"
