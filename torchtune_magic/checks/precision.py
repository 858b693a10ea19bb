"""Math precision: autocast (AMP) on GPUs and on CPUs with native bf16, TF32 matmuls.

Guide: "Use mixed precision and AMP" and "Enable TF32 on Ampere and later". Both fixes
change results a little by design, so each states its tolerance and the report records the
measured numerics verdict next to the speedup.

The detection reads what the probe saw (math modules called in float32 with autocast off,
the profiler's matmul/conv op counts and times). On a CPU, `amp` applies only where the CPU
runs bf16 in hardware (AMX, AVX512-BF16, Arm BF16: `probe/cpu.py`) and only when matmuls
and convolutions are a real share of the cell: elsewhere the casts cost more than bf16
saves. bf16 needs no loss scaling, so a CPU training cell gets autocast alone.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..cell import codeedit, history
from ..cell.history import CallEdit
from ..distributed import lockstep
from ..kernel import discovery
from ..kernel.fixes import Fix, Patcher
from ..probe import construction, cpu, frameworks
from ..report import FORWARD, CodeChange, count
from . import autocast_edit
from .base import Check, Detection

if TYPE_CHECKING:
    from ..probe.observation import ModuleUse, Observation

MATH_MODULES = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.MultiheadAttention,
    nn.RNNBase,
)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")
CONV_OPS = ("aten::convolution", "aten::cudnn_convolution", "aten::mkldnn_convolution")
# self time of these ops is the "math" a CPU autocast speeds up (composite ops such as
# aten::linear carry little self time, their mm/addmm children the rest)
CPU_MATH_OPS = (
    *MATMUL_OPS,
    *CONV_OPS,
    "aten::linear",
    "aten::_convolution",
    "aten::convolution_backward",
    "aten::mkldnn_convolution_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)
# On a CPU, autocast's casts cost more than bf16 math saves unless matmuls/convolutions
# dominate. Measured here (AVX512-BF16, shared 2-core machine): a 16-wide MLP (math 6% of
# the probe) 1.0x; a 1024-wide MLP (math 50-84%) 1.3-2.4x training; a 64-channel conv net
# (67-75%) 1.6x inference.
CPU_MIN_MATH_SHARE = 0.25
# ...and unless each matmul/conv is big enough to outweigh the casts: measured here on a
# training step of Linear layers (one thread), 0.5x at 0.5 MFLOP per call, 0.9x at 4, 1.0x
# at 8, 1.35x at 17, 1.8x at 537. Time shares alone mislead on a busy machine, where a
# stalled thread pool makes even tiny matmuls look like most of the time.
CPU_MIN_CALL_FLOPS = 16e6
# torch.testing.assert_close's default rtol for bfloat16: one bf16 rounding (8-bit mantissa,
# unit roundoff 3.9e-3) a few times over. Used for fp16 too (finer mantissa, same bound).
AMP_TOLERANCE = 1.6e-2
# PyTorch's own tests compare TF32 results with 5e-3 (tf32_on_and_off); TF32 keeps 10 bits.
TF32_TOLERANCE = 5e-3


def fp32_math(obs: Observation) -> list[ModuleUse]:
    """Matmul/conv modules that ran in float32 with autocast off for at least one call."""
    return [
        use
        for use in obs.modules.values()
        if isinstance(use.module, MATH_MODULES)
        and use.calls > use.autocast_calls
        and any(p.dtype == torch.float32 for p in use.module.parameters(recurse=False))
    ]


def _op_counts(obs: Observation, names: tuple[str, ...]) -> int:
    return sum(obs.op_totals.get(name, (0, 0.0))[0] for name in names)


def _modules_text(uses: list[ModuleUse]) -> str:
    counts: dict[str, int] = {}
    for use in uses:
        name = type(use.module).__name__
        counts[name] = counts.get(name, 0) + use.calls - use.autocast_calls
    return ", ".join(f"{name} ×{n}" for name, n in sorted(counts.items()))


def _ops_text(obs: Observation) -> str:
    matmuls, convs = _op_counts(obs, MATMUL_OPS), _op_counts(obs, CONV_OPS)
    if not (matmuls or convs):
        return ""
    return f"; the profiler saw {matmuls} matmul and {count(convs, 'convolution op')}"


def _forward_lines(obs: Observation, uses: list[ModuleUse]) -> set[int]:
    """Cell lines that called these modules (through the outermost module containing them:
    inner calls carry no cell line of their own)."""
    return {line for outer in _models(obs, uses) for line in obs.modules[id(outer)].lines}


def _models(obs: Observation, uses: list[ModuleUse]) -> list[nn.Module]:
    """The outermost modules the cell called that contain these modules."""
    inner = {id(use.module) for use in uses}
    return [
        outer.module
        for outer in obs.modules.values()
        if outer.outer_calls and any(id(m) in inner for m in outer.module.modules())
    ]


def _loop_lines(obs: Observation, uses: list[ModuleUse]) -> tuple[int, int] | None:
    """First and last line of the cell statements that called these modules."""
    lines = sorted(_forward_lines(obs, uses))
    if not lines:
        return None
    first = codeedit.top_statement_at(obs.tree, lines[0])
    last = codeedit.top_statement_at(obs.tree, lines[-1])
    if first is None or last is None:
        return None
    return first.lineno, last.end_lineno or last.lineno


# amp ------------------------------------------------------------------------------------------


def _scaled_step(optimizer: torch.optim.Optimizer, scaler: Any) -> Any:
    """`optimizer.step` that goes through the GradScaler (unscale, skip on inf, update).

    GradScaler.step calls `optimizer.step` itself: that inner call reaches the step that was
    there before (the user's, or an LR scheduler's counting wrapper)."""
    previous = optimizer.step
    inside = False

    def step(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside
        if inside:
            return previous(*args, **kwargs)
        inside = True
        try:
            result = scaler.step(optimizer, *args, **kwargs)
            scaler.update()
            return result
        finally:
            inside = False

    if hasattr(previous, "_wrapped_by_lr_sched"):  # an LR scheduler checks for its wrapper
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


def _autocast_forward(forward: Any, device_type: str, dtype: torch.dtype) -> Any:
    """`forward` run under autocast, its outputs left in the dtype autocast gave them."""

    @functools.wraps(forward)
    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return forward_under_autocast


class AmpFix(construction.BuiltObjectsFix):
    """Autocast around the forward passes and the loss only, as the code change puts it.

    Where the change edits the cell, each run executes the edited cell (`with
    torch.autocast(...)` around the statements from the model's forward to the loss,
    backward and the optimizer step after it). Where the forward and the loss run in code
    the cell calls (a framework's loop, a function from an earlier cell), each model's
    `forward` runs under autocast while the fix is applied, as accelerate's mixed precision
    does; a model the checked code builds gets it from its first call in every run
    (`built`). With float16 in a training cell, a fresh `GradScaler` per run scales
    `loss.backward()` and routes every optimizer the cell can reach (found at run time, so
    a rebuilt one counts) and the one the run builds (`optimizers` of the fix `built`
    makes) through `scaler.step` and `scaler.update`; all is undone after the run (under
    `--apply` the built models keep autocast until the fix is undone, their optimizer is
    not left scaled: no later backward outside the cell's runs is)."""

    check_id = "amp"
    tolerance = AMP_TOLERANCE
    cuts_memory_on = frozenset({"cuda"})  # activations kept in half precision
    context_in_cell = True  # the GradScaler float16 code makes and calls in the cell

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype,
        scaled: bool,
        *,
        source: str | None = None,
        fixed: str | None = None,
        models: tuple[tuple[nn.Module, str], ...] = (),
        optimizers: tuple[torch.optim.Optimizer, ...] = (),
        scaling: AmpFix | None = None,
    ):
        super().__init__()
        self.device_type = device_type
        self.compute_dtype = dtype
        self.scaled = scaled
        self.source = source
        self.fixed = fixed
        self.models = models  # (module, its path) whose forward runs under autocast
        # optimizers a run built, stepped through the GradScaler of `scaling`'s current run
        self.optimizers, self.scaling = optimizers, scaling
        self._run: tuple[Patcher, Any] | None = None  # a scaled run's (patcher, GradScaler)

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        for module, path in self.models:
            wrapped = _autocast_forward(module.forward, self.device_type, self.compute_dtype)
            patcher.assign(module, "forward", wrapped, f"{path}.forward")
        run = self.scaling._run if self.scaling is not None else None
        if run is not None:  # undone with the run, even where the models keep autocast
            self._scale(run[0], run[1], namespace, self.optimizers)

    def edit_source(self, source: str) -> str:
        if self.fixed is None or self.source is None:
            return source
        if source == self.source:
            return self.fixed
        return codeedit.combine(self.source, [source, self.fixed])  # after others' edits

    def run_context(self, namespace: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
        return self._run_with(namespace, None)

    def final_run_context(
        self, namespace: dict[str, Any]
    ) -> contextlib.AbstractContextManager[Any]:
        return self._run_with(namespace, self.kept)

    @contextlib.contextmanager
    def _run_with(self, namespace: dict[str, Any], kept: list[Patcher] | None) -> Iterator[None]:
        """One run: its GradScaler (float16 training), then the watch on the objects the
        run builds (`kept`: what it did to them stays, as `BuiltObjectsFix` keeps it). A run
        building its optimizer scales from when the fix reaches it: a scaled backward
        before an optimizer that unscales would wreck the weights."""
        with contextlib.ExitStack() as stack:
            if self.scaled:
                scaler, patcher = torch.amp.GradScaler(self.device_type), Patcher()
                stack.callback(patcher.undo)
                if self.built is None:
                    self._scale(patcher, scaler, namespace)
                else:  # by the `patch` of the fix `built` makes for the run's objects
                    self._run = (patcher, scaler)
                    stack.callback(setattr, self, "_run", None)
            if self.built is not None:
                stack.enter_context(self.built.watched(namespace, kept))
            yield

    @staticmethod
    def _scale(
        patcher: Patcher, scaler: Any, namespace: dict[str, Any], built: Sequence[Any] = ()
    ) -> None:
        """Scale the loss of every scalar backward and step `built` and the optimizers the
        namespace reaches now through `scaler`, until `patcher` is undone."""
        backward = torch.Tensor.backward

        def scaled_backward(loss: torch.Tensor, gradient: Any = None, *args: Any, **kw: Any):
            if gradient is None and loss.numel() == 1:
                loss = scaler.scale(loss)
            return backward(loss, gradient, *args, **kw)

        patcher.setattr(torch.Tensor, "backward", scaled_backward)
        found = discovery.of_type(discovery.walk(namespace), torch.optim.Optimizer)
        optimizers = {id(opt): opt for opt in [*built, *(entry.obj for entry in found)]}
        for optimizer in optimizers.values():
            patcher.setattr(optimizer, "step", _scaled_step(optimizer, scaler))


@dataclass
class _AmpChange:
    """What `amp` changes: the cell text shown and the one its live fix runs (None where
    the change is not in the cell), lines said in words, earlier cells' edits, and the
    models whose forward the live fix autocasts where the cell text cannot say it."""

    shown: str | None = None
    run: str | None = None
    line: int | None = None
    elsewhere: list[str] = field(default_factory=list)
    earlier: list[CallEdit] = field(default_factory=list)
    models: tuple[tuple[nn.Module, str], ...] = ()
    blocked: str | None = None


class AmpCheck(Check):
    id = "amp"
    title = "Matmuls and convolutions run in float32 without autocast"
    guide = "Use mixed precision and AMP"
    threshold = (
        f"CUDA: any float32 matmul/conv; CPU (with native bf16): matmul/conv time ≥ "
        f"{CPU_MIN_MATH_SHARE:.0%} of the cell and ≥ {CPU_MIN_CALL_FLOPS / 1e6:.0f} MFLOP per "
        "call (Linear training here: 0.5x at 0.5 MFLOP, 1.0x at 8, 1.35x at 17, 1.8x at 537)"
    )

    def not_applicable(self, obs: Observation) -> str | None:
        if obs.device != "cpu":
            return super().not_applicable(obs)
        reason = cpu.no_bf16_reason()
        if reason is None and not torch.backends.mkldnn.is_available():
            reason = "this torch build has no oneDNN, which runs bf16 math on CPUs"
        return f"not applicable on this CPU: {reason}" if reason else None

    def detect(self, obs: Observation) -> list[Detection]:
        uses = fp32_math(obs)
        if not uses:
            return []
        share = lockstep.mean_of([_cpu_math_share(obs)])[0] if obs.device == "cpu" else None
        per_call = _flops_per_call(uses)
        if obs.device == "cpu" and (
            share is None
            or share < CPU_MIN_MATH_SHARE
            or (per_call is not None and per_call < CPU_MIN_CALL_FLOPS)
        ):
            return []  # unweighed (the cell ran its own profiler), too little or too small
        dtype = _amp_dtype(obs.device)
        training = obs.backward_calls > 0
        scaled = training and dtype == torch.float16
        blocked = None
        if scaled and len(obs.optimizers) != 1:
            blocked = "float16 training needs one GradScaler per step: scale it by hand"
        if scaled and any(codeedit.calls_named(obs.tree, set(autocast_edit.CLIP_CALLS))):
            blocked = "the cell clips gradients, which must be unscaled first (scaler.unscale_)"
        name = "bfloat16" if dtype == torch.bfloat16 else "float16"
        evidence = f"{_modules_text(uses)} ran in float32 with autocast off"
        details = f"{_modules_text(uses)} ran in float32{_ops_text(obs)}"
        if share is not None:
            evidence = (
                f"float32 matmuls and convolutions took {share:.0%} of the cell's time, "
                "with autocast off"
            )
            size = f", {per_call / 1e6:,.0f} MFLOP per call" if per_call is not None else ""
            details += (
                f"{size}; this CPU runs bf16 in hardware "
                f"({', '.join(cpu.bf16_features())} in its flags)"
            )
        details += f"; autocast would run them in {name}" + (" with a GradScaler" if scaled else "")
        change = amp_change(obs, uses, dtype)
        blocked = blocked or change.blocked
        fix = None
        if not blocked:
            fix = AmpFix(
                obs.device,
                dtype,
                scaled,
                source=obs.workload.source,
                fixed=change.run,
                models=change.models,
            )
            if change.run is None:  # the forward runs outside the cell's text
                blocked = _at_construction(obs, uses, change, fix)
            fix.seen = obs.places_of(*(module for module, _ in change.models))
            fix.bounded_by(share)
        if blocked:
            fix = None
            details += f"; not applied live: {blocked}"
        source = obs.workload.source
        shown = change.shown or source
        names = sorted({obs.module_path(use.module) for use in uses})
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,
                    segment=FORWARD,  # autocast wraps the forward; the backward follows it
                    where=", ".join(names[:6]) + (" …" if len(names) > 6 else ""),
                    fixable=fix is not None,
                    line=change.line,
                    caveat=_amp_caveat(name, training),
                    code_change=CodeChange(codeedit.unified_diff(source, shown), change.elsewhere),
                ),
                fix,
                shown if shown != source else None,
                change.earlier,
            )
        ]


