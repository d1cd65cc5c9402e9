"""A hub state folder as the hub leaves it at the end of a run (silo_server/app.py, HubApp.export), made without
training: the weights are written by the hub's own writers (write_model, save_best_model) and the card has the
hub's fields. The e2e test (tests/e2e/test_byo_model.py) checks the tools on a real hub's folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from silo_core.files import write_json_atomic
from silo_core.models import ModelSpec, architecture, architecture_sha256, count_parameters
from silo_core.selection import BestRound
from silo_server.state.checkpoint import BEST_MODEL, save_best_model, write_model

CLASSES = ["a_cat", "b_dog", "c_bird"]
RUN_ID = "run-test"


def tiny_spec(**kw) -> ModelSpec:
    args = dict(name="small_cnn", num_classes=len(CLASSES), in_channels=1, image_size=16, mean=[0.4], std=[0.3],
                options={"width": 4})
    return ModelSpec(**{**args, **kw})


def random_model(spec: ModelSpec, seed: int) -> nn.Module:
    """A freshly built model with BN statistics that are not the defaults, so eval mode matters."""
    torch.manual_seed(seed)
    model = spec.build()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("running_mean"):
                buf.copy_(torch.randn_like(buf) * 0.2)
            elif name.endswith("running_var"):
                buf.copy_(1 + torch.rand_like(buf))
    return model.eval()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_state(folder: Path, spec: ModelSpec | None = None, *, rounds: int = 4, best_round: int | None = None,
                seed: int = 0) -> dict[str, nn.Module]:
    """The final model (and, with best_round, a different best model) with a model card; returns the models by
    "final"/"best"."""
    spec = spec or tiny_spec()
    folder.mkdir(parents=True, exist_ok=True)
    models = {"final": random_model(spec, seed)}
    weights = write_model(folder / "model.safetensors", models["final"])
    best = None
    if best_round is not None:
        models["best"] = random_model(spec, seed + 1)
        path = save_best_model(folder, models["best"], RUN_ID, BestRound(best_round, 0.75))
        best = {"round": best_round, "chosen_by": "accuracy on data.validation", "validation_accuracy": 0.75,
                "metrics": {}, "weights_file": BEST_MODEL, "weights_sha256": sha256(path)}
    card = {
        "format": "silokit model card v1",
        "run_id": RUN_ID,
        "run_name": "test",
        "algorithm": "semifl",
        "model": {"name": spec.name, "factory": spec.factory, "options": spec.options,
                  "num_classes": spec.num_classes,
                  "architecture_sha256": architecture_sha256(architecture(models["final"])),
                  "in_channels": spec.in_channels, "image_size": spec.image_size,
                  "normalize_mean": spec.mean, "normalize_std": spec.std,
                  "parameters": count_parameters(models["final"])},
        "classes": list(CLASSES),
        "rounds": rounds,
        "final_metrics": {},
        "best_round": best,
        "weights_file": weights.name,
        "weights_sha256": sha256(weights),
        "weights_round": rounds,
    }
    write_json_atomic(folder / "model_card.json", card)
    return models


def write_images(folder: Path, n: int, seed: int = 0, size: int = 20, names: list[str] | None = None) -> list[Path]:
    """n random RGB PNGs (another size and channel count than the model's: the tools convert and resize)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / (names[i] if names else f"{i:03d}.png")
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths
