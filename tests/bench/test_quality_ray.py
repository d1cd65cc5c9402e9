"""bench/quality/run.py --ray: the cells as Ray tasks on a local Ray, the same cells as without Ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"

pytest.importorskip("ray")


@pytest.mark.ray_large  # half a minute of a local Ray for a benchmark option: kept out of the 15-minute suite
@pytest.mark.skipif(not os.environ.get("SILOKIT_RAY_LARGE"), reason="set SILOKIT_RAY_LARGE=1 (half a minute)")
@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_a_cell_run_as_a_ray_task_equals_the_cell_run_here(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
                           "--methods", "semifl", "--data-root", str(DATA), "--out", str(tmp_path), "--threads", "1",
                           "--ray"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 cells queued as Ray tasks (1 CPUs, 0 GPUs each)" in proc.stdout
    (cell,) = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert cell["machine"]["cpu_count"] >= 1 and list((tmp_path / "running").iterdir()) == []

    # The same cell in this process, on one thread as the task had: equal numbers, round by round.
    quality = load_script("bench/quality/run.py", "quality_run")
    profile = quality.PROFILES["tiny"]
    train, test = quality.load_data(DATA, profile)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = quality.run_cell("semifl", "iid", 0, profile, train, test, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert cell["final_accuracy"] == here["final_accuracy"] > 0.1
    assert [h["test_loss"] for h in cell["history"]] == [h["test_loss"] for h in here["history"]]


def test_cell_gpus_needs_ray():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality" / "run.py"), "--profile", "tiny",
                           "--cell-gpus", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--cell-gpus 1: 0 or more, with --ray" in proc.stderr
