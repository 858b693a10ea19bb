"""Debug APIs left on during real work: anomaly mode, profilers, gradcheck.

The guide: "Disable debugging APIs" — anomaly detection, the autograd profiler / NVTX, and
gradcheck cost time on every step and belong in debugging sessions, not training runs.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..cell import codeedit, history
from ..kernel.fixes import Fix, FixError, Patcher, patched
from ..probe.memory import _native_stderr_silenced
from ..report import BACKWARD, FORWARD, OTHER, CodeChange, count
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import Observation

GUIDE = "Disable debugging APIs"
ANOMALY_NAMES = {"detect_anomaly", "set_detect_anomaly"}
PROFILER_CALLS = {"profile", "emit_nvtx", "emit_itt"}
GRADCHECK_NAMES = {"gradcheck", "gradgradcheck"}


def _enables(call: ast.Call) -> bool:
    """False only for an explicit off switch such as `set_detect_anomaly(False)`."""
    args = [*call.args, *(k.value for k in call.keywords if k.arg in ("mode", "enabled"))]
    return not (args and isinstance(args[0], ast.Constant) and args[0].value is False)


def _strip_calls(
    source: str, tree: ast.Module, names: set[str]
) -> tuple[str, list[int], list[str]]:
    """Remove statements calling `names` and unwrap `with` blocks using them.

    Returns the new source, the 1-based lines that were touched, and a note where the
    edit cannot be made (the source then stays as it is). Edits run bottom-up so
    earlier line numbers stay valid.
    """
    targets: list[tuple[int, ast.stmt]] = []
    for call in codeedit.calls_named(tree, names):
        if not _enables(call):
            continue
        stmt = codeedit.statement_of(tree, call)
        if stmt is None:
            continue
        if isinstance(stmt, ast.With) and any(item.context_expr is call for item in stmt.items):
            if len(stmt.items) == 1:
                targets.append((stmt.lineno, stmt))
        elif isinstance(stmt, (ast.Expr, ast.Assign)):
            targets.append((stmt.lineno, stmt))
    lines = sorted({line for line, _ in targets})

    def strip(text: str) -> str:
        for _, stmt in sorted(targets, key=lambda t: -t[0]):
            if isinstance(stmt, ast.With):
                text = codeedit.unwrap_with(text, stmt)
            else:
                text = codeedit.remove_statement(text, tree, stmt)
        return text

    fixed, notes = codeedit.edited(source, strip)
    return fixed, lines, notes


def _lines_text(lines: list[int] | set[int]) -> str:
    ordered = sorted(lines)
    return ("line " if len(ordered) == 1 else "lines ") + ", ".join(map(str, ordered))


def _cells_text(edits: list[history.RemovedCall]) -> str:
    """Earlier cells' lines as a finding names them: "In[2] line 1, In[4] lines 2, 5"."""
    lines: dict[int, set[int]] = {}
    for edit in edits:
        lines.setdefault(edit.execution_count, set()).add(edit.line)
    return ", ".join(f"In[{cell}] {_lines_text(lines[cell])}" for cell in sorted(lines))


# anomaly mode -------------------------------------------------------------------------------


class _NoAnomaly:
    """Stands in for detect_anomaly / set_detect_anomaly: accepts the call, changes nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, func: Any) -> Any:  # used as a decorator
        return func


def _patch_everywhere(
    patcher: Patcher, namespace: dict[str, Any], owners: list[Any], name: str, value: Any
) -> None:
    original = getattr(owners[0], name)
    for owner in owners:
        patcher.setattr(owner, name, value)
    patcher.replace_everywhere(namespace, original, value)


def _replaced_while_running(
    namespace: dict[str, Any], owners: list[Any], names: set[str], value: Any
) -> contextlib.AbstractContextManager[Any]:
    """A run context in which each API `name` of `owners` (and any namespace name bound to
    it, e.g. after `from torch.autograd import gradcheck`) is `value`."""

    def build(patcher: Patcher) -> None:
        for name in names:
            _patch_everywhere(patcher, namespace, owners, name, value)

    return patched(build)


class AnomalyOffFix(Fix):
    """Anomaly mode off: globally now, and the cell's own calls turned into no-ops."""

    check_id = "debug-anomaly"
    ends_stack_cost = True

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        if torch.is_anomaly_enabled():
            check_nan = torch.is_anomaly_check_nan_enabled()
            patcher.call(
                lambda: torch.set_anomaly_enabled(False),
                lambda: torch.set_anomaly_enabled(True, check_nan),
            )

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        owners = [torch.autograd, sys.modules["torch.autograd.anomaly_mode"]]
        return _replaced_while_running(namespace, owners, ANOMALY_NAMES, _NoAnomaly)