def _at_construction(
    obs: Observation, uses: list[ModuleUse], change: _AmpChange, fix: AmpFix
) -> str | None:
    """Give `fix` the models the checked code builds (each run's, from its first call,
    recognised by where and in which order the run builds them) and, for float16
    training, the optimizer the run builds, stepped through that run's GradScaler; the
    reason it cannot where a run's model or optimizer is made without a constructor call
    in the checked code to follow (None: nothing of the kind, or all reached)."""
    earlier = {id(module) for module, _ in change.models}
    built = [
        model
        for model in _models(obs, uses)
        if id(model) not in earlier and obs.built_by_cell(model)
    ]
    optimizers = [opt for opt in obs.optimizers if fix.scaled and id(opt) not in obs.preexisting]
    if not built:
        if optimizers:  # no model of the run's to apply it at before the first step
            return (
                "the cell builds the optimizer of a model from an earlier cell: create the "
                "GradScaler and step through it by hand"
            )
        return None if change.models else "no model the cell calls is reached"
    keys = [obs.constructed.get(id(obj)) for obj in [*built, *optimizers]]
    if any(key is None for key in keys):
        return f"the models or their optimizer are {construction.UNREACHED}"
    labels = [obs.module_path(model) for model in built]

    def make(objects: list[Any]) -> AmpFix:
        """The fix for one run's models and optimizer, scaled by `fix`'s current run."""
        models = tuple(zip(objects[: len(labels)], labels, strict=True))
        optimizers = tuple(objects[len(labels) :])
        return AmpFix(
            fix.device_type,
            fix.compute_dtype,
            False,
            models=models,
            optimizers=optimizers,
            scaling=fix,
        )

    # applied as the last of them is built: the models' first calls already autocast
    order = {ident: place for place, ident in enumerate(obs.constructed)}
    last = max([*built, *optimizers], key=lambda obj: order[id(obj)])
    found = [key for key in keys if key is not None]
    fix.built = construction.AtConstruction(
        obs.workload, found, obs.constructed[id(last)], make, [*built, *optimizers], on_build=True
    )
    return None


