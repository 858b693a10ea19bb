"""The IPython adapter: `%%perfcheck` and `%perfcheck list|revert`. Thin on purpose.

Parses options the way `%timeit` users expect, hands the cell to a Session, and shows the
result (live widget panel where widgets can render, the static report otherwise).
"""

from __future__ import annotations

import shlex
import weakref
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import (
    MagicHelpFormatter,
    argument,
    kwds,
    magic_arguments,
    parse_argstring,
)

from .cell import history
from .cell.notebook import Inputs, Notebook
from .cell.workload import CellError, Workload
from .kernel import allocator
from .options import Options, OptionsError
from .report import Report, count
from .session import Session

# Every session, for `%perfcheck revert`. Panels keep theirs alive; a session that left fixes
# applied without a panel (`--apply` with `-q`/`--no-widget`) is held here until reverted.
_sessions: weakref.WeakSet[Session] = weakref.WeakSet()
_holding_fixes: list[Session] = []
_latest: Session | None = None  # for `%perfcheck insert` (replaced by the next run)
PANEL = "the panel"  # the part of ours a failing live panel is reported under


def _panel_unavailable(shell: Any) -> str | None:
    """Why the live panel cannot render in this kernel's front end, in words that say how
    to get it; None when it can (or when there is no front end: terminal IPython)."""
    if getattr(shell, "kernel", None) is None:
        return None
    try:
        import anywidget  # noqa: F401
        import ipywidgets  # noqa: F401
    except ImportError as error:
        return (
            f"{error.name} is missing in this kernel's environment: "
            "`pip install torchtune-magic` brings it (then restart the kernel)"
        )
    from .render.front_end import missing_front_end

    return missing_front_end()


def _widgets_can_render(shell: Any) -> bool:
    """A kernel with a front end (not terminal IPython) where the live panel can render."""
    return getattr(shell, "kernel", None) is not None and _panel_unavailable(shell) is None


class _UsageFormatter(MagicHelpFormatter):
    """`%%perfcheck?` opens with the cell magic's usage line, `%%perfcheck [--checks IDS]
    …` (IPython's formatter writes an RST `::` and one `%`, as for a line magic)."""

    def add_usage(self, usage: Any, actions: Any, groups: Any, prefix: str | None = "%%") -> None:
        super().add_usage(usage, actions, groups, prefix)


