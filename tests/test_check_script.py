"""`python -m torchtune_magic check SCRIPT ARGS` on a training script written as example and
course scripts are (tests/data/scripts/train_digits.py), as real subprocesses: the
script's output appears once and equals a plain run's, its loader finding is measured, the
patch applies with git and patch and the patched script prints the same results, the JSON
report carries the program, and the same script checks under torchrun. Bad input: a
missing path, a notebook, a script that raises or exits with a status, one that reads
stdin, a patch with nothing in it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from torchtune_magic import cli
from torchtune_magic.programs import outputs
from torchtune_magic.report import Report, load_schema

TESTS = Path(__file__).resolve().parent
EXAMPLE = TESTS / "data" / "scripts" / "train_digits.py"
# a short run of the example whose batches wait for (simulated) storage: 30 batches of 16
ARGS = [
    "--epochs", "1", "--batch-size", "16", "--train-size", "480", "--test-size", "100",
    "--test-batch-size", "100", "--log-interval", "10", "--read-latency-ms", "2",
]  # fmt: skip
TIMEOUT_S = 240
REPORT_HEAD = "perfcheck report: "


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",  # two ranks, other tests and the loader's workers on 2 cores
    }


def _check(folder: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torchtune_magic", "check", *args]
    return subprocess.run(
        command,
        cwd=folder,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_env(),
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def _script_part(stdout: str) -> str:
    """What the script printed: the check's stdout before its report."""
    return stdout.split(f"\n{REPORT_HEAD}", 1)[0]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The example checked once (patch, verify, JSON, a checkpoint), and run plainly once."""
    folder = tmp_path_factory.mktemp("example")
    shutil.copy(EXAMPLE, folder / "train_digits.py")
    plain = subprocess.run(
        [sys.executable, "train_digits.py", *ARGS],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_env(),
    )
    assert plain.returncode == 0, plain.stderr
    (folder / "digits_cnn.pt").unlink(missing_ok=True)
    options = ["--budget", "15", "--checks", "dataloader-workers"]
    options += ["--apply", "dataloader-workers", "--patch", "fix.diff", "--verify"]
    options += ["--json", "report.json", "--html", "report.html"]
    checked = _check(folder, *options, "train_digits.py", *ARGS, "--save-model")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads((folder / "report.json").read_text())
    return {"folder": folder, "plain": plain, "checked": checked, "report": report}


def test_the_scripts_output_appears_once_as_a_plain_run_prints_it(example):
    printed = _script_part(example["checked"].stdout)
    compared = outputs.compare_text(example["plain"].stdout, printed)
    assert compared.same, compared.difference
    assert printed.count("Test set:") == 1  # the measuring runs were silenced
    # the checkpoint the script saves at its end: written by its complete run
    assert (example["folder"] / "digits_cnn.pt").exists()


def test_the_loader_finding_is_measured_per_batch_and_over_the_whole_run(example):
    report, stdout = example["report"], example["checked"].stdout
    assert any(f["id"] == "dataloader-workers" for f in report["findings"])
    assert report["sampling"]["unit"] == "batch"
    assert report["cell_run"]["steps"] == 30  # every batch of the complete run counted
    variant = next(v for v in report["variants"] if v["fixes"] == ["dataloader-workers"])
    assert variant["speedup"] is not None and variant["verdict"] != "slower"
    assert variant["median_s"] < report["baseline"]["median_s"] * 10  # per batch, not per run
    assert "where the time went" in stdout and "data wait" in stdout
    assert "the script's whole run: " in stdout
    assert "dataloader-workers: " in stdout and " per batch (" in stdout
    # the report speaks of the script it checked, in its text and in the report's own diffs
    report_text = stdout.split(f"\n{REPORT_HEAD}", 1)[1]
    assert "the script's complete run: " in report_text or "the script ran once" in report_text
    assert "cell's" not in report_text and "cell line" not in report_text, report_text
    diff = next(f for f in report["findings"] if f["id"] == "dataloader-workers")
    assert diff["code_change"]["diff"].startswith("--- train_digits.py\n")


def test_the_patch_applies_and_the_patched_script_prints_the_same(example):
    folder = example["folder"]
    patch = (folder / "fix.diff").read_text()
    assert patch.startswith("--- a/train_digits.py\n+++ b/train_digits.py\n")
    assert "num_workers=" in patch
    git = subprocess.run(["git", "apply", "--check", "fix.diff"], cwd=folder, capture_output=True)
    assert git.returncode == 0, git.stderr
    if shutil.which("patch") is not None:  # GNU patch, where the machine has it
        dry = ["patch", "-p1", "--dry-run", "-i", "fix.diff"]
        assert subprocess.run(dry, cwd=folder, capture_output=True).returncode == 0
    verify = example["report"]["program"]["verify"]
    assert verify["same"] and verify["difference"] is None and verify["runs"] == 1
    assert "verify: " in example["checked"].stdout
    assert "output identical" in example["checked"].stdout


def test_the_json_report_carries_the_program_and_loads(example):
    data = example["report"]
    jsonschema.validate(data, load_schema())
    program = data["program"]
    assert program["script"] == "train_digits.py" and program["args"] == [*ARGS, "--save-model"]
    assert program["patch"] == "fix.diff"
    assert Report.from_dict(data).program == program
    assert "dataloader-workers" in (example["folder"] / "report.html").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_under_torchrun_rank_0_reports_and_the_other_rank_says_a_line(tmp_path):
    launcher = ["--nproc-per-node", "2", "--master-port", str(_free_port())]
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "torchtune_magic"]
    command += ["check", "--budget", "3", "--checks", "dataloader-workers", str(EXAMPLE), *ARGS]
    command += ["--train-size", "320"]  # 20 batches a rank (the last --train-size counts)
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env()
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(REPORT_HEAD) == 1
    assert "torchrun: 2 ranks (gloo" in done.stdout
    assert "rank 1: checked " in done.stdout and "rank 0 reports" in done.stdout
    assert done.stdout.count("Test set:") == 2  # each rank's script printed once, as plainly


RAISES = """import torch
def load(n):
    return torch.ones(n)[n + 1]
