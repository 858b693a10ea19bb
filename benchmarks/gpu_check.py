"""The GPU check: naive notebook cells through `perfcheck`, next to hand-tuned expert cells.

Three realistic workloads, each as a naive cell (what people write first) and an expert cell
(what the tuning guide's GPU part leads to, tuned by hand), both run through
`torchtune_magic.perfcheck` from plain `python3` (no IPython on the device image):

- `cnn`: ResNet-style CNN training — fp32, NCHW, pageable DataLoader (num_workers=0), conv
  bias before BatchNorm, AdamW not fused, cudnn.benchmark off, `loss.item()` each step.
  Expert: bf16 autocast, channels_last, conv without bias, fused AdamW, pinned memory with
  non_blocking copies, cudnn.benchmark on, the loss accumulated on the device.
- `transformer`: a transformer block's training steps — fp32 with matmul precision
  "highest", `.item()` logging each step. Expert: bf16 autocast, fused AdamW, no per-step read.
- `inference`: the CNN evaluated with autograd recording (no `no_grad`). Expert:
  `inference_mode`, bf16 autocast, channels_last, cudnn.benchmark.

Per workload it writes the naive and expert schema-v1 reports, and a summary
(`summary.json`, `summary.md`): the speedup of all fixes together over the naive cell (target
≥ 2.5x on the CNN), its ratio to the expert cell (target ≥ 0.9x), the numerics verdicts of
amp and tf32, utilisation (share of the device's peak) naive / fixed / expert, and what each
check found.

Then (CUDA only) `out_of_memory`: a training step of a deep stack of wide blocks whose
activations (~12 GiB) do not fit a 6 GiB cap (`torch.cuda.set_per_process_memory_fraction`);
the report must name the OOM and show which memory fixes (activation checkpointing, amp) make
the step fit and at what peak (`out_of_memory.json`; target: checkpointing fits under the
cap). On a CPU the same engine path is tested by tests/test_out_of_memory_fits.py, which caps
the address space instead.

On the device machine (the device tool copies the repo; this runs from its root):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT && \
        python3 -m pytest -q -m gpu tests/test_checks_gpu.py -p no:cacheprovider

then copy the files under $OUT into `benchmarks/results/gpu/`. About 3–5 minutes on an H200.
On a CPU, `--smoke` runs tiny sizes in seconds (tests/test_gpu_check_script.py does so).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from torchtune_magic import Report, perfcheck  # noqa: E402

DEFAULT_OUT = HERE / "results" / "gpu"
SKIP = "fuse-pointwise,activation-checkpointing"  # compile minutes / a memory fix: not here

MODELS = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

def conv_bn(cin, cout, stride, bias):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=bias), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))

class Block(nn.Module):
    def __init__(self, cin, cout, stride, bias):
        super().__init__()
        self.a = conv_bn(cin, cout, stride, bias)
        self.b = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=bias), nn.BatchNorm2d(cout))
        same = stride == 1 and cin == cout
        self.skip = nn.Identity() if same else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=bias), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.b(self.a(x)) + self.skip(x))

def resnet(width, bias):
    w = width
    return nn.Sequential(conv_bn(3, w, 1, bias), Block(w, w, 1, bias), Block(w, 2 * w, 2, bias),
                         Block(2 * w, 4 * w, 2, bias), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4 * w, 10))

class TransformerBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))
"""


@dataclass
class Sizes:
    batch: int
    images: int
    side: int
    width: int
    d_model: int
    heads: int
    seq: int
    layers: int
    steps: int
    budget: float
    expert_budget: float


FULL = Sizes(256, 2048, 64, 64, 1024, 16, 512, 4, 6, 40.0, 12.0)
# a profiled run (peak memory, FLOPs) is reserved only when it costs at most a quarter of the
# budget: the tiny CNN's takes 1-2 s here, so a 1 s budget never counted its FLOPs
SMOKE = Sizes(4, 8, 8, 4, 16, 2, 8, 1, 2, 12.0, 2.0)


