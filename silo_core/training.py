"""Training building blocks shared by the algorithms: devices, optimisers, LR schedule, supervised epochs, eval.

Pixels come only through silo_core.data's image_batches, which serves images held in memory and image files read
by DataLoader workers alike (an unreadable file is left out of its batch). On a CUDA device training and inference
run under bfloat16 autocast with channels_last models, and read batches are pinned and copied asynchronously; on
the CPU everything runs in float32 exactly as it always has.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from silo_core.augment import to_float, weak_augment
from silo_core.data import Images, image_batches, readable
from silo_core.sbn import compute_static_bn


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else the CPU; anything else is passed to torch (e.g. 'cuda:1')."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available here; use --device auto or cpu")
    return device


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on a CUDA device that has it (Ampere and later): convolutions run on tensor cores at about
    twice float32's speed, and bfloat16 keeps float32's exponent range, so no loss scaling is needed. Elsewhere (the
    CPU, older GPUs) nothing changes: float32, bit for bit as before. Static BN statistics and DP-SGD never use it.
    The capability of `device` itself decides: torch.cuda.is_bf16_supported() answers for the current device and
    counts emulated bfloat16, which pre-Ampere GPUs (V100, T4) run slower than float32."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` moved to ``device`` (in place, as nn.Module.to); on CUDA also in channels_last memory format, the
    layout cuDNN's fastest convolution kernels want (it only changes 4-D weights, so any model takes it)."""
    model.to(device)
    if device.type == "cuda":
        model.to(memory_format=torch.channels_last)
    return model


def pinned(device: torch.device) -> bool:
    """Whether batches read for ``device`` should be in page-locked memory (then copied with non_blocking)."""
    return device.type == "cuda"


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on ``device``; asynchronous from pinned memory. The augmentations draw their random numbers on the
    CPU, so a seed gives the same views wherever they run (augmentation_batch chooses where)."""
    return x.to(device, non_blocking=True)


# RandAugment works per op group (many tiny tensor steps a batch). On a GPU each is a kernel launch and many wait on
# the host (boolean masks, numbers drawn on the CPU): a SemiFL step at 28 px spent most of its 50 ms there on an
# H200, while 2 CPU cores augment a batch of 32 such images in 3 ms. So images of up to this many values each are
# augmented on the CPU before the copy; bigger ones, whose arithmetic outweighs the launches (224 px RGB: 139 ms a
# batch of 32 on 2 CPU cores), on the device (bench/README.md, "Augmenting where it is cheaper").
AUGMENT_ON_CPU_MAX_VALUES = 3 * 64 * 64


def augmentation_batch(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The uint8 batch ``x`` (read on the CPU) where it is cheaper to augment for training on ``device``."""
    small = len(x) == 0 or x[0].numel() <= AUGMENT_ON_CPU_MAX_VALUES
    return x if small else to_device(x, device)


def model_input(x: torch.Tensor, device: torch.device, mean: list[float], std: list[float]) -> torch.Tensor:
    """An (augmented) uint8 batch as the model's normalised float input on ``device``: pixels travel as bytes."""
    return to_float(to_device(x, device), mean, std)


# Whole-set passes (pseudo-labelling, scoring, static BN statistics) go in batches of at most this many input
# values: 500 images up to 64 px RGB, as always, and fewer for bigger images, whose feature maps would otherwise
# take gigabytes (500 images of 224 px through small_cnn: 1.6 GB for one of them; 41 images here).
EVAL_BATCH_VALUES = 500 * 3 * 64 * 64