@magics_class
class PerfcheckMagics(Magics):
    @magic_arguments()
    @argument("--checks", metavar="IDS", help="only these checks (comma list of ids)")
    @argument("--skip", metavar="IDS", help="skip these checks (comma list of ids)")
    @argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="seconds the checks' trials and the measuring may take together after the "
        "probe (default 20; the probe: 15%% of it, 2 to 8 s): nothing starts that would end "
        "past it; progress is shown",
    )
    @argument("--quick", action="store_true", help="measure only baseline and all fixes together")
    @argument(
        "--apply",
        metavar="IDS|all|wins",
        help="leave these fixes applied afterwards, as if toggled on (all: the recommended "
        "fixes; wins: those that left results identical); a long cell's complete run uses them",
    )
    @argument("--json", metavar="PATH", help="write the report (schema v1) to PATH")
    @argument("-o", dest="return_report", action="store_true", help="return the Report object")
    @argument("-q", dest="quiet", action="store_true", help="show nothing")
    @argument("--no-widget", action="store_true", help="static report only, no live panel")
    @argument(
        "--no-restore",
        action="store_true",
        help="do not restore state after measuring (the extra runs keep their effects)",
    )
    @argument(
        "--device", choices=["cpu", "cuda"], help="device the work runs on (default: detected)"
    )
    @argument("--memory", action="store_true", help="memory is the constraint: report memory fixes")
    @argument(
        "--no-finish",
        action="store_true",
        help="skip the cell's complete run: the kernel ends as before the cell",
    )
    @argument("command", nargs="*", help="line magic only: `list`, `revert` or `insert`")
    @kwds(formatter_class=_UsageFormatter)
    @line_cell_magic
    def perfcheck(self, line: str, cell: str | None = None) -> Report | None:
        """Check a cell against the PyTorch Performance Tuning Guide, measure each fix.

        %%perfcheck [options]  (on top of a cell that trains or evaluates a model)
            Runs the cell once with instrumentation, lists what the guide would change with
            the evidence seen, then times the baseline against each fix and the recommended
            ones together (paired rounds: a speedup with its 99.9% interval, "no clear change"
            where it straddles 1) and checks whether results stayed the same, all within
            --budget. Afterwards the kernel is as if the cell ran once. In JupyterLab, Notebook,
            VS Code and Colab a panel lets you toggle each fix on the live objects, re-time,
            and see the code changes.

        %perfcheck list     the checks, their ids and guide sections
        %perfcheck revert   undo every fix still applied by any %%perfcheck run (a name
                            you rebound since keeps your object)
        %perfcheck insert   put the last run's optimized cell below (the fixes toggled on,
                            or the recommended ones), after the constructor lines of earlier cells
                            it rebuilds (a DataLoader with its workers), and say so

        Python API: torchtune_magic.perfcheck(cell, namespace, **same options).
        """
        __tracebackhide__ = True
        try:
            args = parse_argstring(self.perfcheck, line)
        except UsageError as error:  # argparse's own words, e.g. "invalid float value"
            raise UsageError(f"{'%' if cell is None else '%%'}perfcheck: {error}") from None
        if cell is None:
            return self._line_command(args.command)
        if args.command:
            unexpected = count(len(args.command), "unexpected argument")
            raise UsageError(f"%%perfcheck: {unexpected}: {' '.join(args.command)}")
        try:
            options = Options.from_args(args)
        except OptionsError as error:
            raise UsageError(f"%%perfcheck: {error}") from None
        try:
            workload = self._workload(line, cell)
        except SyntaxError:
            self.shell.showsyntaxerror()
            return None
        report = self._run(workload, options)
        return report if args.return_report else None

    def _workload(self, line: str, cell: str) -> Workload:
        """The cell as IPython runs it, numbered as the editor shows it: the `%%perfcheck`
        line is line 1, and IPython drops blank lines before the first statement, so the
        code starts further down. The notebook context (the cell as typed, its execution
        count, the kernel's inputs) lets code changes reach the earlier cells."""
        code = self.shell.transform_cell(cell)
        dropped = next((i for i, text in enumerate(cell.splitlines()) if text.strip()), 0)
        header = f"%%perfcheck {line}" if line else "%%perfcheck"
        body, count, inputs = cell, None, None
        manager = self.shell.history_manager
        running = getattr(self.shell.displayhook, "exec_result", None)
        stored = manager.input_hist_raw[-1] if manager.input_hist_raw else ""
        if running is not None and running.execution_count is not None:
            # stored before it runs (unless run without history): exactly as typed
            if stored.startswith("%%perfcheck") and stored.partition("\n")[2].strip() == (
                cell.strip()
            ):
                header, _, body = stored.partition("\n")
                count = running.execution_count
                inputs = Inputs.of_history(manager, count)
            else:
                inputs = Inputs.of_history(manager, running.execution_count - 1)
        notebook = Notebook(header, body, count, inputs)
        return Workload.at_line(code, self.shell.user_ns, 2 + dropped, notebook)

    def _run(self, workload: Workload, options: Options) -> Report | None:
        __tracebackhide__ = True
        wanted = options.widget and not options.quiet
        live = wanted and _widgets_can_render(self.shell)
        if wanted and not live and (why := _panel_unavailable(self.shell)):
            print(f"%%perfcheck: no live panel ({why}); showing the static report")
        global _latest
        session = Session(workload, options)
        _sessions.add(session)
        _latest = session
        panel = None
        guarded = session.failures.guarded
        if live:
            from .render.widget import Panel

            panel = Panel.measuring(self.shell, session.run_id)
            session.progress = guarded(PANEL, panel.progress)
            session.on_report = guarded(PANEL, panel.update)
        elif not options.quiet:
            from .render.static_display import StaticDisplay

            view = StaticDisplay(in_place=getattr(self.shell, "kernel", None) is not None)
            session.progress = guarded("rendering", view.progress)
            session.on_report = guarded("rendering", view.report)
        try:
            report = session.run()
        except BaseException as error:
            # A report already out stays (the cell's complete run raised or was interrupted,
            # or Ctrl-C came while measuring); a panel with nothing to show goes.
            if panel is not None:
                if session.report is None:
                    panel.close()
                else:
                    _attach(panel, session, session.report)
            if session.applied_ids:
                _holding_fixes.append(session)
            if isinstance(error, CellError):
                original = error.original
                raise original.with_traceback(original.__traceback__) from None
            raise
        finally:
            allocator.give_back_freed()
        if session.applied_ids:
            _holding_fixes.append(session)
        if panel is not None:
            report = _attach(panel, session, report)
        return report

    def _line_command(self, words: list[str]) -> None:
        command = " ".join(words)
        if command == "list":
            from .checks import registry

            for check in registry.all_checks():
                print(
                    f"{check.id:26} {check.title}\n{'':26} applies to: "
                    f"{check.devices_text()} · guide: {check.guide}"
                )
            return None
        if command == "revert":
            reverted, notes = [], []
            for session in list(_sessions):
                reverted.extend(session.applied_ids)
                notes.extend(session.revert_all())
            _holding_fixes.clear()
            print(f"reverted: {', '.join(reverted)}" if reverted else "no fix was applied")
            for note in notes:
                print(f"left as you rebound it: {note}")
            return None
        if command == "insert":
            session = _latest
            if session is None or not session.detections:
                raise UsageError("%perfcheck insert: no %%perfcheck run with findings yet")
            cell, rebuilt, by_hand = session.cell_to_insert()
            # Inside a running cell, so the front end acts on it (a widget click cannot).
            self.shell.set_next_input(cell, replace=False)
            print(_inserted_text(session, rebuilt, by_hand))
            return None
        raise UsageError(
            f"%perfcheck {shlex.quote(command)}: use `%perfcheck list`, `%perfcheck revert`, "
            "`%perfcheck insert`, or `%%perfcheck [options]` on top of a cell"
        )


