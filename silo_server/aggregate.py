"""Streaming aggregation: each accepted result is added into running sums and dropped at once, so the hub's memory
does not grow with the number of reporting silos."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class RunningSum:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.metrics: dict[str, float] = {}
        self.contributors = 0

    def add(self, tensors: Mapping[str, torch.Tensor], metrics: Mapping[str, float]) -> None:
        for name, t in tensors.items():
            # float64 accumulation: a sum over hundreds of silos must not lose the small deltas.
            value = t.to(torch.float64) if t.is_floating_point() else t
            if name in self.tensors:
                self.tensors[name] += value
            else:
                self.tensors[name] = value.clone()
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + float(value)
        if tensors:
            self.contributors += 1

    def result(self) -> dict[str, torch.Tensor]:
        return {k: (v.to(torch.float32) if v.is_floating_point() else v) for k, v in self.tensors.items()}
