"""The backbone script: it trains on a folder of RGB JPEGs and writes every weight but the classifier, which the
kit's init-weights loader then puts into a 1-channel Fashion-MNIST model (stem summed, head fresh)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from silo_core.models import ModelSpec
from silo_core.models.weights import load_weights
from tests.bench import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "quality" / "pretrain_cifar.py"


def test_classifier_is_the_last_linear_layer_of_each_network():
    pretrain = load_script("bench/quality/pretrain_cifar.py", "pretrain_cifar")
    assert pretrain.classifier_prefix(ModelSpec("small_cnn").build()) == "classifier."
    resnet = ModelSpec("torchvision/resnet18", in_channels=3, image_size=32).build()
    assert pretrain.classifier_prefix(resnet) == "fc."


def test_small_cnn_backbone_loads_into_a_grayscale_model_with_a_fresh_head(tmp_path):
    rng = np.random.default_rng(0)
    for name, colour in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(8):  # a class colour plus noise, 32x32 RGB JPEGs as in the CIFAR-10 folders
            pixels = np.clip(np.array(colour) + rng.normal(0, 25, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(tmp_path / "train" / name / f"{i}.jpg", quality=75)
    out = tmp_path / "backbone.safetensors"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(tmp_path / "train"), "--model", "small_cnn",
                           "--epochs", "1", "--batch-size", "4", "--held-out-per-class", "2", "--threads", "1",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["model"] == "small_cnn" and record["train_images"] == 12
    assert record["left_out"].startswith("classifier.*")
    weights = load_file(str(out))
    assert not [k for k in weights if k.startswith("classifier.")]
    assert tuple(weights["features.0.weight"].shape) == (16, 3, 3, 3)

    grayscale = ModelSpec("small_cnn").build()  # 1 channel, 28 px, Fashion-MNIST's 10 classes
    report = load_weights(grayscale, weights, num_classes=10, source=str(out))
    assert report.summed_stem == ["features.0.weight"]
    assert report.missing_weights == ["classifier.weight", "classifier.bias"]
    assert torch.equal(grayscale.state_dict()["features.0.weight"], weights["features.0.weight"].sum(1, keepdim=True))