def _attach(panel: Any, session: Session, report: Report) -> Report:
    """Bind the panel to its session; where the panel failed (a bug of ours), the report,
    with that failure in it, is shown without the panel instead."""
    with session.failures.part(PANEL):
        panel.attach(session, report)
    if not session.failures.failed(PANEL):
        return report
    from IPython.display import display

    from .render import bundle

    session.on_report = None  # the panel cannot show it
    report = session.current_report()
    display(bundle.render(report), raw=True)
    return report


def _inserted_text(
    session: Session, rebuilt: list[history.Rebuild], by_hand: list[tuple[str, str]]
) -> str:
    """What `%perfcheck insert` put below, in words: which statements of earlier cells it
    re-runs and why, which fixes the cell carries, and what only an edit by hand makes
    permanent."""
    applied = session.applied_ids
    recommended = session.recommended()
    if applied:
        scope = f"the fixes applied ({', '.join(applied)})"
    elif recommended:
        scope = f"the recommended fixes ({', '.join(recommended)})"
    else:
        scope = (
            "no fix: none was measured a clear win here (apply one with its toggle or "
            "`--apply ID` to carry it)"
        )
    lines = [f"%perfcheck insert: inserted below the optimized cell, with {scope}"]
    for rebuild in rebuilt:
        names = ", ".join(f"`{name}`" for name in rebuild.names)
        lines.append(
            f"  first it rebuilds {names} as In[{rebuild.execution_count}] does, with the "
            f"constructor change of {', '.join(rebuild.fixes)} (running it again rebuilds them "
            f"again; edit In[{rebuild.execution_count}] to keep the change)"
        )
    for check_id, change in by_hand:
        lines.append(
            f"  not carried: {check_id} {change}: edit that cell (see the report's code "
            "changes) and re-run it, and the cells that build on it"
        )
    return "\n".join(lines)


def register(shell: Any) -> None:
    shell.register_magics(PerfcheckMagics)


def unregister(shell: Any) -> None:
    global _latest
    for session in list(_sessions):
        session.revert_all()
    _holding_fixes.clear()
    _latest = None
    magics = shell.magics_manager.magics
    for kind in ("line", "cell"):
        magics[kind].pop("perfcheck", None)
    shell.magics_manager.registry.pop("PerfcheckMagics", None)
