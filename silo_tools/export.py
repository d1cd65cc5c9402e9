"""silo-export --model STATE_DIR --format onnx|torchscript: write a hub's trained model for use outside silokit.

The exported model takes float32 images N x C x H x W with values in [0, 1] (8-bit pixels divided by 255: decoded,
converted to the card's channels, resized to its image size) and returns the logits N x num_classes; the card's
mean/std normalisation is inside the model. A sidecar JSON beside it (OUT.json) holds the class names, the input
shape, mean/std and which round's weights it carries.

Before the file is put in place, the exported model is run (onnxruntime for ONNX, torch.jit.load for TorchScript)
on a batch of images of another size than the one it was traced with, and compared with the PyTorch model fed the
way silo-predict and the hub feed it: a difference over --tolerance refuses the export, and nothing is written."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from silo_tools.card import (
    CardError,
    TrainedModel,
    add_model_arguments,
    error,
    file_sha256,
    load_trained_model,
)

EXPORT_FORMAT = "silokit export v1"
FORMATS = {"onnx": "model.onnx", "torchscript": "model.pt"}  # --format and its default --out
DEFAULT_OPSET = 17
TRACE_BATCH, CHECK_BATCH = 2, 3  # traced with one batch size, checked with another: the batch axis is dynamic


class ExportError(Exception):
    """The export could not be made or did not match the PyTorch model; the message says why."""


class RawImageModel(nn.Module):
    """A trained network that takes images scaled to [0, 1] and normalises them itself:
    ``logits = model((images - mean) / std)``, mean and std per channel from the model card."""

    def __init__(self, model: nn.Module, mean: list[float], std: list[float]):
        super().__init__()
        self.model = model
        shape = (1, len(mean), 1, 1)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(shape))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(shape))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model((images - self.mean) / self.std)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="silo-export",
        description="Write the model in a silokit hub's state folder as ONNX or TorchScript. The exported model "
                    "takes float32 N x C x H x W images in [0, 1] (8-bit pixels / 255, at the card's size and "
                    "channels), normalises them inside with the card's mean/std, and returns logits; OUT.json "
                    "beside it lists the classes, input shape and mean/std. It is checked against the PyTorch "
                    "model before it is written.")
    add_model_arguments(p)
    p.add_argument("--format", required=True, choices=sorted(FORMATS),
                   help='onnx (needs pip install "silokit[export]"; checked with onnxruntime) or torchscript')
    p.add_argument("--out", type=Path, help="the file to write (default: model.onnx or model.pt); the sidecar "
                   "is OUT.json")
    p.add_argument("--force", action="store_true", help="overwrite the output files if they exist")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default: {DEFAULT_OPSET})")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest difference in logits allowed between the export and PyTorch (default: 1e-4)")
    p.add_argument("--quiet", "-q", action="store_true", help="no summary on stderr")
    return p


def sample_images(trained: TrainedModel, n: int, seed: int) -> torch.Tensor:
    """n images of random 8-bit pixels at the model's size and channels (uint8 N x C x H x W)."""
    s = trained.spec
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, s.in_channels, s.image_size, s.image_size), dtype=torch.uint8, generator=g)


def export_onnx(wrapper: nn.Module, example: torch.Tensor, path: Path, opset: int) -> dict[str, Any]:
    import onnx

    # torch's TorchScript-based exporter: it needs nothing beyond torch (the torch.export-based one, torch's default
    # since 2.9, also needs onnxscript); deprecated but present in the torch versions silokit supports.
    extra = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(wrapper, (example,), str(path), input_names=["images"], output_names=["logits"],
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
                          do_constant_folding=True, **extra)
    onnx.checker.check_model(str(path))
    return {"opset": opset, "exporter": "torch.onnx.export (TorchScript-based)"}


def run_onnx(path: Path, images: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])


def export_torchscript(wrapper: nn.Module, example: torch.Tensor, path: Path) -> dict[str, Any]:
    with warnings.catch_warnings():  # torch.jit is deprecated in favour of torch.export; TorchScript is what's asked
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(wrapper, example, check_trace=False)  # the parity check below does the checking
        traced.save(str(path))
    return {"method": "torch.jit.trace"}


