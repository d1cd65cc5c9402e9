"""Static batch norm statistics (SemiFL Appendix B).

The global statistics of every BN layer are the exact mean and (population) variance of that layer's input over a
dataset, taken in one training-mode pass (each layer normalises with batch statistics, as during training). They are
kept as per-channel sums, so that statistics from several sites could be added before dividing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def batchnorm_layers(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


@torch.no_grad()
def batchnorm_sums(model: nn.Module, batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per BN layer: '<layer>.sum', '<layer>.sumsq' (per channel, float64) and '<layer>.count' of its inputs."""
    layers = batchnorm_layers(model)
    sums: dict[str, torch.Tensor] = {}

    def hook_for(name: str):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().to(torch.float64)
            dims = [d for d in range(x.dim()) if d != 1]
            count = x.numel() // x.shape[1]
            for key, value in ((".sum", x.sum(dims)), (".sumsq", (x * x).sum(dims))):
                sums[name + key] = sums.get(name + key, 0) + value
            sums[name + ".count"] = sums.get(name + ".count", 0) + torch.tensor(float(count), dtype=torch.float64)

        return hook

    handles = [layer.register_forward_pre_hook(hook_for(name)) for name, layer in layers.items()]
    was_training = model.training
    model.train()
    try:
        for x in batches:
            model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return sums


@torch.no_grad()
def apply_batchnorm_sums(model: nn.Module, sums: dict[str, torch.Tensor]) -> None:
    """Set each BN layer's running mean/var to the exact statistics the sums describe."""
    for name, layer in batchnorm_layers(model).items():
        count = sums[name + ".count"]
        if float(count) <= 0:
            raise ValueError(f"no data reached batch-norm layer {name}")
        mean = sums[name + ".sum"] / count
        var = (sums[name + ".sumsq"] / count - mean * mean).clamp_min(0)
        layer.running_mean.copy_(mean.to(layer.running_mean.dtype))
        layer.running_var.copy_(var.to(layer.running_var.dtype))
        layer.num_batches_tracked.zero_()


def compute_static_bn(model: nn.Module, batches: Iterable[torch.Tensor]) -> None:
    apply_batchnorm_sums(model, batchnorm_sums(model, batches))
