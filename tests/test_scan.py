"""`python -m torchtune_magic scan`: unmarked notebooks checked end to end (issue 33).

Real kernels through nbclient, real torch, the CLI as a user runs it. Two scans are shared
by the tests (module fixtures): a tutorial-style notebook (the structure of PyTorch's
"Learn the Basics" quickstart, data read item by item from a stand-in for its download)
with a mistake appended at its end, scanned with `--write --verify --allow-errors`; and
the quickstart demo notebook with its `%%perfcheck` line removed. Bad input runs in small
notebooks without torch, or stops before any kernel starts.
"""

from __future__ import annotations

import ast
import copy
import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import nbformat
import pytest

from torchtune_magic.cli import main
from torchtune_magic.programs import notebook_write, scan_render
from torchtune_magic.programs.scan_result import (
    CellFailure,
    Difference,
    ScannedCell,
    ScanResult,
    Verification,
    load_scan_schema,
)
from torchtune_magic.report import Report, load_schema

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "tests" / "data" / "notebooks"
MISTAKE = 'print(f"the last class: {classes[len(classes)]}")  # one past the end'
BUDGET = "6"


def _env(tmp: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}


def scan(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchtune_magic", "scan", *args],
        cwd=tmp,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
    )


def scan_here(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str
) -> tuple[int, str, str]:
    """The CLI in this process (no interpreter and torch import to wait for): exit status,
    stdout, stderr. The kernels it starts are real."""
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PYTHONPATH", _env(folder)["PYTHONPATH"])
    try:
        status = main(["scan", *args])
    except SystemExit as exit:  # argparse
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def _notebook(folder: Path, *sources: str) -> Path:
    path = folder / "small.ipynb"
    cells = [nbformat.v4.new_markdown_cell("# A small notebook")]
    cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("tutorial")
    for path in TUTORIAL.iterdir():
        if path.is_file():
            shutil.copy(path, folder)
    notebook = nbformat.read(folder / "quickstart_tutorial.ipynb", as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(MISTAKE))
    nbformat.write(notebook, folder / "quickstart_tutorial.ipynb")
    done = scan(
        folder,
        "quickstart_tutorial.ipynb",
        "--budget", BUDGET,
        "--write", "optimized.ipynb",
        "--verify",
        "--allow-errors",
        "--json", "scan.json",
        "--html", "scan.html",
    )  # fmt: skip
    assert (folder / "scan.json").exists(), done.stdout + done.stderr
    return {
        "run": done,
        "folder": folder,
        "original": notebook,
        "json": json.loads((folder / "scan.json").read_text()),
    }


def _position(notebook, starts: str) -> int:
    return next(i for i, c in enumerate(notebook.cells, 1) if c.source.startswith(starts))


def test_the_training_cell_is_chosen_and_the_others_passed_over_with_why(tutorial) -> None:
    data, notebook = tutorial["json"], tutorial["original"]
    training = _position(notebook, "epochs = 2")
    checked = [c["index"] for c in data["cells"] if c["checked"]]
    assert checked == [training]
    cells = {c["index"]: c for c in data["cells"]}
    assert "optimizer steps" in cells[training]["why"]
    assert cells[_position(notebook, "batch_size")]["why"] == "no torch work that repeats (1 batch)"
    assert cells[len(notebook.cells)]["why"].startswith("raised IndexError")
    report = cells[training]["report"]
    assert {f["id"] for f in report["findings"]} >= {"dataloader-workers"}
    out = tutorial["run"].stdout
    assert f"cell {training}: " in out
    if report.get("time_split"):  # measured: where the time went, per checked cell
        assert report["time_split"]["data_wait"] > 0 and "where the time went" in out
    assert "passed over (longest first):" in out


def test_json_validates_against_both_schemas(tutorial) -> None:
    data = tutorial["json"]
    jsonschema.validate(data, load_scan_schema())
    for cell in data["cells"]:
        if cell["checked"]:
            jsonschema.validate(cell["report"], load_schema())


