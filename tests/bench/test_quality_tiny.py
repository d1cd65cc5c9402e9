"""The suite only checks that the quality benchmark's tiny profile runs end to end; numbers live in bench/."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_tiny_profile_writes_results_table_and_curves(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
               "--data-root", str(DATA), "--out", str(tmp_path), "--threads", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("seed 0:") == 2
    results = json.loads((tmp_path / "results.json").read_text())
    cells = {c["method"]: c for c in results["cells"]}
    assert set(cells) == {"server-only", "semifl"}
    for cell in cells.values():
        assert 0.1 < cell["final_accuracy"] <= 1.0  # better than chance on 10 classes
        assert [h["round"] for h in cell["history"]] == [1, 2]
    assert all(h["silos_contributed"] > 0 for h in cells["semifl"]["history"])
    table = (tmp_path / "table.md").read_text()
    assert "| semifl |" in table and "| server-only |" in table
    assert (tmp_path / "curves.png").stat().st_size > 5000

    # A rerun with the same settings keeps the finished cells instead of training them again.
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "seed 0:" not in again.stdout, again.stderr[-3000:]
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == results["cells"]


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_two_runs_sharing_an_output_folder_split_the_cells_between_them(tmp_path):
    """`--threads 1` runs side by side on one folder (the way to fill the full table on a small CPU): every cell
    is trained by exactly one of them and results.json ends up with both."""
    command = [sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
               "--data-root", str(DATA), "--out", str(tmp_path), "--threads", "1"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-3000:] for _, err in outputs]
    trained = [line.split()[1] for out, _ in outputs for line in out.splitlines() if "seed 0:" in line]
    assert sorted(trained) == ["semifl", "server-only"]  # each cell once, by one run or the other
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(c["method"] for c in results["cells"]) == ["semifl", "server-only"]
    assert list((tmp_path / "running").iterdir()) == []  # claims are released once a cell is saved
