"""`python -m torchtune_magic check [OPTIONS] SCRIPT [ARGS...]`: a script checked end to end.

The script runs as `__main__` (`programs/script.py`) through the same engine as a cell:
the probe, the findings, the measuring runs (sampled by steps when long), then its one
complete run, whose output is what the user sees (the measuring runs are silenced), and the
report after it. The exit status is the script's own: `sys.exit(n)` gives n; a script that
raises shows its own traceback (its frames, not ours), exits 1, and no report is printed,
since none could claim anything measured.

Under torchrun (`torchrun --nproc-per-node N -m torchtune_magic check train.py ARGS`) every
rank checks the script, the ranks in lockstep as for a cell (`distributed/lockstep.py`).
Lockstep needs a process group before the probe; a script that does not create one itself
(one that trains a copy per rank, or none at all) gets one from `check`: gloo, from
torchrun's environment, destroyed at the end. A script that calls `init_process_group`
itself keeps doing so (the engine then lets its probe run whole, as for a Lightning cell,
and joins the ranks after it; its later runs reuse the group: `script._process_group_kept`).
Rank 0 prints the report and writes the files; the others print the script's output and
one line.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..cell.workload import CellError
from ..options import Options, OptionsError
from . import headline
from .patch import unified
from .script import Script, ScriptExit, ScriptInputError, ScriptWorkload, as_main

if TYPE_CHECKING:
    from ..report import Report
    from ..session import Session


@contextlib.contextmanager
def _process_group(script: Script) -> Iterator[None]:
    """A gloo group for lockstep under torchrun, where the script makes none itself."""
    import torch.distributed as dist

    from ..distributed import lockstep

    ours = (
        lockstep.launched_by_torchrun()
        and dist.is_available()
        and not dist.is_initialized()
        and "init_process_group" not in script.source
    )
    if ours:
        dist.init_process_group(backend="gloo")
    try:
        yield
    finally:  # ours, or the script's, whose destroy waited for the check's end
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _script_traceback(error: BaseException, filename: str) -> str:
    """The traceback as `python SCRIPT` shows it: from the script's first frame on."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))