def _autograd_share(obs: Observation) -> float | None:
    """The share of the probe's run anomaly mode can have slowed: all but the waits for
    batches (it records a stack per autograd node and checks each gradient for NaN, work a
    loader's wait holds none of). Loose, and leaning towards the fix (the probe's hooks
    stretch the compute, not the waits), but it orders anomaly mode after a loader fix whose
    waits promise more."""
    if not obs.wall_s:
        return None
    waited = sum(use.wait_s for use in obs.loaders.values())
    return max(0.0, 1.0 - waited / obs.wall_s)


class AnomalyCheck(Check):
    id = "debug-anomaly"
    title = "Anomaly detection is on during the work"
    guide = GUIDE

    def detect(self, obs: Observation) -> list[Detection]:
        seen = obs.backward_with_anomaly or obs.forward_with_anomaly or obs.anomaly_at_start
        if not seen:
            return []
        source = obs.workload.source
        fixed, lines, notes = _strip_calls(source, obs.tree, ANOMALY_NAMES)
        # an earlier cell that turned it on and left it on: that call goes too
        earlier = []
        if obs.anomaly_at_start:
            earlier = history.switched_on(obs.workload.notebook, {"set_detect_anomaly"}, _enables)
        forwards = sum(use.calls for use in obs.modules.values())
        if obs.backward_calls:
            evidence = (
                f"anomaly mode was on for {obs.backward_with_anomaly} of "
                f"{count(obs.backward_calls, 'backward pass', 'backward passes')}"
            )
        elif forwards:
            evidence = (
                f"anomaly mode was on for {obs.forward_with_anomaly} of "
                f"{count(forwards, 'module call')}"
            )
        else:
            evidence = "anomaly mode was on for the whole cell"
        details = []
        if obs.backward_calls and forwards:
            on = obs.forward_with_anomaly
            details.append(f"{on} of {count(forwards, 'module call')} ran with it on")
        elsewhere = list(notes)
        where = []
        if lines:
            details.append(f"enabled at cell {_lines_text(lines)}")
            where.append(f"cell {_lines_text(lines)}")
        if earlier:
            cells = _cells_text(earlier)
            details.append(f"already on when the cell started: enabled at {cells}")
            where.append(cells)
        elif obs.anomaly_at_start and not lines:
            details.append("already on when the cell started: enabled in an earlier cell")
            where.append("global anomaly mode, set before this cell")
            elsewhere.append(
                "remove torch.autograd.set_detect_anomaly(True) from the cell that enabled it"
            )
        if not where:
            where.append("code called from this cell")
            elsewhere.append("remove detect_anomaly / set_detect_anomaly from the code it calls")
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details="; ".join(details) or None,
                    where="; ".join(where),
                    fixable=True,
                    line=lines[0] if lines else None,
                    segment=BACKWARD if obs.backward_with_anomaly else FORWARD,
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
                ),
                AnomalyOffFix().bounded_by(_autograd_share(obs)),
                fixed,
                list(earlier),
            )
        ]


# profilers ----------------------------------------------------------------------------------


def _silent_kineto_profile() -> type:
    from torch.autograd.profiler_util import EventList

    class SilentProfile(torch.profiler.profile):
        """torch.profiler.profile that records nothing (results are empty, not missing)."""

        def start(self) -> None:
            return None

        def stop(self) -> None:
            return None

        def step(self) -> None:
            return None

        def events(self) -> EventList:
            return EventList([])

        def key_averages(self, *args: Any, **kwargs: Any) -> EventList:
            return EventList([])

    return SilentProfile


