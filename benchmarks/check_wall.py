"""The wall time of `python -m torchtune_magic check` against its promise (issue 33):
check wall <= the script's plain run + budget + 15 s (+ the verify runs).

    python benchmarks/check_wall.py [--budget S] [--json PATH]

The public example script (tests/data/scripts/mnist_main.py: pytorch/examples' MNIST with
synthetic data) at the issue's size, 94 batches of 64 in one epoch, three ways: as is
(its loading costs a few ms a batch), with items that wait 2 ms each as reads from slow
storage do (a loader finding to measure), and that again with `--apply wins --verify`
(bound: plus one plain run of the original and one of the patched script, taken as two
plain runs). Each row: the plain run first (`python mnist_main.py ARGS`), then `check`
with the default budget, as subprocesses from a scratch folder. Prints a markdown table
and writes JSON (default benchmarks/results/check_wall.json).
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
EXAMPLE = ROOT / "tests" / "data" / "scripts" / "mnist_main.py"
SIZE = ["--epochs", "1", "--train-size", "6000", "--test-size", "1000", "--log-interval", "20"]
SLOW_READS = ["--read-latency-ms", "2"]
ROWS = (
    ("as is", [], []),
    ("2 ms reads", SLOW_READS, []),
    ("2 ms reads, --apply wins --verify", SLOW_READS, ["--apply", "wins", "--verify"]),
)
SLACK_S = 15.0


def _timed(command: list[str], folder: Path) -> tuple[float, int]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
    return time.perf_counter() - started, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=20.0, help="check's --budget (default 20)")
    parser.add_argument("--json", default=str(HERE / "results" / "check_wall.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="check-wall-") as scratch:
        folder = Path(scratch)
        shutil.copy(EXAMPLE, folder / "mnist_main.py")
        for label, script_args, options in ROWS:
            script = ["mnist_main.py", *SIZE, *script_args]
            plain_s, plain_rc = _timed([sys.executable, *script], folder)
            check = [sys.executable, "-m", "torchtune_magic", "check", "--budget", str(args.budget)]
            check_s, check_rc = _timed([*check, *options, *script], folder)
            verify_runs = 2 if "--verify" in options else 0
            bound = plain_s * (1 + verify_runs) + args.budget + SLACK_S
            rows.append(
                {
                    "script": label,
                    "plain_s": round(plain_s, 2),
                    "check_s": round(check_s, 2),
                    "budget_s": args.budget,
                    "bound_s": round(bound, 2),
                    "within": check_s <= bound and plain_rc == 0 and check_rc == 0,
                    "exit_status": check_rc,
                }
            )
            print(f"{label}: plain {plain_s:.1f} s, check {check_s:.1f} s", file=sys.stderr)
    print("| script | plain run s | check wall s | budget s | bound s | within bound |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        within = "yes" if row["within"] else "no"
        print(
            f"| {row['script']} | {row['plain_s']:.1f} | {row['check_s']:.1f} | "
            f"{row['budget_s']:g} | {row['bound_s']:.1f} | {within} |"
        )
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"bound": "plain + budget + 15 s (+ verify runs)", "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