def amp_change(obs: Observation, uses: list[ModuleUse], dtype: torch.dtype) -> _AmpChange:
    """Where autocast goes for this cell, in the words of its framework when it runs one.

    A training cell gets the forward pass and the loss wrapped (never backward or the
    optimizer step; with float16 the GradScaler's calls too); an inference cell its
    forward statements; a Hugging Face or Lightning Trainer its own mixed-precision
    setting."""
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    header = f'with torch.autocast("{obs.device}", dtype=torch.{name})'
    training = obs.backward_calls > 0
    scaled = training and dtype == torch.float16
    models = tuple(
        (module, _label(obs, module))
        for module in _models(obs, uses)
        if obs.places_of(module)  # reachable from names bound before the cell
    )
    framework = _framework_change(obs, dtype, scaled, models)
    if framework is not None:
        return framework
    source, tree = obs.workload.source, obs.tree
    namespace = obs.workload.namespace
    if not training:
        span = _loop_lines(obs, uses)
        if span is None:
            return _AmpChange(elsewhere=[f"run the forward passes under {header}"], models=models)
        fixed, notes = codeedit.edited(source, lambda s: codeedit.wrap_lines(s, *span, header))
        if notes:
            advice = [f"run the forward passes under {header}", *notes]
            return _AmpChange(elsewhere=advice, models=models)
        return _AmpChange(fixed, fixed, span[0])
    scaler_advice = (
        f"create scaler = torch.amp.GradScaler('{obs.device}') once, then "
        "scaler.scale(loss).backward(); scaler.step(opt); scaler.update()"
    )
    found = autocast_edit.regions(tree, _forward_lines(obs, uses))
    if not found:
        advice = [_helper_advice(obs, header), *([scaler_advice] if scaled else [])]
        return _AmpChange(elsewhere=advice, models=models)
    loss = autocast_edit.free_name(tree, namespace, "loss", "amp_loss")
    try:
        run = autocast_edit.edit(source, tree, found, header, loss)
    except codeedit.EditError as error:
        advice = [_helper_advice(obs, header), *([scaler_advice] if scaled else [])]
        advice.append(f"no change to the cell here: {error}")
        return _AmpChange(elsewhere=advice, models=models)
    change = _AmpChange(run, run, found[0].first)
    if scaled:
        scaler = _scaler(obs)
        shown = None
        if scaler is not None:
            try:
                shown = autocast_edit.edit(source, tree, found, header, loss, scaler)
            except codeedit.EditError as error:
                change.elsewhere.append(f"no change to the cell here: {error}")
        if shown is None:
            change.elsewhere.append(scaler_advice)
        change.shown = shown or run
    return change