def _disabled(cls: type) -> type:
    """A subclass of a legacy profiler context whose `enabled` is always False."""

    class Disabled(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["enabled"] = False
            if args:
                args = (False, *args[1:])
                kwargs.pop("enabled")
            super().__init__(*args, **kwargs)

    Disabled.__name__ = f"Disabled{cls.__name__}"
    return Disabled


class ProfilersOffFix(Fix):
    """Profiler entry points become inert while the cell runs."""

    check_id = "debug-profiler"

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        def build(patcher: Patcher) -> None:
            kineto_owners = [torch.profiler, sys.modules["torch.profiler.profiler"]]
            _patch_everywhere(
                patcher, namespace, kineto_owners, "profile", _silent_kineto_profile()
            )
            legacy = torch.autograd.profiler
            for name in ("profile", "emit_nvtx", "emit_itt"):
                disabled = _disabled(getattr(legacy, name))
                _patch_everywhere(patcher, namespace, [legacy], name, disabled)

        return patched(build)


def _recording(profiler: Any) -> bool:
    """Whether a torch.profiler.profile / torch.autograd.profiler.profile is mid-recording."""
    if isinstance(profiler, torch.profiler.profiler._KinetoProfile):
        profiler = profiler.profiler
    return (
        isinstance(profiler, torch.autograd.profiler.profile)
        and profiler.entered
        and profiler.profiling_start_time_ns > profiler.profiling_end_time_ns
    )


def _user_profilers(namespace: dict[str, Any]) -> list[tuple[str, Any]]:
    """Recording profilers the user keeps in the namespace (`prof = profile(); prof.start()`)."""
    return [
        (name, value)
        for name, value in namespace.items()
        if not name.startswith("_")
        and isinstance(
            value, (torch.profiler.profiler._KinetoProfile, torch.autograd.profiler.profile)
        )
        and _recording(value)
    ]


def _kineto_on() -> bool:
    """A Kineto profiler (torch.profiler / torch.autograd.profiler) is on, NVTX/ITT aside."""
    return bool(torch.autograd._profiler_enabled()) and (
        torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.KINETO
    )


def _toggle(enable: bool, activities: set[Any]) -> None:
    """torch's own pause/resume of a running profiler's collection (the C++ side prints a
    warning on each toggle, which would land in the user's notebook)."""
    with _native_stderr_silenced():
        torch.autograd.profiler._toggle_collection_dynamic(enable, activities)


_THREAD_STATE_WORDS = 64  # how far into CPython's PyThreadState to look for the tracer


class _PythonTracer:
    """torch's Python tracer (`with_stack=True`) on this thread, taken off and put back.

    torch's pause stops op collection only: the tracer stays installed as this thread's
    C-level profile function and records every Python call and return (a quarter of the
    cell's time on a loop of small modules, and events in the trace during the pause).
    Python can remove a C profile function (`sys.setprofile(None)`) but cannot read it, so
    the function is read from the thread state: CPython (3.10 to 3.13) keeps
    `c_profilefunc` two pointers before `c_profileobj`, and `c_profileobj` is found as the
    tracer's context object itself. `PyEval_SetProfile` puts both back.
    """

    def __init__(self, function: int, context: Any):
        self.function = function
        self.context = context  # held here: sys.setprofile(None) drops the thread's reference
        self.thread = threading.get_ident()

    @classmethod
    def installed(cls) -> _PythonTracer | None:
        """The tracer profiling this thread, or None (no `with_stack`, or another hook)."""
        context = sys.getprofile()
        if type(context).__name__ != "TraceContext":
            return None
        thread_state = ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyThreadState_Get", ctypes.pythonapi))
        words = (ctypes.c_void_p * _THREAD_STATE_WORDS).from_address(thread_state())
        for index in range(2, _THREAD_STATE_WORDS):
            if words[index] == id(context) and words[index - 2]:
                return cls(words[index - 2], context)
        return None

    def take_off(self) -> None:
        sys.setprofile(None)

    def put_back(self) -> None:
        """Reinstall the tracer on the thread it was taken from, unless something else
        profiles that thread now."""
        if threading.get_ident() != self.thread or sys.getprofile() is not None:
            return
        set_profile = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.py_object)(
            ("PyEval_SetProfile", ctypes.pythonapi)
        )
        set_profile(self.function, self.context)


