"""The workflow: probe → detect → measure → report, and the stack of applied fixes.

A Session lives as long as its panel: toggles call `apply`/`undo`, Re-time calls `measure`.
Measuring always starts each run from the state the cell started from (snapshot S0) and
ends by putting back the state it found, so the kernel looks as if the cell ran once.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .checks import Detection, registry
from .engine import codeedit, discovery, fixes, memory, numerics, probe, state, timing, utilisation
from .engine.workload import Workload, silenced
from .options import Options
from .report import NotApplicable, Report, Stats, Variant

BASELINE = "baseline"
SNAPSHOT_SHARE_OF_FREE_MEMORY = 0.5


@dataclass
class _Config:
    """One configuration to measure: a label and the fixes it applies."""

    label: str
    fixes: list[fixes.Fix]

    @property
    def ids(self) -> list[str]:
        return sorted(f.check_id for f in self.fixes)


class Session:
    """One %%perfcheck run and everything done with its result afterwards."""

    def __init__(
        self,
        workload: Workload,
        options: Options | None = None,
        progress: timing.Progress | None = None,
    ):
        self.workload = workload
        self.options = options or Options()
        self.progress = progress
        self.run_id = uuid.uuid4().hex[:12]
        self.observation: probe.Observation | None = None
        self.detections: list[Detection] = []
        self.not_applicable: list[NotApplicable] = []
        self.warnings: list[str] = []
        self.report: Report | None = None
        self._start_state: state.Snapshot | None = None
        self._applied: dict[str, fixes.Fix] = {}
        self._flops: utilisation.FlopCount | None = None  # counted once: fixes keep the math
        self._flops_detail: str | None = None
        self._memory_label: str | None = None
        self._started = time.perf_counter()

    # the one-shot flow ----------------------------------------------------------------------
    def run(self) -> Report:
        """Probe, detect and measure; leave `--apply` fixes applied. The cell's own
        exception propagates (as workload.CellError) with nothing applied."""
        __tracebackhide__ = True
        self.probe()
        self.detect()
        report = self.measure()
        for detection in self.detections:
            if detection.fix is not None and self.options.applies(detection.finding.id):
                self.apply(detection.finding.id)
        report.applied = self.applied_ids
        return report

    def probe(self) -> probe.Observation:
        __tracebackhide__ = True
        namespace = self.workload.namespace
        if self.options.restore:
            found = discovery.walk(namespace)
            needed = state.estimate_bytes(found)
            free = state.available_memory_bytes()
            if free is not None and needed > SNAPSHOT_SHARE_OF_FREE_MEMORY * free:
                self.warnings.append(
                    f"state not restored: a snapshot would need {needed / 2**30:.1f} GiB of "
                    f"{free / 2**30:.1f} GiB free host memory, so the extra measuring runs have "
                    "changed the model/optimizer state; re-run the cells that set them up"
                )
            else:
                self._start_state = state.take(namespace, found)
        device = self.options.device or "cpu"
        self.observation = probe.run(self.workload, device)
        self.observation.memory_asked = self.options.memory
        if self.options.device is None and _uses_cuda(self.observation):
            self.observation.device = "cuda"
        return self.observation

    def detect(self) -> list[Detection]:
        obs = self._observed()
        self.detections, self.not_applicable = [], []
        for check in registry.all_checks():
            if not self.options.wants(check.id):
                continue
            reason = check.not_applicable(obs)
            if reason is not None:
                self.not_applicable.append(NotApplicable(check.id, reason))
                continue
            self.detections.extend(check.detect(obs))
        return self.detections

    # fixes ----------------------------------------------------------------------------------
    @property
    def applied_ids(self) -> list[str]:
        return sorted(self._applied)

    def fix_for(self, check_id: str) -> fixes.Fix:
        for detection in self.detections:
            if detection.finding.id == check_id and detection.fix is not None:
                return detection.fix
        raise KeyError(f"no live fix for {check_id!r} in this report")

    def apply(self, check_id: str) -> None:
        """Apply a fix to the live objects (raises FixError with nothing left applied)."""
        fix = self.fix_for(check_id)
        fix.apply(self.workload.namespace)
        self._applied[check_id] = fix

    def undo(self, check_id: str) -> None:
        fix = self._applied.pop(check_id, None)
        if fix is not None:
            fix.undo()

    def revert_all(self) -> None:
        for check_id in reversed(self.applied_ids):
            self.undo(check_id)

    @property
    def fixable(self) -> list[Detection]:
        return [d for d in self.detections if d.fix is not None]

    def suggested_cell(self) -> str:
        """The cell with the code changes of the fixes applied now (of all, when none is)."""
        return self.optimized_cell(self.applied_ids or None)

    def optimized_cell(self, check_ids: list[str] | None = None) -> str:
        """The cell with the code changes of these findings (default: all) applied."""
        versions = [
            d.fixed_source
            for d in self.detections
            if d.fixed_source is not None and (check_ids is None or d.finding.id in check_ids)
        ]
        return codeedit.combine(self.workload.source, versions)

    # measuring ------------------------------------------------------------------------------
    def measure(
        self, fix_sets: list[list[str]] | None = None, *, budget_s: float | None = None
    ) -> Report:
        """Time the baseline against fix sets (default: each fix alone and all together),
        interleaved. Applied fixes are lifted for the duration and put back after.

        `budget_s` gives this measurement its own time (a later re-time from the panel);
        by default it gets what is left of the run's budget."""
        __tracebackhide__ = True
        configs = self._configs(fix_sets)
        if budget_s is None:
            budget = (self.options.budget, self._started)
        else:
            budget = (budget_s, time.perf_counter())
        with self._fixes_lifted(), self._state_kept():
            variants, baseline = self._measure_configs(configs, budget)
        self.report = self._build_report(baseline, variants, budget)
        if self.options.json:
            self.report.write_json(self.options.json)
        return self.report

    def _configs(self, fix_sets: list[list[str]] | None) -> list[_Config]:
        if fix_sets is None:
            solo = [[d.finding.id] for d in self.fixable]
            together = [d.finding.id for d in self.fixable]
            fix_sets = [] if self.options.quick else list(solo)
            if len(together) > 1 or (self.options.quick and together):
                fix_sets.append(together)
        configs = [_Config(BASELINE, [])]
        for ids in fix_sets:
            label = "+".join(sorted(ids))
            if label and label not in {c.label for c in configs}:
                configs.append(_Config(label, [self.fix_for(i) for i in ids]))
        return configs

    @contextmanager
    def _fixes_lifted(self) -> Iterator[None]:
        lifted = self.applied_ids
        self.revert_all()
        try:
            yield
        finally:
            for check_id in lifted:
                try:
                    self.apply(check_id)
                except fixes.FixError as error:
                    self.warnings.append(f"could not re-apply {check_id}: {error.reason}")

    @contextmanager
    def _state_kept(self) -> Iterator[None]:
        """Whatever happens while measuring, the kernel ends as it was before."""
        current = None
        if self._start_state is not None:
            current = state.take(self.workload.namespace, discovery.walk(self.workload.namespace))
        try:
            yield
        finally:
            if current is not None:
                current.restore()

    def _one_run(self, config: _Config, observe: Callable[[], Any] | None = None) -> float:
        """Run the cell once from the start state with the config's fixes applied."""
        __tracebackhide__ = True
        if self._start_state is not None:
            self._start_state.restore()
        namespace = self.workload.namespace
        source = fixes.combined_source(self.workload.source, config.fixes)
        with (
            fixes.applied(config.fixes, namespace),
            fixes.combined_context(config.fixes, namespace),
            silenced(),
        ):
            seconds = self.workload.run(source)
            if observe is not None:
                observe()
        return seconds

    def _measure_configs(
        self, configs: list[_Config], budget: tuple[float, float]
    ) -> tuple[list[Variant], Variant]:
        """`budget`: (seconds, the perf_counter time they are counted from)."""
        outputs: dict[str, numerics.Outputs] = {}
        results: dict[str, Variant] = {}
        warmups: dict[str, float] = {}
        runnable: list[_Config] = []
        watched = self._watched_outputs()
        for config in configs:
            variant = Variant(fixes=config.ids)
            results[config.label] = variant
            try:
                warmups[config.label] = self._one_run(config)
                peak = self._checked_run(config, outputs, watched)
                variant.peak_memory_bytes = peak
                runnable.append(config)
            except fixes.FixError as error:
                variant.error = f"the fix could not be applied: {error.reason}"
            except Exception as error:  # the cell failed under this fix
                if config.label == BASELINE:
                    raise
                original = getattr(error, "original", error)
                variant.error = (
                    f"the cell raised with this fix: {type(original).__name__}: {original}"
                )
            self._report_progress(0.0, f"warmed up {config.label}")
        self._count_flops(configs[0])
        seconds, counted_from = budget
        left = max(0.0, seconds - (time.perf_counter() - counted_from))
        timed = timing.interleaved(
            {c.label: functools.partial(self._one_run, c) for c in runnable},
            left,
            self._report_progress,
            min_rounds=timing.MIN_ROUNDS if len(runnable) > 1 else 3,
        )
        for label, measurement in timed.items():
            measurement.warmup_s = warmups[label]
            variant = results[label]
            variant.median_s, variant.iqr_s = measurement.median, measurement.iqr
            variant.runs, variant.noisy = measurement.runs, measurement.noisy
        self._set_one_time_costs(configs, results, timed)
        base = results[BASELINE]
        self._add_throughput(configs, results)
        for config in configs[1:]:
            variant = results[config.label]
            if variant.error or not variant.median_s or not base.median_s:
                continue
            variant.speedup = base.median_s / variant.median_s
            saved = base.median_s - variant.median_s
            if variant.one_time_s and saved > 0:
                variant.break_even_runs = math.ceil(variant.one_time_s / saved)
            tolerance = max(f.tolerance for f in config.fixes)
            if BASELINE in outputs and config.label in outputs:
                variant.numerics = numerics.compare(
                    outputs[BASELINE], outputs[config.label], tolerance
                )
            elif self._start_state is None:
                variant.numerics.detail = "not compared: state restore is off"
        self._flag_nondeterminism(configs[0], results, outputs, watched)
        return [results[c.label] for c in configs[1:]], base

    @staticmethod
    def _set_one_time_costs(
        configs: list[_Config],
        results: dict[str, Variant],
        timed: dict[str, timing.Measurement],
    ) -> None:
        """First-run cost of fixes that can have one, beyond the baseline's own first run."""
        base = timed.get(BASELINE)
        base_extra = base.warmup_s - base.median if base and base.median is not None else 0.0
        for config in configs[1:]:
            measurement = timed.get(config.label)
            if measurement is None or not any(f.one_time_cost for f in config.fixes):
                continue
            if measurement.one_time_s is not None:
                extra = measurement.one_time_s - max(0.0, base_extra)
                results[config.label].one_time_s = extra if extra > 0 else None

    def _flag_nondeterminism(
        self,
        baseline: _Config,
        results: dict[str, Variant],
        outputs: dict[str, numerics.Outputs],
        watched: tuple[set[str], dict],
    ) -> None:
        """A "changed" verdict only means something if the cell repeats itself: run the
        baseline once more and say so when two baseline runs already differ."""
        changed = [v for v in results.values() if v.numerics.verdict == "changed"]
        if not changed or BASELINE not in outputs:
            return
        again: dict[str, numerics.Outputs] = {}
        self._checked_run(baseline, again, watched)
        drift = numerics.compare(outputs[BASELINE], again.get(BASELINE, {}), 0.0)
        if drift.verdict in ("identical", "not-compared"):
            return
        note = (
            "the cell itself is not deterministic: two baseline runs from the same state "
            f"already differ (max rel diff {drift.max_rel_diff or float('nan'):.1e})"
        )
        for variant in changed:
            variant.numerics.detail = f"{variant.numerics.detail}; {note}"

    def _count_flops(self, baseline: _Config) -> None:
        """Model FLOPs of one untimed baseline run, once per session (a cell the counter
        cannot run under is measured all the same, with the reason noted)."""
        if self._flops is not None or self._flops_detail is not None:
            return
        try:
            self._flops = utilisation.count(functools.partial(self._one_run, baseline))
        except Exception as error:
            original = getattr(error, "original", error)
            self._flops_detail = (
                f"FLOPs not counted: the cell failed under FlopCounterMode "
                f"({type(original).__name__}: {original})"
            )

    def _add_throughput(self, configs: list[_Config], results: dict[str, Variant]) -> None:
        """Achieved TFLOP/s and share of peak for every measured configuration."""
        if self._flops is None:
            return
        device = self._observed().device
        peaks, _ = utilisation.peaks_for(device, _device_name(device))
        for config in configs:
            variant = results[config.label]
            if variant.error:
                continue
            got = utilisation.throughput(
                self._flops, variant.median_s, peaks, config.ids, _amp_dtype(config.fixes)
            )
            variant.flops = self._flops.total
            variant.achieved_tflops = got.achieved_tflops
            variant.utilisation = got.utilisation
            variant.peak_tflops = got.peak_tflops

    def _checked_run(
        self, config: _Config, outputs: dict[str, numerics.Outputs], watched: tuple[set[str], dict]
    ) -> int | None:
        """One untimed run that records peak memory and, from a restored start, outputs."""
        obs = self._observed()
        names, modules = watched
        captured: dict[str, numerics.Outputs] = {}

        def observe() -> None:
            if self._start_state is not None:
                captured["outputs"] = numerics.capture(self.workload.namespace, names, modules)

        if obs.ops is not None:  # the probe could profile, so memory profiling is safe too
            with memory.profiled(obs.device) as prof:
                self._one_run(config, observe)
            peak = prof.peak
        else:
            with memory.tracked(obs.device) as tracker:
                self._one_run(config, observe)
            peak = tracker.peak
        if "outputs" in captured:
            outputs[config.label] = captured["outputs"]
        self._memory_label = peak.label if peak else None
        return peak.bytes if peak else None

    def _watched_outputs(self) -> tuple[set[str], dict[str, torch.nn.Module]]:
        """Names the cell (re)bound and the models it ran: what numerics compares."""
        obs = self._observed()
        start = self._start_state.bindings if self._start_state else {}
        names = {
            name
            for name, value in self.workload.namespace.items()
            if not name.startswith("_") and start.get(name, _MISSING) is not value
        }
        modules = {
            entry.name: entry.obj
            for entry in discovery.top_level_modules(obs.found)
            if any(id(m) in obs.modules for m in entry.obj.modules())
        }
        return names, modules

    def _report_progress(self, fraction: float, message: str) -> None:
        if self.progress is not None:
            self.progress(fraction, message)

    # report ---------------------------------------------------------------------------------
    def _build_report(
        self, baseline: Variant, variants: list[Variant], budget: tuple[float, float]
    ) -> Report:
        """`budget`: (seconds, counted from) of this measurement, for budget_s/elapsed_s."""
        obs = self._observed()
        by_fix = {tuple(v.fixes): v for v in variants}

        def gain(detection: Detection) -> float:
            variant = by_fix.get((detection.finding.id,))
            return -(variant.speedup or 0.0) if variant and variant.speedup else 0.0

        findings = [d.finding for d in sorted(self.detections, key=gain)]
        return Report(
            environment=environment(obs.device, self._memory_label),
            baseline=Stats(
                baseline.median_s,
                baseline.iqr_s,
                baseline.runs,
                baseline.peak_memory_bytes,
                baseline.noisy,
                flops=baseline.flops,
                flops_breakdown=dict(self._flops.buckets) if self._flops else None,
                flops_detail=self._flops_detail,
                achieved_tflops=baseline.achieved_tflops,
                utilisation=baseline.utilisation,
                peak_tflops=baseline.peak_tflops,
            ),
            findings=findings,
            variants=variants,
            not_applicable=list(self.not_applicable),
            applied=self.applied_ids,
            warnings=list(self.warnings),
            cell=self.workload.source,
            run_id=self.run_id,
            budget_s=budget[0],
            elapsed_s=round(time.perf_counter() - budget[1], 3),
        )

    def _observed(self) -> probe.Observation:
        if self.observation is None:
            raise RuntimeError("probe() has not run yet")
        return self.observation


_MISSING = object()


def _uses_cuda(obs: probe.Observation) -> bool:
    for use in obs.modules.values():
        for tensor in use.module.parameters():
            return tensor.is_cuda
    return False


def environment(device: str, memory_label: str | None) -> dict[str, Any]:
    """Facts a reader needs to judge the numbers."""
    name = _device_name(device)
    peaks, source = utilisation.peaks_for(device, name)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "device_name": name,
        "cpu_count": os.cpu_count() or 1,
        "torch_threads": torch.get_num_threads(),
        "memory_measure": memory_label
        or (memory.CUDA_LABEL if device == "cuda" else memory.CPU_LABEL),
        "peak_tflops": peaks,
        "peak_tflops_source": source,
    }


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else _cpu_name()


def _amp_dtype(applied: list[fixes.Fix]) -> str | None:
    """The lower precision an autocast fix in `applied` runs matmuls in, if any."""
    for fix in applied:
        dtype = getattr(fix, "compute_dtype", None)
        if dtype is not None:
            return str(dtype).removeprefix("torch.")
    return None


def _cpu_name() -> str:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                for line in cpuinfo:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
    return platform.processor() or platform.machine() or "CPU"
