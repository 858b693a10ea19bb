"""Command line: `python -m torchtune_magic demo|run|check ...`."""

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