def _label(obs: Observation, module: nn.Module) -> str:
    """How the notebook names a module: by a name bound before the cell where one reaches
    it (`lit.net`, not the path through a Trainer the cell built)."""
    labels = [
        f"{location}.{name}" if name else str(location)
        for entry in discovery.of_type(obs.found, nn.Module)
        for location in obs.lasting_locations(entry.obj)[:1]
        for name, sub in entry.obj.named_modules()
        if sub is module
    ]
    return min(labels, key=len) if labels else obs.module_path(module)


def _framework_change(
    obs: Observation,
    dtype: torch.dtype,
    scaled: bool,
    models: tuple[tuple[nn.Module, str], ...],
) -> _AmpChange | None:
    """The Trainer's own mixed precision, for a cell running a Hugging Face or Lightning
    Trainer: `TrainingArguments(bf16=True)` / `Trainer(precision="bf16-mixed")`. Live, each
    model's forward runs under autocast (the Trainer reads its setting when it is built)."""
    workload = obs.workload
    bf16 = dtype == torch.bfloat16
    hf = frameworks.args_change(
        workload,
        obs.names_before,
        {"bf16" if bf16 else "fp16": "True"},
        "when the Trainer is built: make the Trainer again after changing it",
    )
    if hf is not None:
        blocked = None
        if scaled:
            blocked = (
                f"{hf.owner.name} makes its optimizer inside train(), out of a GradScaler's "
                "reach: set fp16=True in its arguments"
            )
        return _AmpChange(
            elsewhere=list(hf.elsewhere), earlier=hf.earlier, models=models, blocked=blocked
        )
    trainer = frameworks.lightning_driver(workload)
    if trainer is None:
        return None
    values = {"precision": '"bf16-mixed"' if bf16 else '"16-mixed"'}
    change = _AmpChange(models=models)
    if scaled:
        change.blocked = (
            "Lightning steps its optimizers with a closure, which a GradScaler cannot run: "
            'set precision="16-mixed"'
        )
    built = _assigned_call(obs.tree, trainer)
    if built is not None:  # the Trainer is built in the cell: edit its call there
        callee = {codeedit.dotted_name(built.func).rsplit(".", 1)[-1]}
        edited, notes = codeedit.edited(
            workload.source,
            lambda s: codeedit.with_keywords(s, built.lineno, callee, values, col=built.col_offset),
        )
        change.shown, change.line = (edited, built.lineno) if not notes else (None, None)
        change.elsewhere += notes
        return change
    earlier = history.keyword_edit(workload.notebook, workload.namespace, [trainer], values)
    if earlier is not None:
        change.earlier = [earlier]
    else:
        precision = values["precision"]
        change.elsewhere = [f"{trainer}: build it with Trainer(..., precision={precision})"]
    return change


