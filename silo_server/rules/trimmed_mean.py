"""trimmed_mean (Yin et al. 2018): per coordinate, drop the k = floor(trim_fraction x n) largest and k smallest
of the n silos' values and average the rest. Any trim_fraction above 0 cuts at least one value at each end (while
n >= 3): taken literally, the default 0.1 cut nothing below ten silos, so the usual small federation got the plain
mean under a rule configured to resist a silo pushing values off."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from silo_server.rules.base import AggregationRule, Group, GroupResult, register

if TYPE_CHECKING:
    from silo_server.rounds.robust import AggregationSection


def coordinate_wise(stack: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of the sorted values [lo, hi) of every coordinate of ``stack`` (n x ...), and how many coordinates of
    each of the n rows fell inside that band."""
    n = stack.shape[0]
    values, order = stack.sort(dim=0)
    kept = torch.bincount(order[lo:hi].reshape(-1), minlength=n)
    return values[lo:hi].mean(dim=0), kept


@register("trimmed_mean")
class TrimmedMean(AggregationRule):
    """A coordinate-wise rule: each coordinate of u is the mean of a band of the sorted values, so a silo's weight
    does not count (a silo cannot buy a bigger part by claiming more images). A silo's part is how many of its
    coordinates fell inside the band, against (hi - lo) / n of them were every silo alike; never inside the band
    counts it as excluded."""

    exclusive_options = ("trim_fraction",)

    def band(self, n: int, settings: AggregationSection) -> tuple[int, int]:
        """The sorted positions [lo, hi) kept of n values: k cut at each end, at least one when trim_fraction > 0,
        never all of them (k <= (n-1)/2)."""
        k = math.floor(settings.trim_fraction * n)
        if settings.trim_fraction > 0:
            k = max(k, 1)
        k = min(k, (n - 1) // 2)
        return k, n - k

    def aggregate_group(self, group: Group, settings: AggregationSection) -> GroupResult:
        n = len(group.silos)
        lo, hi = self.band(n, settings)
        sums: dict[str, torch.Tensor] = {}
        kept = torch.zeros(n, dtype=torch.float64)
        coordinates = 0
        for name in group.delta_names:
            value, inside = coordinate_wise(group.stack(name), lo, hi)
            sums[name] = value * group.total
            kept += inside
            coordinates += value.numel()
        expected = coordinates * (hi - lo) / n  # a silo's coordinates in the band if every silo were alike
        return GroupResult(sums, {s: float(kept[i]) / expected for i, s in enumerate(group.silos)})
