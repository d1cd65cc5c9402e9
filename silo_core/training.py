"""Training building blocks shared by the algorithms: devices, optimisers, LR schedule, supervised epochs, eval."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from silo_core.augment import to_float, weak_augment
from silo_core.sbn import compute_static_bn


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else the CPU; anything else is passed to torch (e.g. 'cuda:1')."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available here; use --device auto or cpu")
    return device


@dataclass
class OptimizerSettings:
    lr: float = 0.03
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = True
    grad_clip: float = 1.0


def make_sgd(model: nn.Module, lr: float, opt: OptimizerSettings) -> torch.optim.SGD:
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay, nesterov=opt.nesterov
    )


def sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()


def cosine_lr(base_lr: float, round_number: int, total_rounds: int, schedule: str = "cosine") -> float:
    """LR of 1-based round `round_number`, stepped once per round and shared by hub and silos."""
    if schedule == "constant" or total_rounds <= 1:
        return base_lr
    progress = min(max(round_number - 1, 0), total_rounds) / total_rounds
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduled_lr(base_lr: float, round_number: int, total_rounds: int, schedule: str = "cosine",
                 decay: float = 1.0) -> float:
    """LR of 1-based round `round_number`: `cosine` and `constant` as cosine_lr; `exponential` multiplies by
    `decay` once per round (FedSEAL: 0.995), starting from base_lr in round 1."""
    if schedule == "exponential":
        return base_lr * decay ** max(round_number - 1, 0)
    return cosine_lr(base_lr, round_number, total_rounds, schedule)


def shuffled_batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Index batches of one epoch. A trailing batch of one is dropped: batch norm needs two samples."""
    order = torch.randperm(n, generator=generator)
    batches = list(order.split(batch_size))
    if len(batches) > 1 and len(batches[-1]) < 2:
        batches.pop()
    return batches


def train_supervised(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    opt: OptimizerSettings,
    mean: list[float],
    std: list[float],
    device: torch.device,
    generator: torch.Generator,
    flip: bool = True,
) -> float:
    """Plain CE training on weakly augmented labeled images (SemiFL's ServerUpdate). Returns the mean loss."""
    if len(images) < 2 or epochs <= 0:
        return float("nan")
    model.to(device).train()
    optimizer = make_sgd(model, lr, opt)
    total, steps = 0.0, 0
    for _ in range(epochs):
        for idx in shuffled_batches(len(images), batch_size, generator):
            x = to_float(weak_augment(images[idx], flip=flip, generator=generator), mean, std).to(device)
            loss = F.cross_entropy(model(x), labels[idx].to(device))
            sgd_step(model, optimizer, loss, opt.grad_clip)
            total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


@torch.no_grad()
def predict_logits(
    model: nn.Module,
    images: torch.Tensor,
    mean: list[float],
    std: list[float],
    device: torch.device,
    batch_size: int = 500,
    weak: bool = False,
    flip: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Logits in eval mode (static BN statistics), optionally on the weak view. Returned on the CPU."""
    model.to(device).eval()
    out = []
    for start in range(0, len(images), batch_size):
        x = images[start : start + batch_size]
        if weak:
            x = weak_augment(x, flip=flip, generator=generator)
        out.append(model(to_float(x, mean, std).to(device)).float().cpu())
    if not out:
        return torch.zeros(0, 0)
    return torch.cat(out)


def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    mean: list[float],
    std: list[float],
    device: torch.device,
) -> dict[str, float]:
    logits = predict_logits(model, images, mean, std, device)
    return {
        "accuracy": float((logits.argmax(1) == labels).float().mean()),
        "loss": float(F.cross_entropy(logits, labels)),
    }


def clean_batches(images: torch.Tensor, mean: list[float], std: list[float], device: torch.device, batch_size=250):
    """Un-augmented float batches, for static-BN statistics."""
    for start in range(0, len(images), batch_size):
        yield to_float(images[start : start + batch_size], mean, std).to(device)


def seeded_generator(*parts: int) -> torch.Generator:
    """A generator whose seed depends on (seed, round, purpose...): a resumed run draws the same numbers."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def hub_update(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, **train_args) -> float:
    """SemiFL's ServerUpdate (train_supervised with the same arguments) followed by the static-BN statistics of
    the hub's labeled images."""
    loss = train_supervised(model, images, labels, **train_args)
    compute_static_bn(model, clean_batches(images, train_args["mean"], train_args["std"], train_args["device"]))
    return loss
