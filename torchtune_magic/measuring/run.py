"""One run of the cell from the state it started from (snapshot S0), with a configuration's
fixes applied, to its end or to a step; and the kernel kept as it was around the runs of a
measurement."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from ..cell.workload import Workload, silenced
from ..distributed import lockstep
from ..kernel import allocator, discovery, fixes, plain_stack, state
from ..probe import steps
from ..probe.observation import Observation, StepTrace
from ..report import count
from . import losses, time_split, timing


@dataclass
class Config:
    """One configuration to measure: a label and the fixes it applies."""

    label: str
    fixes: list[fixes.Fix]

    @property
    def ids(self) -> list[str]:
        return sorted(f.check_id for f in self.fixes)


@dataclass
class RunTime:
    """One measuring run: its seconds and, when sampled, the time to the end of the warm-up
    steps and the mean time per timed step."""

    total_s: float
    lead_s: float | None = None
    step_s: float | None = None
    watched: Any = None  # what the run's `watched` context gave (a memory Profile, …)
    faults: int = 0  # minor page faults during the run
    restart_s: float | None = None  # an epoch restart's cost, where the timed steps held one
    # this rank's own time (per step when sampled); the others are the slowest rank's
    # under torchrun (`distributed/lockstep.py`), this process's alone otherwise
    own_s: float | None = None
    # an observed run's seconds in each part (`measuring/time_split.py`)
    split: dict[str, float] | None = None


@contextmanager
def _applied_on_every_rank(config: Config, namespace: dict[str, Any]) -> Iterator[None]:
    """The config's fixes applied; under torchrun, on every rank or none: a fix that cannot
    be applied on one rank (FixError there) stops the run on all of them before the cell
    issues a collective (lockstep.RankFailed elsewhere)."""
    with ExitStack() as stack:
        try:
            stack.enter_context(fixes.applied(config.fixes, namespace))
        except fixes.FixError:
            lockstep.all_ok(False, f"{config.label}: its fix could not be applied there")
            raise
        lockstep.all_ok(True, f"{config.label}: its fix could not be applied there")
        yield


class Runner:
    """Runs the cell of `workload` from `start_state` (without one, from the torch modes
    it started in). Says what the runs make worth saying through `warn`."""

    def __init__(
        self,
        workload: Workload,
        obs: Observation,
        trace: StepTrace | None,
        start_state: state.Snapshot | None,
        start_switches: state.TorchSwitches,
        stack: plain_stack.PlainStack,
        warn: Callable[[str], None],
    ):
        self.workload, self.obs, self.trace = workload, obs, trace
        self.start_state, self.start_switches = start_state, start_switches
        # the stack a plain run of the cell would execute under: timed runs of a cell whose
        # cost depends on it execute there (`_measuring_stack`)
        self.plain_stack = stack
        self.warn = warn
        self.give_up_at: float | None = None  # a run to a step past this stops (measuring)

    def run(
        self,
        config: Config,
        sample: steps.SamplePlan | None,
        observe: Callable[[list[float]], Any] | None = None,
        stop: int | None = None,
        watched: AbstractContextManager[Any] | None = None,
    ) -> RunTime:
        """Run the cell once from the start state with the config's fixes applied; with
        `stop`, the run ends after that step (counted as `sample` says, when sampled;
        `observe` sees the state there, and the loss of each backward call the run made:
        only an observed run records it, at ~2 µs a step, and where its time went).
        `watched` (peak memory, FLOPs) opens once the start state is back, so what the
        previous run left and the restore frees is not counted against this run. A run to a
        step stops at the step boundary where one more step as long as the last would end
        past the measurement's deadline, and raises timing.OutOfTime (a fix that makes the
        cell far slower than foreseen does not overrun the budget).

        A measuring run of a cell whose cost depends on the stack (anomaly detection on)
        executes the cell under the stack a plain run of it has (`plain_stack`)."""
        __tracebackhide__ = True
        if self.start_state is not None:
            self.start_state.restore(written_only=True)
        else:  # no snapshot: each run still starts in the modes the cell started in
            self.start_switches.restore()
        namespace = self.workload.namespace
        source = fixes.combined_source(self.workload.source, config.fixes)
        counter = None
        plan = sample
        timed_run = plan is not None and stop == plan.stop  # not a short profiled run
        if stop is not None and plan is not None:
            epoch_end = plan.epoch_end if timed_run else None
            counter = steps.StepCounter(
                plan.source,
                warmup=plan.warmup,
                stop=stop,
                epoch_end=epoch_end,
                give_up_at=self.give_up_at,
            )
        elif stop is not None and self.trace is not None:  # a run to a step, untimed
            counter = steps.StepCounter(
                steps.source_of(self.obs, self.trace),
                stop=stop,
                give_up_at=self.give_up_at,
            )
        with (
            watched or nullcontext() as seen,
            _applied_on_every_rank(config, namespace),
            fixes.combined_context(config.fixes, namespace, in_cell=False),
            silenced(),
            counter.counting() if counter else nullcontext() as times,
        ):
            started, faults = time.perf_counter(), allocator.minor_faults()
            in_cell = fixes.combined_context(config.fixes, namespace, in_cell=True)
            recorder, split = losses.Recorder(), time_split.SplitRecorder()
            if observe is not None:
                in_cell = time_split.recorded(losses.recorded(in_cell, recorder), split)
            loop_keys = counter.source.loop_keys if counter else frozenset()
            try:
                seconds = self.workload.run(
                    source, self._measuring_stack(config), in_cell, loop_keys
                )
            except steps.StepLimitReached:
                seconds = time.perf_counter() - started
            faults = allocator.minor_faults() - faults
            if times is not None and times.gave_up:
                raise timing.OutOfTime(f"{config.label}: stopped at step {times.count}")
            if observe is not None:
                observe(recorder.curve())
        parts = split.split() if observe is not None else None
        if times is None or plan is None:
            total = lockstep.slowest(seconds)
            return RunTime(total, watched=seen, faults=faults, own_s=seconds, split=parts)
        per_epoch = plan.per_epoch if timed_run else None
        step_s = times.per_step(plan.warmup, per_epoch)
        if not times.stopped and times.lead_s is not None and times.count > plan.warmup:
            step_s = (seconds - times.lead_s) / (times.count - plan.warmup)
            self.warn(
                f"{config.label}: the run ended after {times.count} steps, before step {stop}; "
                "its per-step time includes what runs after the last step"
            )
        restart_s = times.restart(plan.warmup) if per_epoch else None
        # under torchrun a step ends when the slowest rank's does
        agreed = lockstep.slowest_of([seconds, times.lead_s, step_s, restart_s])
        total_s, lead_s, agreed_step_s, agreed_restart_s = agreed
        assert total_s is not None
        own_s = step_s if step_s is not None else seconds
        return RunTime(total_s, lead_s, agreed_step_s, seen, faults, agreed_restart_s, own_s, parts)

    def _measuring_stack(self, config: Config) -> plain_stack.PlainStack | None:
        """The stack a measuring run executes the cell under: the plain cell's where the
        run's cost follows it (anomaly detection, which stores the Python stack with every
        autograd node, seen on in the probe and not turned off by the config's fixes) and a
        stack of its own can be had; else where it stands. (A run on a stack of its own
        pays ~0.1 ms to start it, so runs whose cost does not follow the stack stay.)"""
        obs = self.obs
        follows = bool(obs.forward_with_anomaly or obs.backward_with_anomaly)
        if not follows or any(fix.ends_stack_cost for fix in config.fixes):
            return None
        return self.plain_stack if plain_stack.fresh_stack_available() else None

    @contextmanager
    def state_kept(self, from_start: bool) -> Iterator[None]:
        """Whatever happens while measuring, the kernel ends as it was — with what the user
        did since the cell ran — except for a probe's leftovers from part of a run, which
        give way to the state before the cell (`from_start`: the complete run starts from
        there). Without a snapshot, torch's global modes still go back (they cost nothing
        to keep)."""
        if self.start_state is None:
            switches = state.TorchSwitches.capture()
            try:
                yield
            finally:
                switches.restore()
            return
        current = None
        if not from_start:
            namespace = self.workload.namespace
            current = state.take(namespace, discovery.walk(namespace), self.workload.source)
        try:
            yield
        finally:
            self._note_unseen_writes()
            if current is not None:
                current.restore()
            else:
                self.start_state.restore()

    def _note_unseen_writes(self) -> None:
        """Say so when a measuring run wrote a tensor the probe had left as it was, in a way
        torch does not see: the restores between runs passed over it (`Snapshot.
        note_unwritten`), so the runs after that write started from its changed values."""
        if self.start_state is None:
            return
        for label in self.start_state.written_unseen_objects():
            self.warn(
                f"a measuring run changed `{label}` in place in a way the restores between "
                "runs passed over (its length and ends unchanged), so the runs after it "
                "started from the changed contents; it is back as it was now"
            )
        changed = self.start_state.written_unseen()
        if changed:
            shapes = ", ".join(str(tuple(t.shape)) for t in changed[:3])
            self.warn(
                f"a measuring run wrote {count(len(changed), 'tensor')} of shape {shapes} that the "
                "probe's run had left as they were, in a way torch does not see (through "
                "`.data` or numpy), so the runs after it started from the changed values; "
                "they are back as they were now"
            )
