"""krum (Blanchard et al. 2017): each silo's score is the sum of squared distances between its model change and
its n - f - 2 nearest neighbours'; the silo with the lowest score is the update. Needs n >= 2f + 3."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from silo_server.rules.base import AggregationRefused, AggregationRule, Group, GroupResult, register

if TYPE_CHECKING:
    from silo_server.rounds.robust import AggregationSection


def fewest_updates(byzantine: int) -> int:
    """n >= 2f + 3: with fewer, the n - f - 2 neighbours an honest update is scored against may be hostile."""
    return 2 * byzantine + 3


def krum_scores(distances: torch.Tensor, byzantine: int) -> torch.Tensor:
    """Krum's score of each of n updates: the sum of its squared distances to its n - f - 2 nearest neighbours
    (``distances``: n x n squared distances)."""
    n = distances.shape[0]
    neighbours = n - byzantine - 2
    scores = []
    for i in range(n):
        others = torch.cat([distances[i, :i], distances[i, i + 1:]])
        scores.append(others.sort().values[:neighbours].sum())
    return torch.stack(scores)


def krum_select(distances: torch.Tensor, byzantine: int, keep: int) -> list[int]:
    """The ``keep`` updates with the lowest Krum scores (krum: keep = 1), in order of score."""
    n = distances.shape[0]
    fewest = fewest_updates(byzantine)
    if n < fewest:
        raise AggregationRefused(f"Krum tolerates f = {byzantine} hostile silos (aggregation.krum_byzantine) only "
                                 f"with at least 2f + 3 = {fewest} updates; this round has {n}")
    order = krum_scores(distances, byzantine).argsort().tolist()
    return order[: min(keep, n)]


@register("krum")
class Krum(AggregationRule):
    """Selects whole updates by their distances to each other (f = aggregation.krum_byzantine); the selected
    silos' changes are averaged with their weights. A silo's part is its weight's share of the selected ones
    against its share of all (0: not selected)."""

    exclusive_options = ("krum_byzantine",)

    def min_updates(self, settings: AggregationSection) -> int:
        return fewest_updates(settings.krum_byzantine)

    def min_updates_reason(self, settings: AggregationSection) -> str:
        return (f"with aggregation.krum_byzantine {settings.krum_byzantine} needs at least 2f + 3 = "
                f"{self.min_updates(settings)}")

    def keep(self, n: int, settings: AggregationSection) -> int:
        """How many of the n updates are selected."""
        return 1

    def aggregate_group(self, group: Group, settings: AggregationSection) -> GroupResult:
        silos, n = group.silos, len(group.silos)
        distances = torch.zeros(n, n, dtype=torch.float64)
        for name in group.delta_names:
            flat = group.stack(name).reshape(n, -1)
            distances += torch.cdist(flat, flat).square()
        chosen = [silos[i] for i in krum_select(distances, settings.krum_byzantine, self.keep(n, settings))]
        chosen_weight = sum(group.weights[s] for s in chosen)
        coefficients = {s: group.weights[s] / chosen_weight if s in chosen else 0.0 for s in silos}
        return GroupResult(group.weighted_sums(coefficients), group.mean_parts(coefficients))