def test_the_copy_changes_only_the_winning_fixes_cells_and_tags_them(tutorial) -> None:
    folder, original = tutorial["folder"], tutorial["original"]
    copy = nbformat.read(folder / "optimized.ipynb", as_version=4)
    edits = {e["index"]: e["fixes"] for e in tutorial["json"]["optimized"]["edits"]}
    assert tutorial["json"]["optimized"]["path"] == "optimized.ipynb"
    report = next(c["report"] for c in tutorial["json"]["cells"] if c["checked"])
    wins = {
        v["fixes"][0]
        for v in report["variants"]
        if len(v["fixes"]) == 1 and v.get("verdict") == "faster"
        and v["numerics"]["verdict"] == "identical"
    }  # fmt: skip
    assert {fix for fixes in edits.values() for fix in fixes} <= wins
    assert len(copy.cells) == len(original.cells)
    for index, (before, after) in enumerate(zip(original.cells, copy.cells, strict=True), 1):
        if index in edits:
            assert after.source != before.source
            assert after.metadata["torchtune_magic"] == {"fixes": edits[index]}
        else:
            assert after == before


def test_verify_runs_both_and_finds_every_cell_identical_error_included(tutorial) -> None:
    verify = tutorial["json"]["verify"]
    code = [c for c in tutorial["original"].cells if c.cell_type == "code"]
    assert verify["runs"] == 1
    assert verify["cells_compared"] == len(code)  # the failing cell's error compared too
    assert verify["differences"] == []
    assert verify["cells_same"] == verify["cells_compared"]
    line = f"outputs identical in {len(code)} of {len(code)} cells"
    assert line in tutorial["run"].stdout
    assert tutorial["run"].returncode == 0, tutorial["run"].stderr
    if tutorial["json"]["optimized"]["edits"]:  # a win applied: never slower beyond noise
        assert verify["speedup"] > 0.8


def test_the_html_page_holds_summary_reports_and_verify_escaped(tutorial) -> None:
    page = (tutorial["folder"] / "scan.html").read_text()
    assert "%%perfcheck report" in page and "<h2>Verify</h2>" in page
    assert "raised IndexError: list index out of range" in page
    assert "<pre>epochs = 2" in page  # the checked cell's code


