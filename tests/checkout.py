"""A user's checkout of this repository in a temporary folder, and commands run in it, for
the tests that install the package into a fresh venv (pip install ., Binder)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def clone(destination: Path) -> Path:
    """The files a user's checkout (or Binder) has: tracked and new ones, nothing git
    ignores (no built extension, no node_modules), so installing must build them."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in names)):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    """Run `command`, failing with the end of its output when it fails; its stdout."""
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout
