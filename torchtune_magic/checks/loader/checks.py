"""The two loader checks, dataloader-workers and pin-memory: when a loader is flagged, the
evidence and advice they give, and the fix each one offers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...cell import codeedit
from ...distributed import lockstep
from ...probe import cpu, frameworks
from ...report import DATA_WAIT, OTHER, CodeChange, count
from ..base import Check, Detection
from .edits import class_names, non_blocking_edit, with_keywords
from .fixes import PinMemoryFix, TrainerPinMemoryFix, TrainerWorkersFix, WorkersFix
from .pickling import why_no_workers
from .rebuild import plan_for
from .target import Target, earlier_edit, locate
from .trial import TRIAL_BUDGET_S, Epoch, Trial, in_process, pick_workers

if TYPE_CHECKING:
    from ...probe.observation import LoaderUse, Observation

WAIT_SHARE = 0.05  # torch-tb-profiler's threshold for "data loading is a bottleneck"
# Handing a batch from a worker to the main process costs on the order of a millisecond
# (pickling through shared memory, a queue round trip): a loader that already delivers a
# batch faster than this cannot gain from workers, whatever its share of the cell.
MIN_BATCH_WAIT_S = 0.001
WORKERS_CAVEAT = (
    "workers hold a copy of the dataset made when they start: later changes to the dataset "
    "are not seen until the loader is rebuilt; random augmentation inside the dataset draws "
    "from per-worker seeds, so its random numbers differ from the in-process run"
)


TRAINER_WORKERS_CAVEAT = (
    "; with dataloader_persistent_workers=True torch draws the workers' base seed from the "
    "global random stream for the first epoch of each train() only, so from the second "
    "epoch on dropout and shuffling draw numbers one place apart from a run without "
    "workers: results differ as with another seed, not in quality"
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def lines_text(lines: set[int] | list[int]) -> str:
    """Cell lines as a finding names them: "line 3", "lines 2, 5"."""
    ordered = sorted(lines)
    return ("line " if len(ordered) == 1 else "lines ") + ", ".join(map(str, ordered))


def _trials_text(trials: list[Trial]) -> str:
    parts = []
    for trial in trials:
        label = f"{trial.workers} worker{'s' if trial.workers > 1 else ''}"
        if trial.per_batch_s is not None:
            parts.append(f"{label} {_ms(trial.per_batch_s)}/batch")
        else:
            parts.append(f"{label} failed ({trial.error})")
    return "; ".join(parts)


def _cores_text(trials: list[Trial], loading: Epoch, cores: cpu.Cores) -> str:
    """Why the trial went up to the counts it did: the cores this process may use, and
    beyond them only for loading that waits on I/O (with the measurement that says so)."""
    text = f"workers tried up to the {cores.count} cores this process may use ({cores.detail})"
    above = [t.workers for t in trials if t.workers > cores.count]
    if above:
        text += (
            f", and {above[0]} because the loading waits on I/O: it kept the main process "
            f"busy {loading.cpu_share:.0%} of the time, and workers overlap such waits beyond "
            "the core count"
        )
    return text


class WorkersCheck(Check):
    id = "dataloader-workers"
    title = "Batches are loaded in the main process (num_workers=0) while the cell waits"
    guide = "Enable asynchronous data loading and augmentation"
    threshold = (
        f"waiting for batches ≥ {WAIT_SHARE:.0%} of the cell's time (torch-tb-profiler's "
        f"bar) and ≥ {MIN_BATCH_WAIT_S * 1e3:.0f} ms per batch (about a worker's hand-off)"
    )

    def detect(self, obs: Observation) -> list[Detection]:
        detections = []
        for use in obs.loaders.values():
            if use.loader.num_workers != 0 or not use.batches or not obs.wall_s:
                continue
            share = lockstep.mean(use.wait_s / obs.wall_s)
            if share < WAIT_SHARE:
                continue
            loading = in_process(use.loader, use.batches)
            if loading is None or loading.per_batch_s < MIN_BATCH_WAIT_S:
                continue  # cheap loading (in-memory tensors): workers would only add IPC
            detections.append(self._detection(obs, use, share, loading))
        return detections

    def _detection(
        self, obs: Observation, use: LoaderUse, share: float, loading: Epoch
    ) -> Detection:
        loader = use.loader
        target = locate(obs, use)
        evidence = (
            f"batches waited {share:.0%} of the run ({use.wait_s:.2f} s of {obs.wall_s:.2f} s)"
        )
        details = (
            f"over {count(use.batches, 'batch', 'batches')}, loaded in the main process "
            f"({_ms(loading.per_batch_s)} per batch timed without instrumentation)"
        )
        blocked = why_no_workers(loader)
        workers = None
        plan = None
        cores = cpu.available_cores()
        if blocked is None:
            plan = plan_for(loader, target.locations)
            seconds = obs.trial_time(TRIAL_BUDGET_S)
            workers, trials = pick_workers(plan, use, loading, cores.count, seconds)
            details += (
                f"; quick trial: {_trials_text(trials)}; {_cores_text(trials, loading, cores)}"
            )
            if workers is None:
                blocked = "no worker count could load a batch in the trial"
            else:
                startup = next(t.startup_s for t in trials if t.workers == workers)
                details += f"; {workers} chosen (start-up {startup:.2f} s, once)"
        reason = target.unreachable or blocked
        shown_k = workers if workers is not None else min(2, cores.count)
        if target.trainer is not None:
            if plan is not None:
                plan.close()  # the trial's loaders: the Trainer builds its own from its args
            return self._trainer_detection(obs, target, evidence, details, workers, shown_k, reason)
        values = {"num_workers": str(shown_k), "persistent_workers": "True"}
        source = obs.workload.source
        fixed = None
        elsewhere = []
        cell_edit = None
        if target.cell_call is not None and use.built_line is not None:
            line, names = use.built_line, class_names(loader)

            def cell_edit(text: str) -> str:
                return with_keywords(text, line, names, values)

            fixed, notes = codeedit.edited(source, cell_edit)
            if notes:  # the loader the cell builds cannot be changed in its text
                fixed, cell_edit, reason = None, None, reason or notes[0]
                elsewhere += notes
        earlier = earlier_edit(obs, target, values) if target.cell_call is None else None
        if target.cell_call is None and earlier is None:
            elsewhere.append(
                f"{target.name}: build it with {type(loader).__name__}(..., "
                f"num_workers={shown_k}, persistent_workers=True)"
            )
        fix = None
        if reason is not None:
            details += f"; not applied live: {reason}"
        elif workers is not None:
            overrides = {"num_workers": workers, "persistent_workers": True}
            # a loader the cell builds itself is changed in the cell text, not swapped
            fix = WorkersFix(overrides, None if cell_edit else plan, cell_edit).bounded_by(share)
        if plan is not None and (fix is None or fix.plan is None):
            plan.close()  # no live swap will use the trial loaders: stop their workers
        where = _where_iterated(target)
        return Detection(
            self.finding(
                evidence=evidence,
                details=details,
                segment=DATA_WAIT,
                where=where,
                fixable=fix is not None,
                line=use.built_line or (min(use.lines) if use.lines else None),
                caveat=WORKERS_CAVEAT,
                code_change=CodeChange(
                    codeedit.unified_diff(source, fixed) if fixed else "", elsewhere
                ),
            ),
            fix,
            fixed,
            [earlier] if earlier else [],
        )

    def _trainer_detection(
        self,
        obs: Observation,
        target: Target,
        evidence: str,
        details: str,
        workers: int | None,
        shown_k: int,
        reason: str | None,
    ) -> Detection:
        """A loader a Hugging Face Trainer builds: found, fixed and changed through its
        `TrainingArguments`."""
        owner = target.trainer
        assert owner is not None
        use = target.use
        values = {"dataloader_num_workers": str(shown_k), "dataloader_persistent_workers": "True"}
        details += (
            f"; {owner.name} builds this loader on every call from its arguments, "
            f"{owner.args_class}(dataloader_num_workers={use.loader.num_workers})"
        )
        earlier = frameworks.args_edit(obs.workload, owner, values)
        elsewhere = [] if earlier else [f"{owner.name}'s arguments: {owner.call_text(values)}"]
        fix = None
        if reason is not None:
            details += f"; not applied live: {reason}"
        elif workers is not None:
            overrides = {"dataloader_num_workers": workers, "dataloader_persistent_workers": True}
            fix = TrainerWorkersFix(overrides, frameworks.args_plan(owner))
        where = _where_iterated(target)
        return Detection(
            self.finding(
                evidence=evidence,
                details=details,
                segment=DATA_WAIT,
                where=where,
                fixable=fix is not None,
                line=min(use.lines) if use.lines else None,
                caveat=WORKERS_CAVEAT + TRAINER_WORKERS_CAVEAT,
                code_change=CodeChange("", elsewhere),
            ),
            fix,
            None,
            [earlier] if earlier else [],
        )


class PinMemoryCheck(Check):
    id = "pin-memory"
    title = "Batches are copied to the GPU from pageable memory (pin_memory=False)"
    guide = "Use pinned memory buffers"
    devices = ("cuda",)

    def detect(self, obs: Observation) -> list[Detection]:
        detections = []
        for use in obs.loaders.values():
            if use.loader.pin_memory or not use.device_copies:
                continue
            detections.append(self._detection(obs, use))
        return detections

    def _detection(self, obs: Observation, use: LoaderUse) -> Detection:
        loader = use.loader
        target = locate(obs, use)
        if target.trainer is not None:
            return self._trainer_detection(obs, target)
        source = obs.workload.source
        copy_lines = set(use.copy_lines)

        def cell_edit(text: str) -> str:
            if target.cell_call is not None and use.built_line is not None:
                text = with_keywords(
                    text, use.built_line, class_names(loader), {"pin_memory": "True"}
                )
            return non_blocking_edit(text, copy_lines)

        fixed, notes = codeedit.edited(source, cell_edit)
        elsewhere = list(notes)
        earlier = None
        if target.cell_call is None:
            earlier = earlier_edit(obs, target, {"pin_memory": "True"})
        if target.cell_call is None and earlier is None:
            elsewhere.append(
                f"{target.name}: build it with {type(loader).__name__}(..., pin_memory=True)"
            )
        if not copy_lines:
            elsewhere.append("copy batches with .to(device, non_blocking=True)")
        fix = None
        if target.unreachable is None and not (notes and target.cell_call is not None):
            plan = None if target.cell_call is not None else plan_for(loader, target.locations)
            fix = PinMemoryFix({"pin_memory": True}, plan, cell_edit)
        evidence = _pageable_text(use)
        details = f"of them, {use.non_blocking_copies} with non_blocking=True"
        if target.unreachable is not None:
            details += f"; not applied live: {target.unreachable}"
        where = target.name
        if copy_lines:
            where += f", copied at cell {lines_text(copy_lines)}"
        return Detection(
            self.finding(
                evidence=evidence,
                details=details,
                segment=OTHER,  # the copies run in the cell's code, after the batch came
                where=where,
                fixable=fix is not None,
                line=min(copy_lines) if copy_lines else use.built_line,
                caveat="pinned memory is page-locked host RAM: very large pinned batches "
                "reduce the memory left to the rest of the system",
                code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
            ),
            fix,
            fixed,
            [earlier] if earlier else [],
        )

    def _trainer_detection(self, obs: Observation, target: Target) -> Detection:
        """A Hugging Face Trainer's loader: pinned through `dataloader_pin_memory`, its
        copies made non-blocking through accelerate's `non_blocking` setting."""
        owner = target.trainer
        assert owner is not None
        use = target.use
        values = {"dataloader_pin_memory": "True"}
        earlier = frameworks.args_edit(obs.workload, owner, values)
        elsewhere = [] if earlier else [f"{owner.name}'s arguments: {owner.call_text(values)}"]
        elsewhere.append(
            "the Trainer copies batches itself: "
            f"{owner.args_class}(..., accelerator_config={{'non_blocking': True}}) makes those "
            "copies non-blocking"
        )
        details = (
            f"of them, {use.non_blocking_copies} with non_blocking=True; {owner.name} builds this "
            f"loader on every call from {owner.args_class}(dataloader_pin_memory=False)"
        )
        return Detection(
            self.finding(
                evidence=_pageable_text(use),
                details=details,
                segment=OTHER,  # the Trainer copies each batch in its step, after it came
                where=target.name,
                fixable=True,
                line=min(use.lines) if use.lines else None,
                caveat="pinned memory is page-locked host RAM: very large pinned batches "
                "reduce the memory left to the rest of the system",
                code_change=CodeChange("", elsewhere),
            ),
            TrainerPinMemoryFix({"dataloader_pin_memory": True}, frameworks.args_plan(owner)),
            None,
            [earlier] if earlier else [],
        )


def _pageable_text(use: LoaderUse) -> str:
    """`24 batch tensors from 12 batches were copied to the GPU from pageable memory`."""
    return (
        f"{count(use.device_copies, 'batch tensor')} from "
        f"{count(use.batches, 'batch', 'batches')} "
        f"{'was' if use.device_copies == 1 else 'were'} copied to the GPU from pageable memory"
    )


def _where_iterated(target: Target) -> str:
    """The loader's name and the cell lines that iterate it: where both workers findings
    (the cell's own loader, a Trainer's) say the loader is."""
    if not target.use.lines:
        return target.name
    return f"{target.name}, iterated at cell {lines_text(target.use.lines)}"