def _while_recording(session: Any, action: Callable[[], None]) -> Callable[[], None]:
    """`action`, done only while `session` still records: undoing a pause must not restart
    what the user stopped meanwhile (a stopped tracer's context points at freed memory)."""

    def run() -> None:
        if _recording(session):
            action()

    return run


class ProfilerPausedFix(Fix):
    """A profiler started before the cell stops recording: around each measured run, and
    for as long as the fix stays applied. Undo resumes recording into the same trace —
    unless that profiler has been stopped meanwhile, when there is nothing to resume (and a
    newer one is left alone).

    torch's `toggle_collection_dynamic` takes the op callbacks away; a paused profiler of a
    known object also loses what that toggle leaves recording each call: its Python tracer
    (`with_stack`) and its execution trace observer. Only `profile_memory`'s allocation
    events cannot be paused from Python (the C++ profiler state reports them while it
    exists); the caveat says so.
    """

    check_id = "debug-profiler"
    paused: ClassVar[int] = 0  # profilers held paused by these fixes right now

    def __init__(self, profiler: Any | None):
        super().__init__()
        self.profiler = profiler  # the user's object, when found in the namespace

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        if not _kineto_on() or (self.profiler is not None and not _recording(self.profiler)):
            raise FixError(self.check_id, "the profiler started before this cell is stopped now")
        session = self._session()
        toggled = {torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA}
        activities = set(getattr(session, "kineto_activities", ())) & toggled
        activities = activities or {torch.profiler.ProfilerActivity.CPU}

        def pause() -> None:
            _toggle(False, activities)
            ProfilerPausedFix.paused += 1

        def resume() -> None:
            ProfilerPausedFix.paused -= 1
            if _kineto_on() and (session is None or _recording(session)):
                _toggle(True, activities)

        patcher.call(pause, resume)
        if session is None:
            return  # the tracer and the observer of an unknown recording stay as they are
        tracer = _PythonTracer.installed()
        if tracer is not None:
            patcher.call(tracer.take_off, _while_recording(session, tracer.put_back))
        observer = getattr(self.profiler, "execution_trace_observer", None)
        if observer is not None and observer.is_running():
            patcher.call(observer.stop, _while_recording(session, observer.start))

    def _session(self) -> Any | None:
        """The autograd profiler object of this recording (a torch.profiler.profile makes a
        new one per start, so identity tells this recording from a later one)."""
        profiler = self.profiler
        if isinstance(profiler, torch.profiler.profiler._KinetoProfile):
            return profiler.profiler
        return profiler


PAUSE_CAVEAT = (
    "measured with {name} not recording during this fix's runs and recording again after: "
    "its trace has a gap there, and it holds the probe's and the baseline's runs of this cell. "
    "Left on, the fix keeps {name} paused: it records nothing more, what it recorded stays in "
    "it ({stop}, then export_chrome_trace(path) or key_averages() as usual), and turning the "
    "fix off resumes the same recording{residual}"
)


