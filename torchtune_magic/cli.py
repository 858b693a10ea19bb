"""Command line: `python -m torchtune_magic demo|run ...`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchtune_magic")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="perfcheck a built-in CPU training cell")
    demo.add_argument("--budget", type=float, default=15.0, help="measuring seconds")
    demo.add_argument("--html", metavar="FILE", help="also write the report as HTML")
    demo.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
