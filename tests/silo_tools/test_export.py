"""silo-export: the ONNX and TorchScript files take images in [0, 1], normalise inside and give the PyTorch
model's logits (onnxruntime / torch.jit.load against the PyTorch model fed as the hub feeds it, to 1e-4), with a
dynamic batch axis; the sidecar says how to feed them; a failed parity check writes nothing."""

from __future__ import annotations

import json

import onnxruntime
import pytest
import torch

import silo_tools.export as export
from silo_core.augment import to_float
from silo_core.data import load_image_file
from silo_core.data.decoding import decode_file
from silo_tools.export import main
from tests.silo_tools.state import CLASSES, sha256, tiny_spec, write_images, write_state


def run_exported(fmt, path, images):
    if fmt == "onnx":
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {"images": images.numpy()})[0])
    with torch.no_grad():
        return torch.jit.load(str(path))(images)


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
@pytest.mark.parametrize("channels", [1, 3])
def test_export_matches_pytorch_on_images_in_0_1(tmp_path, fmt, channels):
    spec = tiny_spec(in_channels=channels, mean=[0.4] if channels == 1 else [0.1, 0.5, 0.9],
                     std=[0.3] if channels == 1 else [0.2, 0.3, 0.4])
    models = write_state(tmp_path / "state", spec, best_round=3)
    out = tmp_path / "exported" / f"model.{fmt}"
    assert main(["--model", str(tmp_path / "state"), "--format", fmt, "--out", str(out), "-q"]) == 0

    paths = write_images(tmp_path / "images", 5, seed=9)  # a batch of 5: the export was traced with 2
    pixels = torch.stack([load_image_file(p, spec.image_size, channels) for p in paths])
    got = run_exported(fmt, out, pixels.float() / 255)
    with torch.no_grad():
        expected = models["best"](to_float(pixels, spec.mean, spec.std))
    assert got.shape == (5, len(CLASSES))
    assert (got - expected).abs().max() <= 1e-4
    assert torch.equal(got.argmax(1), expected.argmax(1))

    info = json.loads((tmp_path / "exported" / f"model.{fmt}.json").read_text())
    assert info["model_format"] == fmt and info["file"] == out.name and info["sha256"] == sha256(out)
    assert info["classes"] == CLASSES
    assert info["input"]["shape"] == ["batch", channels, 16, 16] and info["input"]["range"] == [0.0, 1.0]
    # The sidecar's recipe is the decoding silo-predict and training use, EXIF orientation and DICOM included,
    # and the function it names, fed as it says, gives the model the same pixels.
    recipe = info["input"]["preprocess"]
    assert "EXIF orientation" in recipe and "DICOM" in recipe and f"decode_file(path, 16, {channels}) / 255" in recipe
    named = torch.stack([torch.from_numpy(decode_file(p, 16, channels)) for p in paths]).float() / 255
    assert torch.equal(run_exported(fmt, out, named), got)
    assert info["normalization"] == {"mean": spec.mean, "std": spec.std, "inside_model": True,
                                     "formula": "(images - mean) / std, per channel"}
    assert info["source"]["weights_file"] == "best_model.safetensors" and info["source"]["round"] == 3
    assert info["parity"]["max_abs_diff"] <= 1e-4
    if fmt == "onnx":
        assert info["onnx"]["opset"] == 17
    assert not list((tmp_path / "exported").glob("*.tmp"))


def test_final_weights_and_refusals(tmp_path, capsys):
    models = write_state(tmp_path / "state", best_round=2)
    out = tmp_path / "final.onnx"
    assert main(["--model", str(tmp_path / "state"), "--format", "onnx", "--out", str(out), "--final", "-q"]) == 0
    info = json.loads((tmp_path / "final.onnx.json").read_text())
    assert info["source"]["weights_file"] == "model.safetensors" and info["source"]["round"] == 4
    x = torch.rand(2, 1, 16, 16)
    with torch.no_grad():
        expected = models["final"]((x - 0.4) / 0.3)
    assert (run_exported("onnx", out, x) - expected).abs().max() <= 1e-4

    capsys.readouterr()
    assert main(["--model", str(tmp_path / "state"), "--format", "onnx", "--out", str(out), "-q"]) == 2
    assert "final.onnx exists; pass --force" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nowhere"), "--format", "torchscript", "--out",
                 str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "does not exist" in err and len(err.splitlines()) == 1


def test_an_export_that_does_not_match_pytorch_is_not_written(tmp_path, monkeypatch, capsys):
    write_state(tmp_path / "state")
    real = export.run_onnx
    monkeypatch.setattr(export, "run_onnx", lambda path, images: real(path, images) + 1e-3)
    out = tmp_path / "model.onnx"
    assert main(["--model", str(tmp_path / "state"), "--format", "onnx", "--out", str(out)]) == 1
    assert "differ from PyTorch's by up to 0.001" in capsys.readouterr().err
    assert list(tmp_path.glob("model.onnx*")) == []  # neither the model, its sidecar nor a temporary file
