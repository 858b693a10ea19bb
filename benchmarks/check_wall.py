"""The wall time of `python -m torchtune_magic check` against its promise (issue 33):
check wall <= the script's plain run + budget + 15 s (+ the verify runs).

    python benchmarks/check_wall.py [--budget S] [--json PATH]

A training script written as example scripts are (tests/data/scripts/train_digits.py) at
the issue's size, 94 batches of 64 in one epoch, three ways: as is
(its loading costs a few ms a batch), with items that wait 2 ms each as reads from slow
storage do (a loader finding to measure), and that again with `--apply wins --verify`
(bound: plus one plain run of the original and one of the patched script, taken as two
plain runs). Each row: a plain run (`python train_digits.py ARGS`), then `check` with the
default budget, then a plain run again, as subprocesses from a scratch folder; the bound
stands on the plain runs' mean (on a busy machine one plain run of the same script can
take half as long again as the next). Prints a markdown table with what check said over
the whole run (and verify), and writes JSON (default benchmarks/results/check_wall.json).
`--train-size 3000` halves the script, for a quicker look.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "tests" / "data" / "scripts" / "train_digits.py"
SIZE = ["--epochs", "1", "--test-size", "1000", "--log-interval", "20"]
SLOW_READS = ["--read-latency-ms", "2"]
ROWS = (
    ("as is", [], []),
    ("2 ms reads", SLOW_READS, []),
    ("2 ms reads, --apply wins --verify", SLOW_READS, ["--apply", "wins", "--verify"]),
)
SLACK_S = 15.0


def _timed(command: list[str], folder: Path) -> tuple[float, int, str]:
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
    return time.perf_counter() - started, done.returncode, done.stdout


def _said(stdout: str) -> str:
    """What check said over the whole run and from verify: its own lines, shortened."""
    keep = ("the script's whole run:", "  ", "verify:", "--verify:", "baseline ")
    lines = stdout.split("\nperfcheck report: ", 1)[-1].split("\n\n", 1)[0].splitlines()
    tail = [line for line in stdout.splitlines() if line.startswith(("verify:", "--verify:"))]
    return " / ".join(line.strip() for line in [*lines, *tail] if line.startswith(keep))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=20.0, help="check's --budget (default 20)")
    parser.add_argument("--train-size", default="6000", help="training images (default 6000)")
    parser.add_argument("--json", default=str(HERE / "results" / "check_wall.json"))
    args = parser.parse_args()
    size = [*SIZE, "--train-size", args.train_size]
    rows = []
    with tempfile.TemporaryDirectory(prefix="check-wall-") as scratch:
        folder = Path(scratch)
        shutil.copy(EXAMPLE, folder / "train_digits.py")
        for label, script_args, options in ROWS:
            script = ["train_digits.py", *size, *script_args]
            before_s, before_rc, _ = _timed([sys.executable, *script], folder)
            check = [sys.executable, "-m", "torchtune_magic", "check", "--budget", str(args.budget)]
            check_s, check_rc, said = _timed([*check, *options, *script], folder)
            after_s, after_rc, _ = _timed([sys.executable, *script], folder)
            plain_s = (before_s + after_s) / 2
            verified = "\nverify: " in said
            bound = plain_s * (3 if verified else 1) + args.budget + SLACK_S
            rows.append(
                {
                    "script": label,
                    "plain_s": [round(before_s, 2), round(after_s, 2)],
                    "check_s": round(check_s, 2),
                    "budget_s": args.budget,
                    "bound_s": round(bound, 2),
                    "within": check_s <= bound and check_rc == before_rc == after_rc == 0,
                    "exit_status": check_rc,
                    "said": _said(said),
                }
            )
            print(f"{label}: plain {plain_s:.1f} s, check {check_s:.1f} s", file=sys.stderr)
    print("| script | plain run s (before, after) | check wall s | budget s | bound s | within |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        within = "yes" if row["within"] else "no"
        before, after = row["plain_s"]
        print(
            f"| {row['script']} | {before:.1f}, {after:.1f} | {row['check_s']:.1f} | "
            f"{row['budget_s']:g} | {row['bound_s']:.1f} | {within} |"
        )
    for row in rows:
        print(f"\n{row['script']}: {row['said']}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    bound = "mean plain run + budget + 15 s (+ 2 plain runs where verify ran)"
    path.write_text(json.dumps({"bound": bound, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
