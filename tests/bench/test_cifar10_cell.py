"""The CIFAR-10 cell script (SemiFL's paper setting) runs from the tarball in ../shared/data on RGB images, holds
out its test set, stops early on a longer schedule when asked, and keeps finished cells on a rerun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from silo_core.models import ModelSpec, count_parameters

ROOT = Path(__file__).resolve().parents[2]
TAR = ROOT.parent / "shared" / "data" / "CIFAR10" / "cifar10-train-jpeg.tar.gz"


@pytest.mark.skipif(not TAR.is_file(), reason="the CIFAR-10 tarball is not beside the repo")
def test_the_cifar10_cell_trains_on_rgb_images_for_the_rounds_asked_and_resumes(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "quality" / "cifar10.py"), "--tar", str(TAR), "--per-class",
               "60", "--test-per-class", "5", "--silos", "10", "--rounds", "4", "--stop-after", "2",
               "--eval-every", "1", "--model", "small_cnn", "--device", "cpu", "--threads", "1", "--out",
               str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded 600 images of 10 classes" in proc.stdout
    cells = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert [(c["method"], c["seed"]) for c in cells] == [("server-only", 0), ("semifl", 0)]
    rgb = count_parameters(ModelSpec("small_cnn", in_channels=3, image_size=32).build())
    for cell in cells:
        assert cell["parameters"] == rgb  # built for 3 x 32 x 32 images, not Fashion-MNIST's 1 x 28 x 28
        assert [h["round"] for h in cell["history"]] == [1, 2]  # two of the four planned rounds
        assert cell["settings"]["train_images"] == 550  # 50 held out as the test set
        assert 0.0 <= cell["final_accuracy"] <= 1.0
    semifl = cells[1]
    assert semifl["options"]["tau"] == 0.95 and semifl["options"]["local_epochs"] == 5  # the paper's, not tuned
    assert semifl["options"]["silo_batch_size"] == 10
    table = (tmp_path / "table.md").read_text()
    assert "the first 2 of 4 rounds" in table and "| semifl | 0 |" in table and "88.2%" in table

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("kept from") == 2
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == cells