def run_torchscript(path: Path, images: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        loaded = torch.jit.load(str(path), map_location="cpu")  # the file we just wrote
    with torch.inference_mode():
        return loaded(images)


def export_model(trained: TrainedModel, fmt: str, path: Path, opset: int = DEFAULT_OPSET,
                 tolerance: float = 1e-4) -> dict[str, Any]:
    """Write ``trained`` to ``path`` in ``fmt`` through a temporary file, run it against the PyTorch model and
    put it in place only when they agree to ``tolerance``; returns the sidecar's content."""
    s = trained.spec
    wrapper = RawImageModel(trained.model, s.mean, s.std).eval()
    example = sample_images(trained, TRACE_BATCH, seed=0).float() / 255
    tmp = path.with_name(path.name + ".tmp")
    try:
        with torch.no_grad():
            details = export_onnx(wrapper, example, tmp, opset) if fmt == "onnx" else \
                export_torchscript(wrapper, example, tmp)
        check = sample_images(trained, CHECK_BATCH, seed=1)
        with torch.inference_mode():
            expected = trained.model(trained.inputs(check)).float()  # as silo-predict and the hub feed it
        run = run_onnx if fmt == "onnx" else run_torchscript
        got = run(tmp, check.float() / 255)
        if got.shape != expected.shape:
            raise ExportError(f"the exported model returns {tuple(got.shape)} for {CHECK_BATCH} images, PyTorch "
                              f"{tuple(expected.shape)}")
        diff = float((got.float() - expected).abs().max())
        if not diff <= tolerance:
            raise ExportError(f"the exported model's logits differ from PyTorch's by up to {diff:.3g} (more than "
                              f"--tolerance {tolerance:g}); nothing written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    card = trained.card
    c, size = s.in_channels, s.image_size
    return {
        "format": EXPORT_FORMAT,
        "model_format": fmt,
        "file": path.name,
        "sha256": file_sha256(path),
        fmt: details,
        "input": {
            "name": "images", "dtype": "float32", "layout": "NCHW", "shape": ["batch", c, size, size],
            "range": [0.0, 1.0], "channels": "grayscale" if c == 1 else "RGB",
            # What silo-predict and training do (silo_core/data/decoding.py decode_file), step by step: a reader
            # who opens a phone photo or a 16-bit scan with plain PIL would otherwise feed the model other pixels.
            "preprocess": f"decode, turned upright by the EXIF orientation tag; 16-bit images divided by 257 and "
                          "float images times 255 to 8 bits; DICOM files through their VOI LUT or window, "
                          f"MONOCHROME1 inverted; convert to {'grayscale (L)' if c == 1 else 'RGB'}, resize to "
                          f"{size}x{size} (bilinear, no crop), divide the 8-bit pixels by 255; the normalisation "
                          "below is done inside the model. silo_core.data.decoding.decode_file(path, "
                          f"{size}, {c}) / 255 does all of it",
        },
        "normalization": {"mean": s.mean, "std": s.std, "inside_model": True,
                          "formula": "(images - mean) / std, per channel"},
        "output": {"name": "logits", "shape": ["batch", len(trained.classes)],
                   "note": "raw logits: softmax gives the class probabilities"},
        "classes": trained.classes,
        "source": {"run_id": card.get("run_id"), "run_name": card.get("run_name"), "model": s.name,
                   "model_options": s.options, "weights_file": trained.weights.name,
                   "weights_sha256": trained.weights_sha256, "round": trained.round, "which": trained.which},
        "parity": {"images": CHECK_BATCH, "max_abs_diff": diff, "tolerance": tolerance,
                   "against": "the PyTorch model on random 8-bit images"},
        "torch_version": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.tolerance > 0:
        return error(f"--tolerance must be positive, got {args.tolerance}")
    if args.format == "onnx" and not all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime")):
        return error('--format onnx needs onnx and onnxruntime: pip install "silokit[export]"')
    out = args.out or Path(FORMATS[args.format])
    sidecar = out.with_name(out.name + ".json")
    existing = [p for p in (out, sidecar) if p.exists()]
    if existing and not args.force:
        return error(f"{existing[0]} exists; pass --force to overwrite it, or --out another file")
    try:
        trained = load_trained_model(args.model, final=args.final, model_factory=args.model_factory)
    except CardError as err:
        return error(str(err))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        info = export_model(trained, args.format, out, args.opset, args.tolerance)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    sidecar.write_text(json.dumps(info, indent=2) + "\n")
    if not args.quiet:
        print(f"wrote {out} ({args.format}) and {sidecar} from {trained.describe()}; input float32 "
              f"N x {trained.spec.in_channels} x {trained.spec.image_size} x {trained.spec.image_size} in [0, 1], "
              f"normalised inside; max difference from PyTorch {info['parity']['max_abs_diff']:.2g}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