def _assigned_call(tree: ast.Module, name: str) -> ast.Call | None:
    """The call whose result the cell binds to `name` (`trainer = pl.Trainer(...)`)."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        ):
            return node.value
    return None


def _scaler(obs: Observation) -> autocast_edit.Scaler | None:
    """The GradScaler calls in the cell's names: the one optimizer, as a `.step()` call of
    the cell names it."""
    if len(obs.optimizers) != 1:
        return None
    optimizer = obs.optimizers[0]
    namespace = obs.workload.namespace
    for call in codeedit.calls_named(obs.tree, {"step"}):
        if isinstance(call.func, ast.Attribute):
            receiver = codeedit.dotted_name(call.func.value)
            if receiver and _resolved(namespace, receiver) is optimizer:
                name = autocast_edit.free_name(obs.tree, namespace, "scaler", "grad_scaler")
                return autocast_edit.Scaler(name, obs.device, receiver)
    return None


def _resolved(namespace: dict[str, Any], dotted: str) -> Any:
    """The object `a.b.c` names in the namespace (None when it names nothing)."""
    head, *attributes = dotted.split(".")
    value = namespace.get(head)
    for attribute in attributes:
        value = getattr(value, attribute, None)
    return value


def _helper_advice(obs: Observation, header: str) -> str:
    """Where to put autocast when the forward, the loss and backward run in a function the
    cell calls (defined in an earlier cell)."""
    cell_files = (obs.workload.filename, obs.workload.fixed_filename)
    names = sorted(
        {
            f"{code.co_name}()"
            for site in obs.graph_sites.values()
            if site.backpropagated
            for code in site.functions
            if code.co_filename not in cell_files
        }
    )
    where = f"in {', '.join(names)} (defined in an earlier cell)" if names else "where it is"
    return (
        f"{where}, put the forward pass and the loss under {header}: and call "
        "loss.backward() and the optimizer's step() after that block"
    )


def _cpu_math_share(obs: Observation) -> float | None:
    """Self time of matmul/conv ops over the probe's profiled time (None: no op stream)."""
    if not obs.op_totals or not obs.profiled_s:
        return None
    math_us = sum(obs.op_totals.get(name, (0, 0.0))[1] for name in CPU_MATH_OPS)
    return min(1.0, math_us / 1e6 / obs.profiled_s)