print("before")
load(3)
"""
EXITS = 'import sys\nprint("partial")\nsys.exit(3)\n'
READS = r"""import sys, torch
total = sum(float(line) for line in sys.stdin)
if total != 6.5:  # a measuring run that found stdin consumed would fail the check
    raise ValueError(f"read {total}")
with open("log.txt", "a") as log:
    log.write("run\n")
layer = torch.nn.Linear(4, 4)
for _ in range(30):
    layer(torch.ones(8, 4)).sum().backward()
torch.save(layer.state_dict(), "layer.pt")
print("sum", total)
"""


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    for name, text in (("raises.py", RAISES), ("exits.py", EXITS), ("reads.py", READS)):
        (tmp_path / name).write_text(text)
    (tmp_path / "lesson.ipynb").write_text("{}")
    return tmp_path


def test_bad_paths_get_a_clear_error(scripts, capsys, monkeypatch):
    """The command's own entry point, in this process: nothing runs before the path is
    refused (a subprocess would only add the interpreter's start)."""
    monkeypatch.chdir(scripts)
    assert cli.main(["check", "nothing.py"]) == 2
    assert "error: nothing.py: no such file" in capsys.readouterr().err
    assert cli.main(["check", "lesson.ipynb", "--epochs", "1"]) == 2
    assert "use `python -m torchtune_magic scan lesson.ipynb`" in capsys.readouterr().err
    (scripts / "notes.txt").write_text("not python")
    assert cli.main(["check", "notes.txt"]) == 2
    assert "notes.txt is not a Python script" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # ARGS are optional: only SCRIPT is asked for
        cli.main(["check"])
    assert usage.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith("the following arguments are required: SCRIPT")
    assert cli.main(["check", "--skip", "no-such-check", "raises.py"]) == 2
    assert "--skip: 1 unknown check id: no-such-check" in capsys.readouterr().err


def test_a_script_that_raises_shows_its_own_traceback_and_no_report(scripts):
    done = _check(scripts, "--budget", "2", "raises.py")
    assert done.returncode == 1
    assert done.stdout == "before\n" and REPORT_HEAD not in done.stdout
    frames = [line for line in done.stderr.splitlines() if line.startswith('  File "')]
    assert len(frames) == 2 and all("raises.py" in frame for frame in frames)
    assert done.stderr.rstrip().endswith(
        "IndexError: index 4 is out of bounds for dimension 0 with size 3"
    )


def test_the_scripts_exit_status_is_checks(scripts):
    done = _check(scripts, "--budget", "2", "exits.py")
    assert done.returncode == 3 and done.stdout == "partial\n" and not done.stderr


def test_stdin_replayed_files_written_once_and_nothing_to_patch(scripts):
    """Every run reads the whole input; the log the script appends to and the model it saves
    are written by one run, though the check ran it several times."""
    done = _check(
        scripts,
        *("--budget", "3", "--checks", "dataloader-workers", "--patch", "none.diff"),
        "reads.py",
        stdin="1\n2\n3.5\n",
    )
    assert done.returncode == 0, done.stderr
    assert _script_part(done.stdout) == "sum 6.5\n"  # every run read the whole input
    assert (scripts / "log.txt").read_text() == "run\n"
    assert (scripts / "layer.pt").exists()
    assert "--patch: nothing to change" in done.stdout
    assert not (scripts / "none.diff").exists()