def pass_batch_size(images: Images, most: int) -> int:
    """The batch size of a whole-set pass over ``images``: ``most``, fewer for big images (EVAL_BATCH_VALUES)."""
    values = int(images.shape[1]) * int(images.shape[2]) * int(images.shape[3])
    return max(1, min(most, EVAL_BATCH_VALUES // max(values, 1)))


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


class LocalWork:
    """A silo's local work in a round: `epochs` passes over its data, or, when `steps` is given, exactly that many
    SGD steps (passes repeat, each freshly shuffled, until the steps are taken; the last stops midway). Steps make
    rounds comparable across silos of different sizes and with other frameworks that count local work in steps.

        work = LocalWork(o.local_epochs, o.local_steps)
        for _ in work.passes():
            for batch in ...:
                ...one SGD step...
                if work.step():
                    break
    """

    def __init__(self, epochs: int, steps: int | None = None):
        self.epochs, self.steps, self.taken = epochs, steps, 0

    def passes(self):
        if self.steps is None:
            yield from range(self.epochs)
            return
        number = 0
        while self.taken < self.steps:
            before = self.taken
            yield number
            if self.taken == before:  # a pass with no step (no usable batch) would repeat forever
                return
            number += 1

    def step(self) -> bool:
        """Count one step; True when the step budget is spent (always False when counting epochs)."""
        self.taken += 1
        return self.steps is not None and self.taken >= self.steps


def train_supervised(
    model: nn.Module,
    images: Images,
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
    steps: int | None = None,
) -> float:
    """Plain CE training on weakly augmented labeled images (SemiFL's ServerUpdate), for `epochs` passes or
    exactly `steps` steps when given (LocalWork). Returns the mean loss."""
    if len(images) < 2 or (epochs <= 0 and steps is None):
        return float("nan")
    on_device(model, device).train()
    optimizer = make_sgd(model, lr, opt)
    total, steps_taken = 0.0, 0
    work = LocalWork(epochs, steps)
    for _ in work.passes():
        order = shuffled_batches(len(images), batch_size, generator)
        for idx, x in image_batches(images, order, pinned(device)):
            if len(idx) < 2:  # unreadable files left fewer images than batch norm needs
                continue
            x = model_input(weak_augment(augmentation_batch(x, device), flip=flip, generator=generator), device,
                            mean, std)
            with autocast(device):
                loss = F.cross_entropy(model(x), labels[idx].to(device))
            sgd_step(model, optimizer, loss, opt.grad_clip)
            total, steps_taken = total + loss.item(), steps_taken + 1
            if work.step():
                break
    return total / max(steps_taken, 1)


@torch.no_grad()
def predict_logits(
    model: nn.Module,
    images: Images,
    mean: list[float],
    std: list[float],
    device: torch.device,
    batch_size: int = 500,
    weak: bool = False,
    flip: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Logits in eval mode (static BN statistics), optionally on the weak view. Returned on the CPU, float32.

    An image whose file turns out to be unreadable gets all-zero logits (a uniform prediction); readable(images)
    tells them apart afterwards, and callers leave them out of what they select and score."""
    on_device(model, device).eval()
    if len(images) == 0:
        return torch.zeros(0, 0)
    out: torch.Tensor | None = None
    order = torch.arange(len(images)).split(pass_batch_size(images, batch_size))
    for idx, x in image_batches(images, order, pinned(device)):
        if len(idx) == 0:
            continue
        if weak:
            x = weak_augment(augmentation_batch(x, device), flip=flip, generator=generator)
        with autocast(device):
            logits = model(model_input(x, device, mean, std)).float().cpu()
        if out is None:
            out = torch.zeros(len(images), logits.shape[1])
        out[idx] = logits
    if out is None:  # not one image could be read: zero logits of the model's width
        probe = torch.zeros((1, *images.shape[1:]), dtype=torch.uint8)
        out = torch.zeros(len(images), model(to_float(probe, mean, std).to(device)).shape[1])
    return out


def evaluate(
    model: nn.Module,
    images: Images,
    labels: torch.Tensor,
    mean: list[float],
    std: list[float],
    device: torch.device,
) -> dict[str, float]:
    """Accuracy and mean cross-entropy over ``images``; an image whose file is unreadable is left out of both."""
    logits = predict_logits(model, images, mean, std, device)
    ok = readable(images)
    if not bool(ok.all()):
        logits, labels = logits[ok], labels[ok]
    return {
        "accuracy": float((logits.argmax(1) == labels).float().mean()),
        "loss": float(F.cross_entropy(logits, labels)),
    }


def clean_batches(images: Images, mean: list[float], std: list[float], device: torch.device, batch_size=250):
    """Un-augmented float batches, for static-BN statistics (unreadable files are left out)."""
    order = torch.arange(len(images)).split(pass_batch_size(images, batch_size))
    for idx, x in image_batches(images, order, pinned(device)):
        if len(idx):
            yield to_float(to_device(x, device), mean, std)


def seeded_generator(*parts: int) -> torch.Generator:
    """A generator whose seed depends on (seed, round, purpose...): a resumed run draws the same numbers."""
    seed = 0
    for p in parts:
        seed = (seed * 1_000_003 + int(p)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def hub_update(model: nn.Module, images: Images, labels: torch.Tensor, **train_args) -> float:
    """SemiFL's ServerUpdate (train_supervised with the same arguments) followed by the static-BN statistics of
    the hub's labeled images."""
    loss = train_supervised(model, images, labels, **train_args)
    device = train_args["device"]  # on_device: with 0 epochs train_supervised returned before moving the model
    compute_static_bn(on_device(model, device), clean_batches(images, train_args["mean"], train_args["std"], device))
    return loss
