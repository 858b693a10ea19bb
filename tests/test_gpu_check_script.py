"""benchmarks/gpu_check.py runs end to end on CPU in --smoke mode (the device runs it full)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from torchtune_magic.report import Report

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def test_smoke_run_writes_reports_and_summary(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--only", "cnn", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    naive = Report.from_dict(json.loads((tmp_path / "cnn.naive.json").read_text()))
    assert {"conv-bias-bn", "channels-last"} <= {f.id for f in naive.findings}
    assert {n.id for n in naive.not_applicable} >= {"tf32", "fused-optimizer"}
    assert naive.baseline.flops and naive.baseline.achieved_tflops
    Report.from_dict(json.loads((tmp_path / "cnn.expert.json").read_text()))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["smoke"] is True and summary["device"] == "cpu" and summary["torch"]
    [row] = summary["workloads"]
    assert row["name"] == "cnn" and row["naive_s"] and row["expert_s"]
    assert set(row["targets"]) == {"speedup", "vs_expert"}
    assert "| cnn |" in (tmp_path / "summary.md").read_text()
    # the out-of-memory part needs CUDA; on a CPU it says so (the CPU path: its own test)
    assert "needs CUDA" in summary["out_of_memory"]["skipped"]
    assert "out_of_memory**: skipped" in (tmp_path / "summary.md").read_text()