def test_every_string_from_the_notebook_is_escaped_in_the_page() -> None:
    hostile = "<script>alert(1)</script>"
    result = ScanResult(
        notebook=f"{hostile}.ipynb",
        cells=[ScannedCell(2, False, 0.1, f"raised ValueError: {hostile}", hostile)],
        failure=CellFailure(2, f"ValueError: {hostile}"),
        verification=Verification(
            1, 2.0, 1.0, 1, 0, [hostile], [Difference(2, hostile)], {2: (2.0, 1.0)}
        ),
    )
    page = scan_render.html(result)
    assert hostile not in page and "&lt;script&gt;" in page


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("quickstart")
    shutil.copy(REPO / "notebooks" / "demo_data.py", folder)
    notebook = nbformat.read(REPO / "notebooks" / "01_quickstart.ipynb", as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.source.startswith("%%perfcheck"):
            cell.source = cell.source.split("\n", 1)[1]
    nbformat.write(notebook, folder / "quickstart.ipynb")
    done = scan(
        folder, "quickstart.ipynb", "--budget", BUDGET, "--write", "opt.ipynb", "--json", "s.json"
    )
    assert (folder / "s.json").exists(), done.stdout + done.stderr
    return {"run": done, "notebook": notebook, "json": json.loads((folder / "s.json").read_text())}


def test_the_unmarked_quickstart_gets_both_training_cells_checked_in_place(quickstart) -> None:
    notebook, data = quickstart["notebook"], quickstart["json"]
    loops = [i for i, c in enumerate(notebook.cells, 1) if c.source.startswith("model.train()")]
    assert [c["index"] for c in data["cells"] if c["checked"]] == loops
    for cell in data["cells"]:
        if cell["checked"]:
            assert "debug-anomaly" in {f["id"] for f in cell["report"]["findings"]} or (
                cell["index"] != loops[0]
            )
    # checking in place: every other cell printed what the plain run printed
    assert "printed something else" not in quickstart["run"].stdout
    assert quickstart["run"].returncode == 0, quickstart["run"].stderr


def test_a_failing_cell_is_named_and_the_scan_stops_with_what_it_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _notebook(tmp_path, "print('before')", "rows = [1, 2][5]", "print('after')")
    status, out, _ = scan_here(tmp_path, capsys, monkeypatch, path.name, "--json", "s.json")
    assert status == 1
    assert "cell 3 raised IndexError: list index out of range" in out
    assert "the scan stopped there" in out
    data = json.loads((tmp_path / "s.json").read_text())
    assert [c["index"] for c in data["cells"]] == [2, 3]  # cell 4 never ran
    jsonschema.validate(data, load_scan_schema())


def test_write_and_verify_with_no_cell_worth_checking_say_so_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _notebook(tmp_path, "print('no torch here')")
    args = (path.name, "--write", "out.ipynb", "--verify")
    status, out, _ = scan_here(tmp_path, capsys, monkeypatch, *args)
    assert status == 0 and "checked: none" in out
    assert "--write and --verify: no cell was checked" in out
    assert not (tmp_path / "out.ipynb").exists()


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("train.py", "print('hi')\n", "python -m torchtune_magic check"),
        ("notes.ipynb", "not json", "is not a Jupyter notebook"),
        ("gone.ipynb", None, "notebook not found"),
    ],
)
def test_a_path_that_is_no_notebook_is_refused_before_anything_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    content: str | None,
    says: str,
) -> None:
    if content is not None:
        (tmp_path / name).write_text(content)
    args = (name, "--write", "out.ipynb", "--json", "s.json")
    status, _, err = scan_here(tmp_path, capsys, monkeypatch, *args)
    assert status == 2 and says in err
    assert not (tmp_path / "out.ipynb").exists() and not (tmp_path / "s.json").exists()


def test_an_unknown_check_id_is_refused_before_the_notebook_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _notebook(tmp_path, "open('ran.txt', 'w').write('ran')")
    status, _, err = scan_here(tmp_path, capsys, monkeypatch, path.name, "--checks", "amp,nope")
    assert status == 2 and "--checks: 1 unknown check id: nope" in err
    assert not (tmp_path / "ran.txt").exists()


def test_cells_that_are_not_code_cells_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _notebook(tmp_path, "print(1)")
    status, _, err = scan_here(tmp_path, capsys, monkeypatch, path.name, "--cells", "1")
    assert status == 2 and "cell 1 is not a code cell" in err


def test_a_notebook_whose_kernel_is_missing_says_so_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _notebook(tmp_path, "print(1)")
    notebook = nbformat.read(path, as_version=4)
    notebook.metadata["kernelspec"] = {"name": "no-such-kernel", "display_name": "gone"}
    nbformat.write(notebook, path)
    status, _, err = scan_here(tmp_path, capsys, monkeypatch, path.name, "--json", "s.json")
    assert status == 1 and "no Jupyter kernel named 'no-such-kernel'" in err
    assert not (tmp_path / "s.json").exists()


def test_run_and_scan_say_a_missing_kernel_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _notebook(tmp_path, "print(1)")
    said = []
    for command in ("run", "scan"):
        status = main([command, str(path), "--kernel", "no-such-kernel"])
        assert status == 1
        said.append(capsys.readouterr().err.strip().removeprefix("error: "))
    assert said[0] == said[1]
    assert said[0].startswith("no Jupyter kernel named 'no-such-kernel': install ipykernel")


