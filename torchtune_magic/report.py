"""The report: plain dataclasses that turn into the schema-v1 JSON (a public contract).

Measurement code builds these; renderers only read them. Nothing here imports torch, so
a saved report can be loaded and rendered anywhere.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

SCHEMA_ID = "torchtune-magic/report/v1"
MIME_TYPE = "application/vnd.torchtune-magic.report.v1+json"
NOISE_THRESHOLD = 0.10  # IQR/median above this is flagged, as torch.utils.benchmark does
# A spread below this is the clock's and the interpreter's jitter on a run of a few µs (a
# cell with no torch work): it reads "± 0 µs" and is no sign of a noisy measurement.
NOISE_FLOOR_S = 1e-6
NO_CHANGE_BAND = 0.02  # speedups in [1, 1.02) read "no clear change", never a win
# What a report is showing: findings with numbers still coming in, the cell's own complete
# run under way, all done, or stopped by the user (Ctrl-C) before every number was in.
PHASES = ("measuring", "finishing", "done", "interrupted")
STEP_UNITS = ("batch", "optimizer step", "forward", "iteration")
OPTIONAL_MEASUREMENT_FIELDS = (
    "projected_cell_s",
    "measured_at",
    "baseline_median_s",
    "one_time_cause",
    "judged_by",
    "fits",
    "speedup_low",
    "speedup_high",
    "verdict",
    "rounds",
    "budget_to_tell_s",
    "at_most",
)
# A fix's speedup read over paired rounds (measuring/verdict.py): the interval decides
FASTER, SLOWER, NO_CLEAR_CHANGE = "faster", "slower", "no clear change"
LOSS_FIELDS = (
    "loss_verdict",
    "loss_max_rel_diff",
    "loss_tolerance",
    "loss_steps",
    "loss_baseline",
    "loss_fix",
)
# The parts of `Report.time_split` (`measuring/time_split.py` times them), and the part a
# finding's fix acts on (`Finding.segment`): here, below the checks and the measuring both.
# Host syncs are a part only where a CUDA device was in use (absent from a CPU run's split).
DATA_WAIT, FORWARD, BACKWARD, OPTIMIZER, HOST_SYNC, OTHER = (
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "host_sync",
    "other",
)
TIME_SPLIT_PARTS = (DATA_WAIT, FORWARD, BACKWARD, OPTIMIZER, HOST_SYNC, OTHER)
THROUGHPUT_FIELDS = (
    "flops",
    "flops_breakdown",
    "flops_detail",
    "achieved_tflops",
    "utilisation",
    "peak_tflops",
)


def is_noisy(median_s: float | None, iqr_s: float | None) -> bool:
    """Whether a timing's spread makes it noisy: an IQR above NOISE_THRESHOLD of the
    median and above NOISE_FLOOR_S. Zero spread is never noisy."""
    if not median_s or iqr_s is None or iqr_s <= NOISE_FLOOR_S:
        return False
    return iqr_s / median_s > NOISE_THRESHOLD


def load_schema() -> dict[str, Any]:
    """The shipped JSON Schema for `Report.to_dict()`."""
    text = resources.files("torchtune_magic").joinpath("report.schema.json").read_text()
    return json.loads(text)


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """`1 run`, `2 runs`: a count in words, for every view and every check's evidence."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


@dataclass
class CellChange:
    """One notebook cell to edit, found by its execution count (None: the %%perfcheck
    cell itself): its text now (as typed, the `%%perfcheck` line included for the checked
    cell), its text with the change, and the diff between them. A front end checks that
    the cell still reads `before` and replaces it with `after`."""

    execution_count: int | None
    before: str
    after: str
    diff: str


@dataclass
class CodeChange:
    """How to make a fix permanent: a diff of the cell, the notebook cells to edit (the
    checked one and the earlier ones that built the objects), and what to change where no
    cell could be found."""

    diff: str = ""
    elsewhere: list[str] = field(default_factory=list)
    cells: list[CellChange] = field(default_factory=list)


@dataclass
class NotebookEdits:
    """Every cell to edit for a set of fixes (those applied, or all): several fixes
    editing one cell are combined into one entry."""

    fixes: list[str]
    cells: list[CellChange]


