"""multi_krum (El Mhamdi et al. 2018): the m silos with the lowest Krum scores, averaged with their weights (the
paper's plain average when the weights are uniform); m = aggregation.multi_krum_keep, by default n - f."""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo_server.rules.base import register
from silo_server.rules.krum import Krum

if TYPE_CHECKING:
    from silo_server.rounds.robust import AggregationSection


@register("multi_krum")
class MultiKrum(Krum):
    """Krum keeping m updates instead of one: closer to the mean's accuracy when most silos are honest, at the
    same n >= 2f + 3."""

    exclusive_options = ("krum_byzantine", "multi_krum_keep")

    def keep(self, n: int, settings: AggregationSection) -> int:
        return settings.multi_krum_keep or n - settings.krum_byzantine