def test_the_copy_carries_only_winning_fixes_with_identical_results() -> None:
    """The writer on a real report of the tutorial's training cell (tests/data, recorded by
    a scan at --budget 40 on this machine, where no fix settled): read as if the loader fix
    (identical results) and the thread fix (results close, not identical) had both
    measured clearly faster. Only the loader fix may reach the copy: its two changes to
    the cell that built both loaders, combined in one edit, tagged; nothing else changes."""
    recorded = json.loads((REPO / "tests/data/scan_tutorial_report.json").read_text())
    report = Report.from_dict(recorded["report"])
    for variant in report.variants:
        variant.verdict = "faster"
    assert {v.numerics.verdict for v in report.variants} >= {"identical", "close"}
    original = nbformat.read(TUTORIAL / "quickstart_tutorial.ipynb", as_version=4)
    checking_run = copy.deepcopy(original)  # execution counts as a top-to-bottom run gives
    code = [c for c in checking_run.cells if c.cell_type == "code"]
    for count, cell in enumerate(code, 1):
        cell.execution_count = count
    optimized, edits, notes = notebook_write.optimized_copy(
        original, checking_run, {recorded["index"]: report}
    )
    loaders = _position(original, "batch_size = 64")
    assert [(e.index, e.fixes) for e in edits] == [(loaders, ["dataloader-workers"])]
    assert notes == []
    edited = optimized.cells[loaders - 1]
    assert edited.source.count("num_workers=") == 2  # the train and the test loader
    ast.parse(edited.source)
    assert edited.metadata["torchtune_magic"] == {"fixes": ["dataloader-workers"]}
    for index, (before, after) in enumerate(zip(original.cells, optimized.cells, strict=True), 1):
        if index != loaders:
            assert after == before


def test_a_cell_with_whitespace_only_lines_is_edited_and_keeps_them() -> None:
    """IPython hands the kernel a cell with its whitespace-only lines emptied, so a
    report's `before` reads "" where the notebook has "    " (a public course notebook's
    training cell was passed over for that, with a note naming "In[None]"): the cell is
    still edited, and the copy keeps its own lines but for the fix's change."""
    recorded = json.loads((REPO / "tests/data/scan_tutorial_report.json").read_text())
    report = Report.from_dict(recorded["report"])
    for variant in report.variants:
        variant.verdict = "faster"
    original = nbformat.read(TUTORIAL / "quickstart_tutorial.ipynb", as_version=4)
    loaders = _position(original, "batch_size = 64")
    lines = original.cells[loaders - 1].source.split("\n")
    original.cells[loaders - 1].source = "\n".join([lines[0], "    ", *lines[1:]])
    for finding in report.findings:
        for change in finding.code_change.cells if finding.code_change else []:
            for name in ("before", "after"):
                text = getattr(change, name).split("\n")
                setattr(change, name, "\n".join([text[0], "", *text[1:]]))
    checking_run = copy.deepcopy(original)
    for count, cell in enumerate([c for c in checking_run.cells if c.cell_type == "code"], 1):
        cell.execution_count = count
    optimized, edits, notes = notebook_write.optimized_copy(
        original, checking_run, {recorded["index"]: report}
    )
    assert [(e.index, e.fixes) for e in edits] == [(loaders, ["dataloader-workers"])], notes
    edited = optimized.cells[loaders - 1].source.split("\n")
    assert edited[1] == "    " and sum("num_workers=" in line for line in edited) == 2
    own = original.cells[loaders - 1].source.split("\n")
    matcher = difflib.SequenceMatcher(a=own, b=edited, autojunk=False)
    changed = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    assert changed and all(
        any("num_workers=" in line for line in edited[j1:j2]) for _, _, _, j1, j2 in changed
    ), changed


def test_a_cell_that_differs_between_plain_runs_is_said_to_be_the_notebooks_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cell that draws random numbers without a seed prints something else every run (a
    public course notebook's untrained model did): before any checked cell ran, that is
    the notebook's own doing, and the scan says so instead of blaming the check."""
    path = _notebook(
        tmp_path,
        "import torch\nprint(torch.rand(3))",
        "w = torch.zeros(4, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(50):\n    opt.zero_grad()\n    (w - 1).pow(2).sum().backward()\n"
        "    opt.step()",
    )
    status, out, err = scan_here(
        tmp_path, capsys, monkeypatch, path.name, "--cells", "3", "--budget", "2"
    )
    assert status == 0, out + err
    assert "cell 2 printed something else in two plain runs (it ran before any checked cell)" in out
    assert "the checking run" not in out
