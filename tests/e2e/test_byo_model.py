"""Bring your own model, then use it: a hub and 2 silo processes over mutual TLS train torchvision's resnet18 at
64 px from a weights file for 2 rounds; then `silo-predict` and `silo-export` run on the hub's state folder as a
user would run them, and give the hub's own numbers: the same test accuracy for the same weights and images, one
CSV row per image with the PyTorch model's class, and an ONNX model that matches PyTorch to 1e-4."""

import csv
import hashlib
import json
import subprocess
import sys

import onnxruntime
import pytest
import torch
from safetensors.torch import load_file, save_file

from silo_core.augment import to_float
from silo_core.data import list_image_files, load_image_file
from silo_core.models import ModelSpec
from silo_sim.stage import stage_federation
from tests.conftest import ROOT, free_port

MODEL = "torchvision/resnet18"
SIZE = 64
TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 16, "hub_batch_size": 10, "tau": 0.0,
        "lr": 0.005}  # resnet18 diverges on 30 labels at the papers' 0.03


def tool(module, *args):
    """Run silo-predict / silo-export as the user would (python -m is the console script's entry point)."""
    result = subprocess.run([sys.executable, "-m", f"silo_tools.{module}", *map(str, args)], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_resnet18_from_a_weights_file_then_predict_and_export(tmp_path, processes):
    torch.manual_seed(7)
    init = ModelSpec(MODEL, num_classes=10, in_channels=1, image_size=SIZE).build()
    init_file = tmp_path / "resnet18-init.safetensors"
    save_file({k: v.contiguous() for k, v in init.state_dict().items()}, str(init_file))

    port = free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=2, labels_per_class=3, unlabeled_limit=100, test_per_class=10, seed=3,
        # 30 labeled, 100 test and 2 x 50 unlabeled images
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 2.0, "linger_s": 5.0},
            "model": {"name": MODEL, "image_size": SIZE, "in_channels": 1, "init_weights": str(init_file)},
            "algorithm": {"name": "semifl", "options": TINY},
            "rounds": {"total": 2, "min_silos": 2, "quorum": 1.0, "deadline_s": 120},
        },
    )
    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    silos = [processes.start_silo(s, port) for s in staged.silos]
    assert hub.wait(timeout=240) == 0, processes.log("hub")
    for silo in silos:
        assert silo.wait(timeout=60) == 0, processes.log(silo.name)

    state = staged.hub_state_dir
    card = json.loads((state / "model_card.json").read_text())
    assert card["model"]["name"] == MODEL and card["model"]["image_size"] == SIZE and card["rounds"] == 2
    assert card["weights_round"] == 2
    assert card["initial_weights"]["sha256"] == hashlib.sha256(init_file.read_bytes()).hexdigest()
    assert card["initial_weights"]["loaded"] == len(init.state_dict())  # every tensor came from the file

    # The labeled test folder the hub scored every round on: the same accuracy from the same weights and images.
    test_dir = staged.root / "hub" / "test"
    out = tmp_path / "out"
    tool("predict", "--model", state, "--labeled", test_dir, "--out", out / "test.csv", "--quiet")
    metrics = json.loads((out / "test_metrics.json").read_text())
    assert metrics["model"]["weights_file"] == "model.safetensors" and metrics["model"]["round"] == 2
    assert metrics["images"] == 100 and len(rows(out / "test.csv")) == 100
    assert metrics["accuracy"] == pytest.approx(card["final_metrics"]["test_accuracy"], abs=1e-6)
    assert (out / "test_confusion.png").stat().st_size > 0

    # ONNX: images in [0, 1] in, logits out, normalisation inside; the same numbers as PyTorch on real images.
    result = tool("export", "--model", state, "--format", "onnx", "--out", out / "model.onnx")
    assert "max difference from PyTorch" in result.stderr
    info = json.loads((out / "model.onnx.json").read_text())
    assert info["parity"]["max_abs_diff"] <= 1e-4 and info["source"]["weights_file"] == "model.safetensors"
    assert info["input"]["shape"] == ["batch", 1, SIZE, SIZE] and info["classes"] == card["classes"]
    # Every row of the CSV is the PyTorch model's answer, and the ONNX model gives the same logits to 1e-4.
    model = ModelSpec(MODEL, num_classes=10, in_channels=1, image_size=SIZE).build()
    model.load_state_dict(load_file(str(state / "model.safetensors")))
    paths = list_image_files(test_dir)
    pixels = torch.stack([load_image_file(p, SIZE, 1) for p in paths])
    with torch.no_grad():
        expected = model.eval()(to_float(pixels, info["normalization"]["mean"], info["normalization"]["std"]))
    by_path = {r["path"]: r["class"] for r in rows(out / "test.csv")}
    assert [by_path[p.relative_to(test_dir).as_posix()] for p in paths] == [
        card["classes"][i] for i in expected.argmax(1).tolist()]
    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"images": (pixels[::10].float() / 255).numpy()})[0])
    assert got.shape == (10, 10) and (got - expected[::10]).abs().max() <= 1e-4
