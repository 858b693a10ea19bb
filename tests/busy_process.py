"""A CPU-bound process that is not ours, for tests of what other processes' load does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

BUSY = "while True: pass"


@contextmanager
def other_busy_process() -> Iterator[int]:
    """A busy Python process on the CPUs this one may use, started through a shell that
    exits at once, so it is handed to init (or the nearest subreaper) like anyone else's
    process and is not among our descendants. Yields its pid; killed on exit."""
    # it spins until the test process is gone, so a test killed from outside (a CI
    # timeout) cannot leave it running
    spin = (
        f"import os\nwhile os.path.exists('/proc/{os.getpid()}'):\n    for _ in range(10**6): pass"
    )
    out = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{spin}" >/dev/null 2>&1 & echo $!'],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout)
    try:
        os.sched_setaffinity(pid, os.sched_getaffinity(0))
        time.sleep(0.2)  # started and spinning
        yield pid
    finally:
        os.kill(pid, 9)
