"""mean: the weighted mean u = sum_i w_i u_i / W, the FedAvg rule and hub.yaml's default."""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo_server.rules.base import AggregationRule, Group, GroupResult, register

if TYPE_CHECKING:
    from silo_server.rounds.robust import AggregationSection


@register("mean")
class Mean(AggregationRule):
    """The weighted mean needs only the sum of the updates, so the hub adds each upload into running sums as it
    arrives (silo_server/rounds/aggregate.py) and keeps no update; for the same reason it is the one rule that composes
    with secure aggregation and DP. The round loop never calls aggregate_group for it: it gives the same sums
    (W x u = sum_i delta_i) from stored updates, for tests and for comparing rules."""

    needs_updates = False
    composes_with_secure_aggregation = True
    composes_with_dp = True

    def aggregate_group(self, group: Group, settings: AggregationSection) -> GroupResult:
        total = group.total
        coefficients = {s: group.weights[s] / total for s in group.silos}
        return GroupResult(group.weighted_sums(coefficients), {s: 1.0 for s in group.silos})