@dataclass
class Finding:
    """One thing the tuning guide would change, with the evidence that it happened.

    `evidence` is one sentence leading with its key number ("batches waited 63% of the
    run"), what a user reads at a glance; `details` holds the rest (trials, per-batch
    figures), folded in the views. `segment` is the part of the time split the fix acts
    on (a key of `Report.time_split`), so a view can point the finding at its share."""

    id: str
    title: str
    evidence: str
    where: str
    fixable: bool
    guide: str
    line: int | None = None
    caveat: str | None = None
    code_change: CodeChange | None = None
    segment: str | None = None  # one of TIME_SPLIT_PARTS
    details: str | None = None


SLOWER_HERE = "slower here"  # a Checked outcome: the check's own trial measured the fix slower


@dataclass
class Checked:
    """A check that looked and found its fix would not pay here: its own trial measured it
    slower (e.g. channels-last's per-conv timing). Shown apart from the findings, with the
    figure, so the report never lists a fix that its own evidence says to skip."""

    id: str
    title: str
    outcome: str  # SLOWER_HERE
    evidence: str


@dataclass
class Stats:
    """Timing summary of one configuration (the baseline)."""

    median_s: float | None
    iqr_s: float | None
    runs: int
    peak_memory_bytes: int | None
    noisy: bool = False
    flops: int | None = None  # model FLOPs of one run (FlopCounterMode)
    flops_breakdown: dict[str, int] | None = None  # by "dtype kind", e.g. "float32 conv"
    flops_detail: str | None = None  # why FLOPs were not counted, when they were not
    achieved_tflops: float | None = None
    utilisation: float | None = None  # share of the device's peak (None: no peak known)
    peak_tflops: float | None = None  # the peak that share is of, for this precision mix
    # sampled runs: the whole cell projected from the per-step time (steps x per-step time
    # + the first run's time before its timed steps, one-time costs included)
    projected_cell_s: float | None = None
    measured_at: str | None = None  # ISO 8601 (UTC) when this measurement finished


@dataclass
class Numerics:
    """Whether a fix changed what the cell produced."""

    verdict: str = "not-compared"  # identical | close | changed | not-compared
    max_rel_diff: float | None = None
    detail: str | None = None
    # A training cell's loss per step (the tensor each backward() ran on), the fix's
    # against the baseline's over the same steps (`measuring/losses.py`); None elsewhere.
    loss_verdict: str | None = None  # "same loss" | "loss changed"
    loss_max_rel_diff: float | None = None  # the largest relative difference at a step
    loss_tolerance: float | None = None  # what the verdict was judged by
    loss_steps: int | None = None  # steps compared
    # the two curves, at most 200 points each, spread evenly (null: not finite)
    loss_baseline: list[float | None] | None = None
    loss_fix: list[float | None] | None = None

    @property
    def same_results(self) -> bool:
        """Whether results stayed the same enough to recommend the fix: the loss is the
        judge where there is one (a fix that changes it never is; one that keeps it is,
        however its parameters' last bits moved), else the outputs identical or within
        the fix's tolerance."""
        if self.loss_verdict is not None:
            return self.loss_verdict == "same loss"
        return self.verdict in ("identical", "close")


