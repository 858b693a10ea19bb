"""Command line: `python -m torchtune_magic demo|run|check|scan ...`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .distributed import lockstep
from .report import count
from .runner import DEFAULT_TIMEOUT_S


def _demo(args: argparse.Namespace) -> int:
    from . import demo, perfcheck
    from .render import html, text

    print("%%perfcheck on the built-in demo cell:\n")
    print(demo.CELL)
    report = perfcheck(demo.CELL, demo.namespace(), budget=args.budget, json=args.json)
    print(text.render(report))
    if args.html:
        path = Path(args.html)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<!doctype html><meta charset='utf-8'>{html.render(report)}")
        print(f"\nHTML report written to {path}")
    if args.json:
        print(f"JSON report written to {args.json}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from . import runner
    from .render import text

    notebook = Path(args.notebook)
    # under torchrun (the kernel inherits the rank's environment, so the notebook's own
    # `init_process_group()` joins the job) rank 0 prints and writes the reports; the
    # others say a line
    rank = lockstep.launched_rank()
    if rank:
        return _run_other_rank(notebook, args, rank)
    print(f"running {notebook} (kernel {args.kernel}, timeout {args.timeout:g} s per cell)…")
    try:
        result = runner.run_notebook(
            notebook,
            timeout=args.timeout,
            kernel_name=args.kernel,
            output=args.output,
            log=lambda line: print(f"  {line}", flush=True),
        )
    except runner.RunError as error:
        print(f"error: {error}", file=sys.stderr)
        if args.output:
            print(f"the notebook, executed up to the error, is in {args.output}", file=sys.stderr)
        return 1
    reports = count(len(result.reports), "%%perfcheck report")
    print(f"ran in {result.seconds:.1f} s; {reports}\n")
    for item in result.reports:
        print(f"=== {notebook.name}, cell {item.cell} ===")
        print(text.render(item.report), end="\n\n")
    if not result.reports:
        print(f"note: {notebook} has no %%perfcheck cell that displayed a report")
    if args.json:
        for path in runner.write_json(result.reports, args.json, notebook.stem):
            print(f"JSON report written to {path}")
    if args.html:
        path = Path(args.html)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(runner.html_page(result.reports, f"%%perfcheck reports: {notebook.name}"))
        print(f"HTML reports written to {path}")
    if args.output:
        print(f"executed notebook written to {args.output}")
    return 0


def _run_other_rank(notebook: Path, args: argparse.Namespace, rank: int) -> int:
    from . import runner

    try:
        result = runner.run_notebook(notebook, timeout=args.timeout, kernel_name=args.kernel)
    except runner.RunError as error:
        print(f"rank {rank}: error: {error}", file=sys.stderr)
        return 1
    print(
        f"rank {rank}: ran {notebook} in {result.seconds:.1f} s; "
        f"{count(len(result.reports), '%%perfcheck report')}, written by rank 0"
    )
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _scan(args: argparse.Namespace) -> int:
    """Exit status: 0, or 1 where a cell raised (and the scan stopped), the notebook could
    not run, or the verify found a difference; 2 for a path that is no notebook."""
    from .options import Options, OptionsError
    from .programs import scan, scan_render
    from .programs.execute import ExecuteError

    try:  # the magic validates them in each checked cell too: refused here, nothing has run
        Options.from_args(args, handled_by_caller=("json",))
    except OptionsError as error:
        print(f"python -m torchtune_magic scan: error: {error}", file=sys.stderr)
        return 2
    options = scan.ScanOptions(
        **{k: getattr(args, k) for k in ("cells", "budget", "checks", "skip", "quick", "memory")},
        write=args.write,
        verify=args.verify,
        verify_runs=args.verify_runs,
        allow_errors=args.allow_errors,
        timeout=args.timeout,
        kernel=args.kernel,
    )
    try:
        result = scan.scan(Path(args.notebook), options, lambda line: print(line, flush=True))
    except scan.ScanInputError as error:
        print(f"python -m torchtune_magic scan: error: {error}", file=sys.stderr)
        return 2
    except ExecuteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print()
    print(scan_render.text(result))
    if args.json:
        print(f"JSON written to {result.write_json(args.json)}")
    if args.html:
        path = Path(args.html)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(scan_render.html(result))
        print(f"HTML written to {path}")
    differs = result.verification is not None and result.verification.differences
    return 1 if result.stopped or differs else 0


def _add_scan(commands: argparse._SubParsersAction) -> None:
    scan = commands.add_parser(
        "scan",
        help="execute an unmarked notebook, check the cells worth it, optionally write and "
        "verify an optimized copy",
        description="Execute NOTEBOOK (nbclient, in its own folder), choose the cells whose "
        "torch work repeats and takes at least 0.5 s, check each in place as %%perfcheck "
        "would, and print a summary. Exits 1 if a cell raised (the scan stops there unless "
        "--allow-errors) or the verify found a difference.",
    )
    scan.add_argument("notebook", metavar="NOTEBOOK", help="the .ipynb file to scan")
    scan.add_argument(
        "--cells",
        metavar="LIST",
        help="check these cells (e.g. 7,12: positions, markdown included)",
    )
    scan.add_argument(
        "--budget", type=float, metavar="S", help="measuring seconds per checked cell (default 20)"
    )
    scan.add_argument("--checks", metavar="IDS", help="only these checks (comma list of ids)")
    scan.add_argument("--skip", metavar="IDS", help="skip these checks (comma list of ids)")
    scan.add_argument(
        "--quick", action="store_true", help="measure only baseline and all fixes together"
    )
    scan.add_argument(
        "--memory", action="store_true", help="memory is the constraint: report memory fixes"
    )
    scan.add_argument(
        "--json", metavar="FILE", help="write the summary (schema torchtune-magic/scan/v1)"
    )
    scan.add_argument(
        "--html", metavar="FILE", help="write the summary and every report as one page"
    )
    scan.add_argument(
        "--write",
        metavar="OPT.ipynb",
        help="write the notebook with the code changes of the fixes measured clearly faster "
        "with identical results",
    )
    scan.add_argument(
        "--verify",
        action="store_true",
        help="execute the original and the optimized copy in alternation and compare every "
        "cell's outputs and times",
    )
    scan.add_argument(
        "--verify-runs", type=_at_least_one, default=1, metavar="N", help="runs of each (default 1)"
    )
    scan.add_argument(
        "--allow-errors",
        action="store_true",
        help="record a cell's error as its output and go on (as nbconvert's option)",
    )
    scan.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds one cell may run plainly (default {DEFAULT_TIMEOUT_S:g})",
    )
    scan.add_argument(
        "--kernel", metavar="NAME", help="Jupyter kernel (default: the notebook's own)"
    )
    scan.set_defaults(handler=_scan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchtune_magic")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="perfcheck a built-in CPU training cell")
    demo.add_argument("--budget", type=float, default=15.0, help="measuring seconds")
    demo.add_argument("--html", metavar="FILE", help="also write the report as HTML")
    demo.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    demo.set_defaults(handler=_demo)
    run = commands.add_parser(
        "run",
        help="execute a notebook headless and print/write its %%perfcheck reports",
        description="Execute NOTEBOOK with nbclient in its own folder, print the final report "
        "of every %%perfcheck cell, and write them as JSON and HTML. Exits 1 if a cell fails.",
    )
    run.add_argument("notebook", metavar="NOTEBOOK", help="the .ipynb file to execute")
    run.add_argument(
        "--json", metavar="DIR", help="write each report to DIR/<notebook-stem>-cell<N>.json"
    )
    run.add_argument("--html", metavar="FILE", help="write every report into one HTML page")
    run.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds one cell may run (default {DEFAULT_TIMEOUT_S:g})",
    )
    run.add_argument("--output", metavar="NB", help="also save the executed notebook to NB")
    run.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    run.set_defaults(handler=_run)
    from .programs import check

    check.add_parser(commands)
    _add_scan(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
