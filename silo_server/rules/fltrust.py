"""fltrust (Cao et al. 2021): the hub's own update g0 on its labels is the root of trust; each silo's trust score
is TS_i = ReLU(cos(u_i, g0)), its update is rescaled to the norm of g0, and u = sum_i TS_i (|g0|/|u_i|) u_i /
sum_j TS_j."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from silo_server.rules.base import AggregationRule, Group, GroupResult, register

if TYPE_CHECKING:
    from silo_server.rounds.robust import AggregationSection

log = logging.getLogger("silo_server")


def fltrust_coefficients(dots: torch.Tensor, norms: torch.Tensor, root_norm: float) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """FLTrust's coefficient of each update u_i, given <u_i, g0>, |u_i| and |g0|: TS_i = ReLU(cos(u_i, g0)), and
    u = sum_i TS_i (|g0| / |u_i|) u_i / sum_j TS_j. Returns (coefficients, trust scores); all zero when no update
    points the root's way (the round then moves nothing)."""
    safe = norms.clamp_min(1e-30)
    trust = torch.relu(dots / (safe * max(root_norm, 1e-30)))
    trust = torch.where(norms > 0, trust, torch.zeros_like(trust))
    total = trust.sum()
    if total <= 0:
        return torch.zeros_like(trust), trust
    return trust * (root_norm / safe) / total, trust


@register("fltrust")
class FLTrust(AggregationRule):
    """Weighs each update by how far it points the way of the hub's own (group.root, HubAlgorithm.trusted_update),
    and caps its size at the root's, so neither direction nor scale can be bought; the silos' weights do not count.
    A silo's part is its trust score's share against 1 / n (0: zero trust, excluded)."""

    needs_trusted_update = True

    def aggregate_group(self, group: Group, settings: AggregationSection) -> GroupResult:
        root, silos, n = group.root, group.silos, len(group.silos)
        assert root is not None
        missing = [name for name in group.delta_names if name not in root]
        if missing:
            raise ValueError(f"the hub's trusted update lacks {', '.join(missing[:3])}: fltrust cannot weigh them")
        dots = torch.zeros(n, dtype=torch.float64)
        squares = torch.zeros(n, dtype=torch.float64)
        root_square = 0.0
        for name in group.delta_names:
            g0 = root[name].to(torch.float64)
            root_square += float(g0.square().sum())
            for i, s in enumerate(silos):
                u = group.change(s, name)
                dots[i] += (u * g0).sum()
                squares[i] += u.square().sum()
        values, trust = fltrust_coefficients(dots, squares.sqrt(), math.sqrt(root_square))
        coefficients = {s: float(values[i]) for i, s in enumerate(silos)}
        log.info("fltrust trust scores: %s", ", ".join(f"{s} {float(trust[i]):.3f}" for i, s in enumerate(silos)))
        trusted = float(trust.sum())
        parts = {s: (float(trust[i]) / trusted * n if trusted > 0 else 0.0) for i, s in enumerate(silos)}
        return GroupResult(group.weighted_sums(coefficients), parts)
