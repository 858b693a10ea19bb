"""Cells whose training runs in child processes a launcher starts: perfcheck says so in one
line with the torchrun command that measures it, runs the cell once, and times nothing."""

from __future__ import annotations

import ast
from pathlib import Path

from torchtune_magic import perfcheck
from torchtune_magic.probe.launchers import child_process_launcher


def test_a_spawned_training_is_said_and_not_timed(tmp_path: Path) -> None:
    log = tmp_path / "trained.txt"
    cell = (
        "import torch.multiprocessing as mp\n"
        "from spawned_training import train\n"
        f"mp.spawn(train, args=({str(log)!r},), nprocs=2)\n"
    )
    report = perfcheck(cell, {}, budget=5)
    (line,) = [w for w in report.warnings if w.startswith("not measured: the cell's training")]
    assert "`mp.spawn` starts" in line and "torchrun --nproc-per-node N script.py" in line
    assert report.variants == [] and report.baseline.median_s is None  # nothing timed
    assert len(log.read_text().splitlines()) == 2  # the cell ran once: two processes trained
    assert report.cell_run is not None and report.cell_run.status == "probe"


def test_the_launchers_are_read_from_the_cell() -> None:
    said = {
        "from accelerate import notebook_launcher\nnotebook_launcher(train, num_processes=2)": (
            "accelerate's `notebook_launcher`"
        ),
        'trainer = pl.Trainer(strategy="ddp_notebook", devices=2)\ntrainer.fit(m, dl)': (
            'Lightning\'s `strategy="ddp_notebook"`'
        ),
        "torch.multiprocessing.start_processes(train, nprocs=2)": (
            "`torch.multiprocessing.start_processes`"
        ),
        'trainer = pl.Trainer(strategy="ddp", devices=2)\ntrainer.fit(m, dl)': None,
        "for x in data:\n    model(x).sum().backward()": None,
    }
    for cell, expected in said.items():
        assert child_process_launcher(ast.parse(cell), {}) == expected, cell