@dataclass
class Variant:
    """One set of fixes, measured against the baseline in the same interleaved run."""

    fixes: list[str]
    median_s: float | None = None
    iqr_s: float | None = None
    runs: int = 0
    speedup: float | None = None
    peak_memory_bytes: int | None = None
    numerics: Numerics = field(default_factory=Numerics)
    one_time_s: float | None = None
    one_time_cause: str | None = None  # what the one-time cost pays for, e.g. "compile"
    break_even_runs: int | None = None
    # "memory": a memory fix under --memory (peak, then time); "whole cell": a fix changing
    # how many steps the cell runs, its speedup the whole cell's (projected when sampled)
    judged_by: str | None = None
    # after the cell ran out of memory: whether it ran past the failing step with this fix
    # (its one run's time and peak memory are then this variant's numbers)
    fits: bool | None = None
    noisy: bool = False
    error: str | None = None
    flops: int | None = None  # the baseline's: the fixes keep the model's math
    achieved_tflops: float | None = None
    utilisation: float | None = None
    peak_tflops: float | None = None
    projected_cell_s: float | None = None  # see Stats.projected_cell_s
    measured_at: str | None = None  # when this measurement finished (ISO 8601, UTC)
    baseline_median_s: float | None = None  # the baseline median its speedup is against
    # paired rounds (measuring/verdict.py): `speedup` is the median of the rounds' ratios, the
    # interval bounds it (null: too few rounds for one), the verdict reads the interval
    speedup_low: float | None = None
    speedup_high: float | None = None
    verdict: str | None = None  # FASTER | SLOWER | NO_CLEAR_CHANGE
    rounds: int | None = None  # paired rounds behind the speedup
    # the budget ran out before the interval settled (or before the fix ran at all): the
    # `--budget` that would most likely tell
    budget_to_tell_s: float | None = None
    # the most its evidence lets the fix gain (e.g. a loader waiting 1 % of the run: 1.01x),
    # set where that cannot pass the no-change band: the fix was not timed for nothing
    at_most: float | None = None

    @property
    def is_slower(self) -> bool:
        """Measured slower: the whole interval below 1 (reports from before paired rounds:
        a speedup below 1). Never said of an interval that straddles 1."""
        if self.error or self.speedup is None:
            return False
        if self.verdict is not None:
            return self.verdict == SLOWER
        return self.speedup < 1.0

    @property
    def is_win(self) -> bool:
        """Measured faster: the whole interval above 1 and the speedup past the no-change
        band (older reports: the speedup past the band; the labextension reads the same)."""
        if self.error or self.speedup is None:
            return False
        if self.verdict is not None:
            return self.verdict == FASTER
        return self.speedup >= 1.0 + NO_CHANGE_BAND


@dataclass
class MachineLoad:
    """What other processes ran on this kernel's CPUs while it measured (from /proc): the
    numbers carry that noise, and a busy machine is said in the report."""

    window_s: float
    other_cpu_s: float  # CPU seconds of other processes on the CPUs this kernel may use
    cpus: int  # CPUs in this kernel's affinity mask

    @property
    def busy_cpus(self) -> float:
        return self.other_cpu_s / self.window_s if self.window_s > 0 else 0.0


@dataclass
class RankTime:
    """One rank's own baseline time (per step when sampled), before the ranks agreed on the
    slowest: where the ranks differ, the faster ones waited for the slowest."""

    rank: int
    host: str
    baseline_s: float | None
    # the share of its probe run it spent in synced backward passes after its own last
    # gradient: the all-reduce not hidden behind the backward, and waiting for slower ranks
    collective_share: float | None = None


@dataclass
class Distributed:
    """The torchrun job the cell was measured in: every time in the report is the slowest
    rank's (a distributed step ends when its slowest rank's does); `ranks` has each rank's
    own."""

    world_size: int
    backend: str
    nodes: int
    ranks: list[RankTime] = field(default_factory=list)


@dataclass
class NotApplicable:
    id: str
    reason: str


@dataclass
class OutOfMemory:
    """The cell ran out of memory in the probe: what failed, where, and how much."""

    error: str
    line: int | None  # the cell line that asked for the memory
    requested_bytes: int | None  # what the failing allocation asked for
    in_use_bytes: int | None  # memory in use when it failed
    in_use_measure: str  # what in_use_bytes counts (RSS, CUDA tensor memory)


@dataclass
class OwnFailure:
    """A failure of perfcheck's own machinery, caught at the part where it happened (the
    cell's own exceptions are never these): the rest of the report still stands."""

    part: str  # e.g. "check channels-last", "measuring", "numerics", "the panel"
    reason: str  # one line: the exception's type and message
    traceback: str = ""  # perfcheck's traceback, for a bug report (folded in the views)

    @classmethod
    def of(cls, part: str, error: BaseException) -> OwnFailure:
        """The failure `error` raised in `part`: its type and first message line, and its
        traceback."""
        message = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return cls(part, reason, text)