def _flops_per_call(uses: list[ModuleUse]) -> float | None:
    """Mean FLOPs of one float32 call of these modules, from the input shape each was
    first called with (None when no module's size can be told)."""
    flops = calls = 0.0
    for use in uses:
        each = _call_flops(use.module, use.input_shape)
        if each is not None:
            fp32_calls = use.calls - use.autocast_calls
            flops += each * fp32_calls
            calls += fp32_calls
    return flops / calls if calls else None


def _call_flops(module: nn.Module, shape: tuple[int, ...] | None) -> float | None:
    """Multiply-adds x 2 of one forward of a Linear or convolution on an input of `shape`."""
    if shape is None:
        return None
    if isinstance(module, nn.Linear):
        return 2.0 * math.prod(shape[:-1]) * module.in_features * module.out_features
    if isinstance(module, nn.modules.conv._ConvNd):
        dims = len(module.kernel_size)
        if len(shape) < dims + 1:
            return None
        batch = math.prod(shape[: -(dims + 1)])
        spatial = list(shape[-dims:])
        if not module.transposed:  # output positions (exact for "same" padding)
            spatial = [-(-size // module.stride[i]) for i, size in enumerate(spatial)]
        # each position of the smaller side meets a kernel of every channel pair in a group
        pairs = module.in_channels * module.out_channels / module.groups
        return 2.0 * batch * math.prod(spatial) * math.prod(module.kernel_size) * pairs
    return None


def _amp_caveat(name: str, training: bool) -> str:
    """What autocast does to results, with the tolerance the numerics verdict used."""
    bits = "8" if name == "bfloat16" else "11"
    text = (
        f"{name} keeps {bits} significant bits, so results change: they are compared with a "
        f"relative tolerance of {AMP_TOLERANCE:g} (torch.testing's for bfloat16) instead of "
        "float32's; losses, softmax and reductions stay float32 under autocast"
    )
    if training:
        text += (
            "; small changes add up over many steps: check the trained model's validation "
            "loss or accuracy before keeping it"
        )
    return text


def _amp_dtype(device: str) -> torch.dtype:
    """bfloat16 where the device has it (no loss scaling needed), else float16."""
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


# tf32 -----------------------------------------------------------------------------------------


class TF32Fix(Fix):
    """`torch.set_float32_matmul_precision("high")` (and cuDNN TF32 if it was off); undo puts
    back the exact previous settings."""

    check_id = "tf32"
    tolerance = TF32_TOLERANCE

    def patch(self, patcher: Patcher, namespace: dict[str, Any]) -> None:
        previous = torch.get_float32_matmul_precision()
        patcher.call(
            lambda: torch.set_float32_matmul_precision("high"),
            lambda: torch.set_float32_matmul_precision(previous),
        )
        patcher.switch(torch.backends.cudnn, "allow_tf32", True)


class TF32Check(Check):
    id = "tf32"
    title = 'float32 matmuls run at full precision ("highest") on a TF32-capable GPU'
    guide = "Enable TF32 on Ampere and later"
    devices = ("cuda",)

    def not_applicable(self, obs: Observation) -> str | None:
        reason = super().not_applicable(obs)
        if reason is None and torch.cuda.get_device_capability() < (8, 0):
            return "not applicable: TF32 needs an Ampere or newer GPU (compute capability 8.0)"
        return reason

    def detect(self, obs: Observation) -> list[Detection]:
        if torch.get_float32_matmul_precision() != "highest":
            return []
        uses = [u for u in fp32_math(obs) if not isinstance(u.module, nn.modules.conv._ConvNd)]
        matmuls = _op_counts(obs, MATMUL_OPS)
        if not uses and not matmuls:
            return []
        seen = _modules_text(uses) + " ran in float32" if uses else "float32 matmuls ran"
        evidence = f"{count(matmuls, 'float32 matmul op')} ran without TF32 tensor cores"
        details = (
            f'{seen}; torch.get_float32_matmul_precision() is "highest", so none uses TF32 '
            "tensor cores"
        )
        source = obs.workload.source
        setting = 'torch.set_float32_matmul_precision("high")'
        fixed, notes = codeedit.edited(source, lambda s: codeedit.insert_after_imports(s, setting))
        return [
            Detection(
                self.finding(
                    evidence=evidence,
                    details=details,  # no segment: TF32 runs forward and backward matmuls
                    where=", ".join(sorted({obs.module_path(u.module) for u in uses}))
                    or "matmuls in the cell",
                    fixable=True,
                    caveat=(
                        "TF32 rounds matmul inputs to 10 mantissa bits (results compared with "
                        f"tolerance {TF32_TOLERANCE:g}); the setting is process-wide"
                    ),
                    code_change=CodeChange(
                        codeedit.unified_diff(source, fixed),
                        ["or set it once at the top of the notebook", *notes],
                    ),
                ),
                TF32Fix(),
                fixed,
            )
        ]