@dataclass
class Workload:
    name: str
    setup: str  # the earlier cells of the naive notebook
    naive: str
    expert_setup: str
    expert: str
    target_speedup: float | None = None
    target_vs_expert: float | None = None


def workloads(s: Sizes) -> list[Workload]:
    data = f"""
torch.backends.cudnn.benchmark = False
torch.set_float32_matmul_precision("highest")
images = torch.randn({s.images}, 3, {s.side}, {s.side})
labels = torch.randint(0, 10, ({s.images},))
"""
    cnn_setup = f"""
{data}
model = resnet({s.width}, bias=True).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(images, labels), batch_size={s.batch}, shuffle=True)
"""
    cnn_naive = """
model.train()
for x, y in loader:
    x, y = x.to(device), y.to(device)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.3f}")
"""
    cnn_expert_setup = f"""
{data}
torch.backends.cudnn.benchmark = True
model = resnet({s.width}, bias=False).to(device).to(memory_format=torch.channels_last)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
loader = DataLoader(TensorDataset(images, labels), batch_size={s.batch}, shuffle=True,
                    pin_memory=device == "cuda")
"""
    cnn_expert = """
model.train()
total = torch.zeros((), device=device)
for x, y in loader:
    x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
    y = y.to(device, non_blocking=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    total += loss.detach()
print(f"mean loss {total.item() / len(loader):.3f}")
"""
    tokens = f"""
torch.set_float32_matmul_precision("highest")
blocks = nn.Sequential(*[TransformerBlock({s.d_model}, {s.heads}) for _ in range({s.layers})])
blocks = blocks.to(device)
tokens = torch.randn({s.batch // 4 or 1}, {s.seq}, {s.d_model}, device=device)
target = torch.randn_like(tokens)
"""
    tr_setup = tokens + "opt = torch.optim.AdamW(blocks.parameters(), lr=1e-4)\n"
    tr_naive = f"""
for step in range({s.steps}):
    loss = nn.functional.mse_loss(blocks(tokens), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {{step}} loss {{loss.item():.4f}}")
"""
    tr_expert_setup = tokens + "opt = torch.optim.AdamW(blocks.parameters(), lr=1e-4, fused=True)\n"
    tr_expert = f"""
losses = []
for step in range({s.steps}):
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(blocks(tokens), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.detach())
print("losses", torch.stack(losses).tolist())
"""
    inf_setup = f"""
{data}
model = resnet({s.width}, bias=True).to(device).eval()
batches = images.to(device).split({s.batch})
"""
    inf_naive = """
predictions = [model(x).argmax(1) for x in batches]
"""
    inf_expert_setup = f"""
{data}
torch.backends.cudnn.benchmark = True
model = resnet({s.width}, bias=False).to(device).eval().to(memory_format=torch.channels_last)
batches = [x.contiguous(memory_format=torch.channels_last)
           for x in images.to(device).split({s.batch})]
"""
    inf_expert = """
with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16):
    predictions = [model(x).argmax(1) for x in batches]
"""
    return [
        Workload("cnn", cnn_setup, cnn_naive, cnn_expert_setup, cnn_expert, 2.5, 0.9),
        Workload("transformer", tr_setup, tr_naive, tr_expert_setup, tr_expert),
        Workload("inference", inf_setup, inf_naive, inf_expert_setup, inf_expert),
    ]


def namespace(setup: str) -> dict[str, Any]:
    """A notebook-like namespace after running the model definitions and `setup`."""
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(MODELS), ns)
    exec(textwrap.dedent(setup), ns)
    return ns