@dataclass
class Sampling:
    """How a long cell was measured: every measuring run (baseline and each variant) stopped
    at the same step, after the same warm-up steps; times are then per step."""

    unit: str  # one of STEP_UNITS
    steps_per_run: int | None  # steps in one complete run; None: unknown until that run
    steps_detail: str  # how that number was known, e.g. "8 epochs x 12 batches = 96 steps"
    warmup_steps: int  # run before the timed steps of every run, never timed
    steps_timed: int  # timed steps of every run
    probe_steps: int  # steps the instrumented probe ran before it stopped
    probe_complete: bool  # the probe ran the whole cell (then it was the cell's own run)
    # a cell of several epochs: per-step times count each epoch restart the timed steps
    # hold once per `steps_per_epoch`; where an epoch is longer than the timed steps, every
    # run's first epoch was ended after `epoch_end_step` for them to hold one
    steps_per_epoch: int | None = None
    epoch_end_step: int | None = None

    @property
    def stop_step(self) -> int:
        """The step after which every measuring run stops."""
        return self.warmup_steps + self.steps_timed


@dataclass
class CellRun:
    """The cell's one complete run, which leaves the kernel as if the cell ran once.

    `status`: "probe" (the instrumented probe ran the whole cell: that was its run),
    "running", "complete", "interrupted" (Ctrl-C), "failed" (the cell raised), or
    "skipped" (`--no-finish`: the kernel was left as before the cell)."""

    status: str
    seconds: float | None = None
    steps: int | None = None
    fixes: list[str] = field(default_factory=list)  # fixes the run used (`--apply`)
    detail: str | None = None


