"""After the cell ran out of memory in the probe: does each memory fix make it fit?"""

from __future__ import annotations

from ..cell.workload import CellError
from ..kernel import discovery, fixes, state
from ..probe import memory, oom
from ..report import Variant
from . import figures
from .run import Config, Runner
from .runs import Hooks


def measure_fits(
    runner: Runner, tried: list[Config], failure: CellError | None, hooks: Hooks
) -> None:
    """After the cell ran out of memory: one run with each memory fix (`tried`), from
    the state before the cell to one step past the step that failed (the whole cell
    where it has no steps), says whether the fix makes the cell fit, with that run's
    peak memory and time. The kernel then goes back to what the failed run left, as
    the plain cell leaves it."""
    if not tried:
        return
    if runner.start_state is None:
        hooks.note(
            "the memory fixes were not run: without a snapshot of the state before the "
            "cell, a run with them would not start where the failed run started"
        )
        return
    failed = failure.original if failure is not None else None
    if failed is not None and oom.release_failed_run(failed, runner.workload):
        hooks.note(
            "to run the memory fixes, the tensors the failed run still held (the locals "
            "of the frames in its traceback, below the cell) were freed; the traceback "
            "still shows where it failed"
        )
    namespace = runner.workload.namespace
    try:
        left_by_failure = state.take(namespace, discovery.walk(namespace), runner.workload.source)
    except (MemoryError, OSError) as error:  # our snapshot did not fit either
        hooks.note(f"the memory fixes were not run: no memory for a snapshot ({error})")
        return
    hooks.publish()
    stop = runner.trace.count + 1 if runner.trace is not None else None
    # the probe's op stream is missing after a failure; a profiler of the user's own is not
    obs = runner.obs
    mine = obs.profiler_entries or obs.profiler_at_start
    watch = memory.tracked if mine else memory.profiled
    try:
        for config in tried:
            variant = Variant(fixes=config.ids)
            hooks.progress(0.0, f"does it fit with {config.label}?")
            try:
                run = runner.run(config, None, stop=stop, watched=watch(obs.device))
            except CellError as error:
                variant.fits = False if oom.is_out_of_memory(error.original) else None
                cause = "still out of memory" if variant.fits is False else "the cell raised"
                variant.error = f"{cause} with this fix: {figures.error_text(error.original)}"
            except fixes.FixError as error:
                variant.error = f"the fix could not be applied: {error.reason}"
            else:
                peak = run.watched.peak if run.watched is not None else None
                variant.fits, variant.median_s, variant.runs = True, run.total_s, 1
                variant.peak_memory_bytes = peak.bytes if peak is not None else None
            variant.measured_at = figures.now()
            hooks.measured(variant)
            hooks.publish()
    finally:
        left_by_failure.restore()
