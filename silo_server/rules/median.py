"""median (Yin et al. 2018): per coordinate, the median of the n silos' values (the mean of the two middle values
when n is even)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo_server.rules.base import register
from silo_server.rules.trimmed_mean import TrimmedMean

if TYPE_CHECKING:
    from silo_server.rounds.robust import AggregationSection


@register("median")
class Median(TrimmedMean):
    """The trimmed mean that cuts all but the middle: the band is the one middle position for an odd n, the two
    for an even n. Everything else (a silo's part, the sums) is the trimmed mean's."""

    exclusive_options = ()  # its band is fixed: trim_fraction does not apply

    def band(self, n: int, settings: AggregationSection) -> tuple[int, int]:
        return (n - 1) // 2, n // 2 + 1