class ProfilerCheck(Check):
    id = "debug-profiler"
    title = "A profiler is recording the work"
    guide = GUIDE

    def detect(self, obs: Observation) -> list[Detection]:
        entries = obs.profiler_entries
        if not entries and not obs.profiler_at_start and not obs.forward_under_profiler:
            return []
        if not entries and ProfilerPausedFix.paused:
            return []  # paused by our own fix, left on: it records nothing
        source = obs.workload.source
        fixed, lines, notes = _strip_calls(source, obs.tree, PROFILER_CALLS)
        kinds = sorted({entry.kind for entry in entries})
        found = _user_profilers(obs.workload.namespace) if obs.profiler_at_start else []
        if entries:
            evidence = f"{', '.join(kinds)} started {count(len(entries), 'time')} during the cell"
        elif found:
            name, profiler = found[0]
            kind = (
                "torch.profiler.profile"
                if isinstance(profiler, torch.profiler.profiler._KinetoProfile)
                else "torch.autograd.profiler.profile"
            )
            evidence = f"{kind} `{name}`, started before this cell, was recording it"
        else:
            evidence = "a profiler started before this cell was recording it"
        details = None
        if obs.forward_under_profiler:
            details = f"{count(obs.forward_under_profiler, 'module call')} ran under it"
        entry_lines = sorted({e.line for e in entries if e.line is not None} | set(lines))
        elsewhere = list(notes)
        if obs.profiler_at_start:
            stop = f"{found[0][0]}.stop()" if found else "prof.stop()"
            elsewhere.append(f"stop the profiler started in an earlier cell ({stop})")
        if lines:
            elsewhere.append(
                "or keep it behind a flag: `with profile(...) if PROFILE else nullcontext():`"
            )
        fix: Fix | None
        caveat = "with the fix the cell's profiler results are empty" if entries else None
        if not obs.profiler_at_start:
            fix = ProfilersOffFix()
        elif not entries and _kineto_on():
            fix = ProfilerPausedFix(found[0][1] if len(found) == 1 else None)
            caveat = _pause_caveat(found[0] if len(found) == 1 else None)
        else:
            fix = None  # NVTX / ITT ranges, or a profiler of the cell's own inside another
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,  # no segment: a profiler records every part alike
                    where=f"cell {_lines_text(entry_lines)}"
                    if entry_lines
                    else (f"`{found[0][0]}`, " if found else "") + "started before this cell",
                    fixable=fix is not None,
                    line=entry_lines[0] if entry_lines else None,
                    caveat=caveat,
                    code_change=CodeChange(codeedit.unified_diff(source, fixed), elsewhere),
                ),
                fix,
                fixed,
            )
        ]


def _pause_caveat(found: tuple[str, Any] | None) -> str:
    """The caveat of a pause, naming what still records while this profiler is paused."""
    name = f"`{found[0]}`" if found else "the profiler"
    stop = f"{found[0]}.stop()" if found else "stop it"
    if found is None:
        residual = (
            ". Not found by name, the profiler has only its op and device collection paused: "
            "a with_stack Python tracer or profile_memory's allocation events go on recording "
            "while paused, and their cost stays in the measured figure"
        )
    elif vars(found[1]).get("profile_memory"):  # both profiler classes keep their options
        residual = (
            ". profile_memory's allocation events cannot be paused: they go on into the trace "
            "while paused, and their cost stays in the measured figure"
        )
    else:
        residual = ""
    return PAUSE_CAVEAT.format(name=name, stop=stop, residual=residual)


# gradcheck ----------------------------------------------------------------------------------


def _skipped_check(*args: Any, **kwargs: Any) -> bool:
    return True


class SkipGradcheckFix(Fix):
    """gradcheck / gradgradcheck return True at once while the cell runs."""

    check_id = "debug-gradcheck"

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        owners = [torch.autograd, sys.modules["torch.autograd.gradcheck"]]
        return _replaced_while_running(namespace, owners, GRADCHECK_NAMES, _skipped_check)


class GradcheckCheck(Check):
    id = "debug-gradcheck"
    title = "gradcheck runs inside the measured work"
    guide = GUIDE

    def detect(self, obs: Observation) -> list[Detection]:
        calls = obs.gradcheck_calls
        if not calls:
            return []
        spent = sum(call.seconds for call in calls)
        share = spent / obs.wall_s if obs.wall_s else 0.0
        names = sorted({call.kind for call in calls})
        lines = sorted({call.line for call in calls if call.line is not None})
        source = obs.workload.source
        fixed, _, notes = _strip_calls(source, obs.tree, GRADCHECK_NAMES)
        return [
            Detection(
                self.finding(
                    evidence=(
                        f"{'/'.join(names)} took {share:.0%} of the cell's time ({spent:.3f} s "
                        f"of {obs.wall_s:.3f} s)"
                    ),
                    details=f"{'/'.join(names)} ran {count(len(calls), 'time')}",
                    segment=OTHER,
                    where=f"cell {_lines_text(lines)}" if lines else "code called from this cell",
                    fixable=True,
                    line=lines[0] if lines else None,
                    caveat="the fix skips the check, so it no longer verifies gradients",
                    code_change=CodeChange(
                        codeedit.unified_diff(source, fixed),
                        [
                            "run gradcheck once, in a test or a separate cell, not in the loop",
                            *notes,
                        ],
                    ),
                ),
                SkipGradcheckFix(),
                fixed,
            )
        ]
