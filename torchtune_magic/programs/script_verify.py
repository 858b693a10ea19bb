"""`check --verify`: the original and the patched script run plainly, in alternation, and
their output compared.

Each run is a fresh `python` process with nothing of ours in it but a few lines that run
the text as `python SCRIPT ARGS` would (`_BOOT`): the script's own path in `sys.argv[0]`,
`__file__` and its tracebacks, its folder first on `sys.path`, the current folder as
`check` was started in. Both texts go through the same lines, so the only difference
between the runs is the patch. Runs alternate (original, patched, original, …) so a
machine that slows down or speeds up meanwhile weighs on both alike; each one's time is the
process's wall time, start-up included, as a user timing `python train.py` sees it.

What the script prints to stdout (its results) and its exit status must be the same, as
`outputs.compare_text` compares them: wall-clock figures are the only thing masked. Its
stderr is compared too, and a difference there is listed (`stderr_difference`) without
failing the check: a fix may bring a warning of torch's own (4 workers on a 2-core machine
make the DataLoader warn) while the results stay the same. Standard input the check's runs
read is given to every run again.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import outputs
from .script import Script

# Runs `sys.argv[2]`'s text as the script `sys.argv[1]`, with the arguments after them.
_BOOT = """\
import builtins, sys, types
path, text_file = sys.argv[1], sys.argv[2]
with open(text_file, encoding="utf-8") as f:
    text = f.read()
sys.argv[:] = [path, *sys.argv[3:]]
sys.path[0] = __import__("os").path.dirname(path) or "."
module = types.ModuleType("__main__")
module.__file__, module.__builtins__ = path, builtins
sys.modules["__main__"] = module
exec(compile(text, path, "exec"), module.__dict__)
"""


@dataclass
class PlainRun:
    seconds: float
    stdout: str
    stderr: str
    status: int


@dataclass
class Verified:
    """What the plain runs showed (`program.verify` in the report's JSON)."""

    runs: int
    original_s: float
    patched_s: float
    speedup: float
    same: bool
    masked: list[str] = field(default_factory=list)
    difference: str | None = None
    stderr_difference: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """ "7.1 s → 3.2 s (2.2×); output identical (2 lines masked: …)"."""
        head = (
            f"{self.original_s:.1f} s → {self.patched_s:.1f} s ({self.speedup:.2f}×, median of "
            f"{self.runs} plain run{'s' if self.runs != 1 else ''} each, alternating)"
        )
        if not self.same:
            return f"{head}; output DIFFERS: {self.difference}"
        tail = ""
        if self.stderr_difference:
            tail = f"; stderr differs (not the results): {self.stderr_difference}"
        if not self.masked:
            return f"{head}; output identical{tail}"
        shown = "; ".join(self.masked[:3]) + ("; …" if len(self.masked) > 3 else "")
        lines = f"{len(self.masked)} line{'s' if len(self.masked) != 1 else ''}"
        return f"{head}; output identical ({lines} masked as wall-clock times: {shown}){tail}"


def _run(script: Script, text_file: Path, stdin: str | None) -> PlainRun:
    command = [sys.executable, "-c", _BOOT, str(script.path), str(text_file), *script.args]
    started = time.perf_counter()
    done = subprocess.run(
        command,
        input=stdin if stdin is not None else None,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    return PlainRun(time.perf_counter() - started, done.stdout, done.stderr, done.returncode)


def verify(script: Script, patched: str, runs: int = 1, stdin: str | None = None) -> Verified:
    """Run the original and `patched` plainly `runs` times each, alternating; compare every
    pair's output and exit status."""
    if runs < 1:
        raise ValueError(f"--verify-runs must be at least 1, got {runs}")
    with tempfile.TemporaryDirectory(prefix="perfcheck-verify-") as folder:
        original_file, patched_file = Path(folder) / "original.py", Path(folder) / "patched.py"
        original_file.write_text(script.source, encoding="utf-8")
        patched_file.write_text(patched, encoding="utf-8")
        pairs = [
            (_run(script, original_file, stdin), _run(script, patched_file, stdin))
            for _ in range(runs)
        ]
    masked: list[str] = []
    difference = stderr_difference = None
    for original, other in pairs:
        if original.status != other.status:
            difference = difference or (
                f"exit status {original.status} (original) vs {other.status} (patched)"
            )
        compared = outputs.compare_text(original.stdout, other.stdout)
        masked += [line for line in compared.masked if line not in masked]
        if not compared.same:
            difference = difference or compared.difference or "the outputs differ"
        errors = outputs.compare_text(original.stderr, other.stderr)
        if not errors.same:
            stderr_difference = stderr_difference or errors.difference
    original_s = statistics.median(o.seconds for o, _ in pairs)
    patched_s = statistics.median(p.seconds for _, p in pairs)
    return Verified(
        runs,
        original_s,
        patched_s,
        original_s / patched_s,
        difference is None,
        masked,
        difference,
        stderr_difference,
    )
