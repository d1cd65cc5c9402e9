"""The architecture's fingerprint: every parameter's and buffer's name, shape and dtype, which the hub sends so
that a silo can tell its own build of the run's model is the same (another torchvision, timm or MONAI version, or
another copy of a factory, can change it)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class TensorShape:
    """One parameter or buffer of a network: what the hub sends so a silo can tell its build is the same."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def architecture(model: nn.Module) -> list[TensorShape]:
    """Names, shapes and dtypes of every parameter and buffer, in state-dict order."""
    return [TensorShape(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in model.state_dict().items()]


def architecture_sha256(shapes: list[TensorShape]) -> str:
    """One hex digest of an architecture, for the model card and logs."""
    text = json.dumps([[t.name, list(t.shape), t.dtype] for t in shapes], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def architecture_difference(expected: list[TensorShape], built: list[TensorShape]) -> str | None:
    """None when ``built`` matches ``expected`` exactly; else one line naming the first tensor that differs."""
    theirs = {t.name: t for t in expected}
    ours = {t.name: t for t in built}
    for t in expected:
        mine = ours.get(t.name)
        if mine is None:
            return f"the hub's model has {t.name} {list(t.shape)} {t.dtype}, which this build lacks"
        if mine != t:
            return (f"{t.name} is {list(mine.shape)} {mine.dtype} here but {list(t.shape)} {t.dtype} at the hub")
    extra = next((t for t in built if t.name not in theirs), None)
    if extra is not None:
        return f"this build has {extra.name} {list(extra.shape)} {extra.dtype}, which the hub's model lacks"
    return None


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
