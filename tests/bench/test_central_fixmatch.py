"""The central FixMatch reference: its loss is FixMatch's, and a few steps run end to end (numbers live in bench/)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tests.bench import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
SCRIPT = ROOT / "bench" / "quality" / "central_fixmatch.py"


def test_loss_trains_the_strong_view_only_on_confident_weak_views():
    central = load_script("bench/quality/central_fixmatch.py", "central_fixmatch")
    labeled, labels = torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0])
    weak = torch.tensor([[9.0, 0.0, 0.0],   # p(0) ~ 0.9998: passes tau 0.95, pseudo-label 0
                         [1.0, 1.0, 0.0]])  # p ~ 0.42: below tau, contributes nothing
    strong = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 5.0]])
    loss, mask = central.fixmatch_loss(labeled, labels, weak, strong, tau=0.95, unlabeled_weight=2.0)
    assert mask.tolist() == [1.0, 0.0]
    expected = F.cross_entropy(labeled, labels) + 2.0 * F.cross_entropy(strong[:1], torch.tensor([0])) / 2
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-6)
    # The pseudo-labels are targets, not a path for gradients into the weak view.
    weak_param, strong_param = weak.clone().requires_grad_(True), strong.clone().requires_grad_(True)
    central.fixmatch_loss(labeled, labels, weak_param, strong_param, 0.95, 1.0)[0].backward()
    assert weak_param.grad is None
    assert strong_param.grad[0].abs().sum() > 0 and not strong_param.grad[1].any()


def test_bad_arguments_are_refused_with_the_option_named(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--mu", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--mu must be at least 1, got 0" in proc.stderr


@pytest.mark.skipif(not (DATA / "FashionMNIST" / "raw").is_dir(), reason="Fashion-MNIST files not beside the repo")
def test_a_few_steps_write_every_evaluation(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", "20", "--eval-every", "10",
                           "--labeled-batch", "8", "--mu", "2", "--unlabeled-limit", "400", "--test-limit", "300",
                           "--data-root", str(DATA), "--threads", "2", "--device", "cpu", "--head", "flatten"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert (saved["labeled"], saved["unlabeled"], saved["test"]) == (250, 400, 300)
    assert [h["step"] for h in saved["history"]] == [10, 20]
    # small_cnn with the flatten head: 64 x 7 x 7 features into 10 classes instead of 64 (run.py's --head)
    assert saved["model_options"] == {"head": "flatten"} and saved["parameters"] == 64_058
    assert all(0.0 <= h["test_accuracy"] <= 1.0 and 0.0 <= h["pass_share"] <= 1.0 for h in saved["history"])
    assert saved["final_accuracy"] == saved["history"][-1]["test_accuracy"]
    assert all(math.isfinite(h["train_loss"]) for h in saved["history"])