@dataclass
class Report:
    """Everything one %%perfcheck run found and measured."""

    environment: dict[str, Any]
    baseline: Stats
    findings: list[Finding] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    not_applicable: list[NotApplicable] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cell: str = ""
    run_id: str = ""
    budget_s: float | None = None
    elapsed_s: float | None = None
    phase: str = "done"  # one of PHASES
    sampling: Sampling | None = None  # set when runs were cut at a step
    cell_run: CellRun | None = None
    oom: OutOfMemory | None = None  # the cell ran out of memory (then nothing was timed)
    notebook_edits: NotebookEdits | None = None  # the applied fixes' cells (all fixes' if none)
    # fixes measured clearly faster with results identical or within their tolerance: what
    # the combined row, `--apply all`, the code changes and Apply to notebook carry
    recommended: list[str] | None = None
    load: MachineLoad | None = None  # other processes' CPU time while measuring
    distributed: Distributed | None = None  # measured under torchrun, over these ranks
    failures: list[OwnFailure] = field(default_factory=list)  # perfcheck's own, contained
    # where the baseline's first measuring run spent its time, seconds by part (data_wait,
    # forward, backward, optimizer, other: `measuring/time_split.py`)
    time_split: dict[str, float] | None = None
    # checks whose own trial measured their fix slower here: not findings, said apart
    checked: list[Checked] = field(default_factory=list)
    # `check SCRIPT`: the script, its arguments, the patch written and the verify result
    # (`{"script", "args", "patch", "verify"}`, see report.schema.json); None for a cell
    program: dict[str, Any] | None = None

    def variant_for(self, fixes: list[str] | tuple[str, ...]) -> Variant | None:
        """The newest measurement of exactly these fixes, if any (`variants` keeps every
        measurement, in the order they were taken)."""
        wanted = sorted(fixes)
        return next((v for v in reversed(self.variants) if sorted(v.fixes) == wanted), None)

    def latest_variants(self) -> list[Variant]:
        """One variant per fix set, its newest measurement, in first-measured order."""
        latest: dict[tuple[str, ...], Variant] = {}
        for variant in self.variants:
            key = tuple(sorted(variant.fixes))
            latest.pop(key, None)
            latest[key] = variant
        order = {tuple(sorted(v.fixes)): i for i, v in reversed(list(enumerate(self.variants)))}
        return sorted(latest.values(), key=lambda v: order[tuple(sorted(v.fixes))])

    @property
    def measuring(self) -> bool:
        """Numbers are still coming in (a renderer says "measuring…" where one is missing)."""
        return self.phase == "measuring"

    def finding(self, check_id: str) -> Finding | None:
        return next((f for f in self.findings if f.id == check_id), None)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for stats in [data["baseline"], *data["variants"]]:
            for key in (*THROUGHPUT_FIELDS, *OPTIONAL_MEASUREMENT_FIELDS):
                if stats.get(key, 0) is None:
                    del stats[key]  # optional: reports without them read as before
        for variant in data["variants"]:
            numerics = variant["numerics"]
            for key in LOSS_FIELDS:
                if numerics[key] is None:
                    del numerics[key]  # optional: reports without them read as before
        optional = (
            "sampling",
            "cell_run",
            "oom",
            "notebook_edits",
            "recommended",
            "load",
            "time_split",
            "program",
        )
        for key in (*optional, "distributed"):
            if data[key] is None:
                del data[key]
        for key in ("failures", "checked"):
            if not data[key]:
                del data[key]  # optional: a report without them reads as before
        for finding in data["findings"]:
            change = finding.get("code_change")
            if change is not None and not change["cells"]:
                del change["cells"]  # optional: a finding without cell edits reads as before
            for key in ("segment", "details"):
                if finding[key] is None:
                    del finding[key]  # optional: a finding without them reads as before
        if data["phase"] == "done":
            del data["phase"]  # absent means done: a finished report reads as v1 always did
        ordered = {"schema": SCHEMA_ID}
        ordered.update(data)
        return ordered

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        if data.get("schema") != SCHEMA_ID:
            raise ValueError(f"not a {SCHEMA_ID} report (schema={data.get('schema')!r})")
        findings = []
        for f in data.get("findings", []):
            change = f.get("code_change")
            if change:
                cells = [CellChange(**c) for c in change.get("cells", [])]
                change = CodeChange(**{**change, "cells": cells})
            findings.append(Finding(**{**f, "code_change": change or None}))
        edits = data.get("notebook_edits")
        variants = [
            Variant(**{**v, "numerics": Numerics(**v.get("numerics", {}))})
            for v in data.get("variants", [])
        ]
        return cls(
            environment=data["environment"],
            baseline=Stats(**data["baseline"]),
            findings=findings,
            variants=variants,
            not_applicable=[NotApplicable(**n) for n in data.get("not_applicable", [])],
            applied=list(data.get("applied", [])),
            warnings=list(data.get("warnings", [])),
            cell=data.get("cell", ""),
            run_id=data.get("run_id", ""),
            budget_s=data.get("budget_s"),
            elapsed_s=data.get("elapsed_s"),
            phase=data.get("phase", "done"),
            sampling=Sampling(**data["sampling"]) if data.get("sampling") else None,
            cell_run=CellRun(**data["cell_run"]) if data.get("cell_run") else None,
            oom=OutOfMemory(**data["oom"]) if data.get("oom") else None,
            notebook_edits=(
                NotebookEdits(edits["fixes"], [CellChange(**c) for c in edits["cells"]])
                if edits
                else None
            ),
            recommended=data.get("recommended"),
            load=MachineLoad(**data["load"]) if data.get("load") else None,
            distributed=_distributed(data.get("distributed")),
            failures=[OwnFailure(**f) for f in data.get("failures", [])],
            time_split=data.get("time_split"),
            checked=[Checked(**c) for c in data.get("checked") or []],
            program=data.get("program"),
        )

    def __repr__(self) -> str:
        """One line, like %timeit's result: `-o` must not print the whole report twice."""
        measured = [v for v in self.latest_variants() if v.speedup is not None]
        best = max(measured, key=lambda v: v.speedup or 0.0, default=None)
        tail = f", best {best.speedup:.2f}x ({'+'.join(best.fixes)})" if best else ""
        return f"<Report: {len(self.findings)} findings{tail}>"


def _distributed(data: dict[str, Any] | None) -> Distributed | None:
    if not data:
        return None
    ranks = [RankTime(**r) for r in data.get("ranks", [])]
    return Distributed(**{**data, "ranks": ranks})