@dataclass
class Row:
    """One workload's numbers for the summary."""

    name: str
    naive_s: float | None
    fixed_s: float | None
    expert_s: float | None
    speedup_fixed: float | None
    speedup_expert: float | None
    ratio_to_expert: float | None
    fixes: list[str]
    findings: list[str]
    numerics: dict[str, str] = field(default_factory=dict)
    utilisation: dict[str, float | None] = field(default_factory=dict)
    tflops: dict[str, float | None] = field(default_factory=dict)
    one_time_s: float | None = None
    targets: dict[str, bool] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def _combined(report: Report) -> Any:
    """The variant with every fixable finding (the lone fix when there is one)."""
    ids = sorted(f.id for f in report.findings if f.fixable)
    return report.variant_for(ids) if ids else None


def run_workload(work: Workload, sizes: Sizes, out: Path) -> Row:
    print(f"== {work.name}: naive", flush=True)
    naive = perfcheck(work.naive, namespace(work.setup), budget=sizes.budget, skip=SKIP)
    naive.write_json(out / f"{work.name}.naive.json")
    print(f"== {work.name}: expert", flush=True)
    expert = perfcheck(
        work.expert, namespace(work.expert_setup), budget=sizes.expert_budget, skip=SKIP,
        quick=True,
    )  # fmt: skip
    expert.write_json(out / f"{work.name}.expert.json")
    fixed = _combined(naive)
    naive_s, expert_s = naive.baseline.median_s, expert.baseline.median_s
    fixed_s = fixed.median_s if fixed and not fixed.error else None
    speedup_fixed = naive_s / fixed_s if naive_s and fixed_s else None
    speedup_expert = naive_s / expert_s if naive_s and expert_s else None
    ratio = expert_s / fixed_s if expert_s and fixed_s else None
    row = Row(
        work.name,
        naive_s,
        fixed_s,
        expert_s,
        speedup_fixed,
        speedup_expert,
        ratio,
        fixes=list(fixed.fixes) if fixed else [],
        findings=sorted(f.id for f in naive.findings),
        one_time_s=fixed.one_time_s if fixed else None,
        errors=[f"{'+'.join(v.fixes)}: {v.error}" for v in naive.variants if v.error],
    )
    for check_id in ("amp", "tf32"):
        variant = naive.variant_for([check_id])
        if variant is not None:
            detail = variant.numerics.max_rel_diff
            suffix = f" (max rel diff {detail:.2e})" if detail is not None else ""
            row.numerics[check_id] = variant.numerics.verdict + suffix
    for label, stats in (("naive", naive.baseline), ("fixed", fixed), ("expert", expert.baseline)):
        row.utilisation[label] = getattr(stats, "utilisation", None)
        row.tflops[label] = getattr(stats, "achieved_tflops", None)
    if work.target_speedup is not None:
        row.targets["speedup"] = bool(speedup_fixed and speedup_fixed >= work.target_speedup)
    if work.target_vs_expert is not None:
        row.targets["vs_expert"] = bool(ratio and ratio >= work.target_vs_expert)
    return row


OOM_SETUP = """
class Wide(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.norm(self.proj(x))) * torch.sigmoid(x)

class Stack(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = nn.ModuleList(Wide(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

model = Stack(2048, 24).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16384, 2048, device=device)
"""
OOM_CELL = "loss = model(x).square().mean()\nloss.backward()\nopt.step()\nopt.zero_grad()\n"
OOM_CAP_BYTES = 6 * 2**30