def _exit_status(status: int | str | None) -> int:
    """`sys.exit(status)` as the interpreter turns it into an exit status."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    """The `check` command (see the module docstring); returns the exit status."""
    try:
        script = Script.load(args.script, args.args)
        options = Options.from_args(args, handled_by_caller=("json",))
        if args.verify_runs < 1:
            raise OptionsError(f"--verify-runs must be at least 1, got {args.verify_runs}")
    except (ScriptInputError, OptionsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        compile(script.source, script.real_path, "exec")
    except SyntaxError as error:  # as `python SCRIPT` shows it: where, and no traceback
        sys.stderr.write("".join(traceback.format_exception_only(type(error), error)))
        return 1
    from ..distributed import lockstep

    rank = lockstep.launched_rank()
    with _process_group(script), as_main(script) as workload:
        from ..session import Session

        session = Session(workload, options)
        try:
            report = session.run()
        except CellError as error:
            sys.stdout.flush()
            if isinstance(error.original, ScriptExit):
                return _exit_status(error.original.status)
            sys.stderr.write(_script_traceback(error.original, workload.filename))
            return 1
        except KeyboardInterrupt:  # as Python ends a script stopped by Ctrl-C
            print(
                "\nKeyboardInterrupt: the check stopped; nothing more was measured", file=sys.stderr
            )
            return 130
        stdin = workload.stdin.text if workload.stdin and workload.stdin.consumed else None
        if rank:
            print(f"rank {rank}: checked {script.path} with the other ranks; rank 0 reports")
            return _exit_status(workload.exit_status)
        return _report(args, script, session, report, workload, stdin, rank)


def _report(
    args: argparse.Namespace,
    script: Script,
    session: Session,
    report: Report,
    workload: ScriptWorkload,
    stdin: str | None,
    rank: int | None,
) -> int:
    """Print the report (and write the patch, verify, JSON, HTML asked for)."""
    from ..render import html, text
    from .script_verify import verify

    status = _exit_status(workload.exit_status)
    changed = session.suggested_cell()
    patch = unified(script.path, script.source, changed)

    program: dict[str, object] = {
        "script": str(script.path),
        "args": list(script.args),
        "patch": None,
        "verify": None,
    }
    after: list[str] = []
    if args.patch:
        if patch is None:
            after.append(
                "--patch: nothing to change (no recommended fix has a code change); no file written"
            )
        else:
            written = patch.write(args.patch)
            program["patch"] = str(written)
            after.append(
                f"patch written to {written} (apply it in {patch.applies_in} with "
                f"`git apply {written}` or `patch -p1 < {written}`)"
            )
    if args.verify:
        if patch is None:
            after.append("--verify: nothing to compare (no recommended code change)")
        elif rank is not None:  # plain runs of one rank would wait for the others
            after.append(
                "--verify: not run under torchrun (one rank's plain runs cannot stand for the "
                "job's); run the original and the patched script under torchrun to compare"
            )
        else:
            verified = verify(script, changed, args.verify_runs, stdin)
            program["verify"] = verified.to_dict()
            after.append(f"verify: {verified.line()}")
            if not verified.same:
                status = status or 1
    report.program = program
    _speak_of_the_script(report, script)
    print()
    print(_with_headline(text.render(report), report, workload))
    for line in after:
        print(line)
    if args.json:
        print(f"JSON report written to {report.write_json(args.json)}")
    if args.html:
        path = Path(args.html)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<!doctype html><meta charset='utf-8'>{html.render(report)}")
        print(f"HTML report written to {path}")
    return status


def _with_headline(rendered: str, report: Report, workload: ScriptWorkload) -> str:
    """The report with the script's own lines first (`headline.py`): the whole run under
    the title, each fix's per-step gain against its start-up at the end of the opening
    block (before the findings)."""
    whole, fixes = headline.lines(report, workload)
    title, _, rest = rendered.partition("\n")
    head, blank, findings = rest.partition("\n\n")
    lines = [title, *whole, head]
    if fixes:
        lines += ["over the whole run:", *(f"  {line}" for line in fixes)]
    return "\n".join(lines) + blank + findings


def _speak_of_the_script(report: Report, script: Script) -> None:
    """The checks word their findings for a cell ("at cell line 84", a diff of "cell"); a
    script's report, its JSON included, names the script's lines and the script."""
    cell = "--- cell\n+++ cell (optimized)\n"
    named = f"--- {script.path}\n+++ {script.path} (optimized)\n"
    for finding in report.findings:
        for name in ("title", "evidence", "where", "details", "caveat"):
            text = getattr(finding, name)
            if text:
                setattr(finding, name, text.replace("cell line ", "line "))
        change = finding.code_change
        if change is not None and change.diff.startswith(cell):
            change.diff = named + change.diff.removeprefix(cell)
    if report.sampling is not None and report.sampling.steps_detail:
        report.sampling.steps_detail = report.sampling.steps_detail.replace("cell line ", "line ")


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `check` subcommand's options, as the magic's plus --html/--patch/--verify."""
    check = commands.add_parser(
        "check",
        help="run a script as __main__ and perfcheck it end to end",
        description="Run SCRIPT with ARGS as `python SCRIPT ARGS` would, find what the PyTorch "
        "tuning guide would change, measure each fix, print the script's output once and the "
        "report. Exit status: the script's own.",
    )
    check.add_argument(
        "--budget", type=float, default=None, metavar="S", help="measuring seconds (default 20)"
    )
    check.add_argument("--checks", metavar="IDS", help="only these checks (comma list)")
    check.add_argument("--skip", metavar="IDS", help="not these checks (comma list)")
    check.add_argument("--quick", action="store_true", help="baseline and all fixes only")
    check.add_argument(
        "--apply", metavar="IDS", help="run the complete run with these fixes (ids|all|wins)"
    )
    check.add_argument("--memory", action="store_true", help="measure peak memory too")
    check.add_argument("--json", metavar="FILE", help="write the report as JSON")
    check.add_argument("--html", metavar="FILE", help="write the report as HTML")
    check.add_argument(
        "--patch", metavar="FILE", help="write the recommended code changes as a unified diff"
    )
    check.add_argument(
        "--verify",
        action="store_true",
        help="run the original and the patched script plainly, compare output and time",
    )
    check.add_argument(
        "--verify-runs", type=int, default=1, metavar="N", help="plain runs of each (default 1)"
    )
    check.add_argument("script", metavar="SCRIPT", help="the .py file to run as __main__")
    rest = check.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments (optional)"
    )
    rest.required = False  # argparse marks a REMAINDER positional required: "required: ARGS"
    check.set_defaults(handler=run)