def run_out_of_memory(out: Path) -> dict[str, Any]:
    """The OOM report of a step that needs ~12 GiB for activations under a 6 GiB cap."""
    from torchtune_magic.cell.workload import CellError

    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA (tests/test_out_of_memory_fits.py covers the CPU)"}
    print("== out_of_memory", flush=True)
    ns = namespace(OOM_SETUP)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(OOM_CAP_BYTES / total)
    reports: list[Report] = []
    try:
        perfcheck(OOM_CELL, ns, budget=20, on_report=reports.append)
        raised = None
    except CellError as error:
        raised = f"{type(error.original).__name__}: {str(error.original).splitlines()[0]}"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del ns
        torch.cuda.empty_cache()
    report = reports[-1]
    report.write_json(out / "out_of_memory.json")
    tried = {
        "+".join(v.fixes): {"fits": v.fits, "peak_bytes": v.peak_memory_bytes, "error": v.error}
        for v in report.latest_variants()
    }
    fits = tried.get("activation-checkpointing", {})
    return {
        "raised": raised,
        "cap_bytes": OOM_CAP_BYTES,
        "oom": asdict(report.oom) if report.oom else None,
        "tried": tried,
        "target_met": bool(
            raised and fits.get("fits") and (fits.get("peak_bytes") or 0) < OOM_CAP_BYTES
        ),
    }


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def markdown(rows: list[Row], env: dict[str, Any]) -> str:
    lines = [
        f"# GPU check — {env['device_name']} ({env['device']}), torch {env['torch']}",
        "",
        "| workload | naive | all fixes | expert | fixes speedup | expert speedup | "
        "fixes / expert | utilisation naive → fixed → expert | amp numerics | tf32 numerics |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        util = " → ".join(_fmt(r.utilisation.get(k), ".1%") for k in ("naive", "fixed", "expert"))
        lines.append(
            f"| {r.name} | {_fmt(r.naive_s and r.naive_s * 1e3, '.1f', ' ms')} "
            f"| {_fmt(r.fixed_s and r.fixed_s * 1e3, '.1f', ' ms')} "
            f"| {_fmt(r.expert_s and r.expert_s * 1e3, '.1f', ' ms')} "
            f"| {_fmt(r.speedup_fixed, '.2f', 'x')} | {_fmt(r.speedup_expert, '.2f', 'x')} "
            f"| {_fmt(r.ratio_to_expert, '.2f', 'x')} | {util} "
            f"| {r.numerics.get('amp', '–')} | {r.numerics.get('tf32', '–')} |"
        )
    lines.append("")
    for r in rows:
        targets = ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in r.targets.items())
        lines.append(f"- **{r.name}**: found {', '.join(r.findings) or 'nothing'}; "
                     f"combined {'+'.join(r.fixes) or '–'}"
                     + (f"; targets: {targets}" if targets else "")
                     + (f"; one-time {r.one_time_s:.2f} s" if r.one_time_s else "")
                     + (f"; errors: {'; '.join(r.errors)}" if r.errors else ""))  # fmt: skip
    return "\n".join(lines) + "\n"


def _oom_markdown(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"\n- **out_of_memory**: skipped, {result['skipped']}\n"
    tried = "; ".join(
        f"{fix}: {'fits' if r['fits'] else 'does not fit'}"
        + (f", {r['peak_bytes'] / 2**30:.2f} GiB peak" if r["fits"] and r["peak_bytes"] else "")
        for fix, r in result["tried"].items()
    )
    met = "met" if result["target_met"] else "MISSED"
    return (
        f"\n- **out_of_memory** (cap {result['cap_bytes'] / 2**30:.0f} GiB): "
        f"raised {result['raised'] or 'nothing'}; {tried or 'no memory fix tried'}; "
        f"target (checkpointing fits) {met}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds, any device")
    parser.add_argument("--only", default="", help="comma list of workloads (default: all)")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke for the CPU check")
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = {n for n in args.only.split(",") if n}
    started = time.perf_counter()
    rows = [
        run_workload(w, sizes, args.out) for w in workloads(sizes) if not wanted or w.name in wanted
    ]
    env = json.loads((args.out / f"{rows[0].name}.naive.json").read_text())["environment"]
    summary = {
        "device": env["device"],
        "device_name": env["device_name"],
        "torch": env["torch"],
        "peak_tflops": env.get("peak_tflops"),
        "smoke": args.smoke,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "workloads": [asdict(r) for r in rows],
        "out_of_memory": run_out_of_memory(args.out),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = markdown(rows, env) + _oom_markdown(summary["out_of_memory"])
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
