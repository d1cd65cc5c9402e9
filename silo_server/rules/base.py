"""The aggregation rule interface (hub.yaml `aggregation.rule`) and the registry of rules by name.

Every algorithm's result is made of groups (RoundPlan.groups; one group "" when it has none): a group holds a
weight ``<g>weight`` = w_i and weighted model changes ``<g>delta/*`` = w_i x (trained - received). A rule works on
each group on its own, on the silos that uploaded that group, with their model changes u_i = delta_i / w_i. It
replaces the group's weighted mean of the u_i by its estimate u and hands the algorithm the sums it expects:
``<g>delta/*`` = W x u and ``<g>weight`` = W, where W = sum_i w_i, so the algorithm's division by the summed weight
yields u and its finish_round is unchanged (HASSLE's four models are four groups).

A rule also says what it needs and what it composes with (class attributes below), and ``check`` turns that into
the one refusal that hub.yaml validation (silo_server/config.py) and the round loop (round_loop.py) both raise.
silo_server/rounds/robust.py does the plumbing around a rule: the update files, the groups, the round's decision record.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch

from silo_core.algorithms import ALGORITHMS
from silo_core.algorithms.base import HubAlgorithm

if TYPE_CHECKING:
    from silo_server.rounds.robust import AggregationSection


class AggregationRefused(Exception):
    """The rule cannot aggregate this round (too few updates for Krum): the round fails and is retried."""


@dataclass
class Group:
    """One result group of one round, as a rule sees it: the silos that uploaded it, in sorted order, their weights
    w_i, the group's delta names, ``read`` (one tensor of one silo as uploaded, float64, read from its update file
    when asked, so a rule holds at most one tensor of every silo at once) and FLTrust's trusted update g0 (None
    unless the rule needs_trusted_update)."""

    silos: list[str]
    weights: dict[str, float]
    delta_names: list[str]
    read: Callable[[str, str], torch.Tensor]
    root: Mapping[str, torch.Tensor] | None = None

    @property
    def total(self) -> float:
        """W = sum_i w_i, the weight the algorithm divides the group's sums by."""
        return sum(self.weights.values())

    def change(self, silo: str, name: str) -> torch.Tensor:
        """u_i = delta_i / w_i for one tensor: the silo's model change, whatever weight it claims."""
        return self.read(silo, name) / self.weights[silo]

    def stack(self, name: str) -> torch.Tensor:
        """Every silo's model change of one tensor, stacked (n x the tensor's shape)."""
        return torch.stack([self.change(s, name) for s in self.silos])

    def weighted_sums(self, coefficients: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """``<g>delta/*`` = W x sum_i a_i u_i, reading one silo's tensor at a time; a silo with a_i = 0 is never
        read. With no silo chosen (FLTrust: no update points the root's way) the change is zero."""
        sums: dict[str, torch.Tensor] = {}
        for name in self.delta_names:
            out: torch.Tensor | None = None
            for s in self.silos:
                if coefficients[s] == 0.0:
                    continue
                term = self.change(s, name) * coefficients[s]
                out = term if out is None else out.add_(term)
            if out is None:
                out = torch.zeros_like(self.change(self.silos[0], name))
            sums[name] = out * self.total
        return sums

    def mean_parts(self, coefficients: Mapping[str, float]) -> dict[str, float]:
        """Each silo's part a_i in u against its part w_i / W in the weighted mean (1: as in the mean)."""
        return {s: coefficients[s] * self.total / self.weights[s] for s in self.silos}


@dataclass
class GroupResult:
    """What a rule makes of one group: ``sums`` (each delta name -> W x u) and ``parts`` (each silo's part in u
    against its part in the mean: 0 counts it as excluded, under half as down-weighted, in the round's record)."""

    sums: dict[str, torch.Tensor]
    parts: dict[str, float]


class AggregationRule(ABC):
    """One way to combine a group's updates. Rules hold no state: every method takes hub.yaml's `aggregation`
    section, and the registry makes a fresh object for each use.

    What a rule declares (class attributes; ``check`` refuses a run that breaks them):
    - needs_updates: the rule reads each silo's update, so the hub keeps every upload in its own file for the
      round (UpdateStore). False only for mean, which the hub sums as uploads arrive (silo_server/rounds/aggregate.py).
    - composes_with_secure_aggregation, composes_with_dp: whether the rule runs under the privacy layer, which
      gives the hub only the sum of the updates. A rule that needs_updates composes with neither (register
      refuses the claim).
    - needs_trusted_update: the rule weighs the updates against the hub's own model change (FLTrust's root of
      trust, HubAlgorithm.trusted_update), so the algorithm must compute one.
    - exclusive_options: the aggregation keys this rule reads that the plain mean does not (trim_fraction,
      krum_byzantine, multi_krum_keep); setting one in hub.yaml under a rule that reads none of it is refused, so
      an operator does not believe it applies.
    """

    name: ClassVar[str] = ""  # set by @register
    needs_updates: ClassVar[bool] = True
    composes_with_secure_aggregation: ClassVar[bool] = False
    composes_with_dp: ClassVar[bool] = False
    needs_trusted_update: ClassVar[bool] = False
    exclusive_options: ClassVar[tuple[str, ...]] = ()

    def min_updates(self, settings: AggregationSection) -> int:
        """The fewest updates a group needs under this rule (a round with fewer fails and is retried)."""
        return 1

    def min_updates_reason(self, settings: AggregationSection) -> str:
        """Why the rule needs min_updates, completing "aggregation.rule: <name> ... updates a round"."""
        return f"needs at least {self.min_updates(settings)}"

    @abstractmethod
    def aggregate_group(self, group: Group, settings: AggregationSection) -> GroupResult:
        """The group's sums W x u, and each silo's part in u against its part in the mean."""

    def check(self, settings: AggregationSection, algorithm: HubAlgorithm | type[HubAlgorithm], *,
              secure_aggregation: bool = False, dp: bool = False, min_silos: int | None = None,
              silos_per_round_count: int | None = None) -> None:
        """Raise ValueError, phrased for hub.yaml, when this rule cannot run with this algorithm, privacy and round
        size. ``min_silos`` None: the caller does not know the round size (the round loop), and a round with fewer
        than min_updates fails instead (AggregationRefused)."""
        name = self.name
        if secure_aggregation and not self.composes_with_secure_aggregation:
            raise ValueError(f"aggregation.rule: {name} needs each silo's update, which secure aggregation hides "
                             "from the hub (privacy.secure_aggregation.enabled): only aggregation.rule: mean works "
                             "with it")
        if dp and not self.composes_with_dp:
            raise ValueError(f"aggregation.rule: {name} does not compose with privacy.dp yet: its noise is "
                             "calibrated to the sum of the clipped updates; use aggregation.rule: mean")
        if self.needs_updates and not algorithm.needs_silos:
            raise ValueError(f"aggregation.rule: {name} has nothing to aggregate: algorithm {algorithm.name!r} "
                             "trains on the hub alone; use aggregation.rule: mean")
        if self.needs_trusted_update and not algorithm.has_trusted_update():
            able = [n for n, e in ALGORITHMS.items() if e.hub.needs_silos and e.hub.has_trusted_update()]
            raise ValueError(f"aggregation.rule: {name} needs the hub's own update on its labels, which algorithm "
                             f"{algorithm.name!r} does not compute yet; it works with: {', '.join(able)}")
        fewest = self.min_updates(settings)
        if min_silos is not None and fewest > 1 and (
                min_silos < fewest or (silos_per_round_count or fewest) < fewest):
            raise ValueError(f"aggregation.rule: {name} {self.min_updates_reason(settings)} updates a round: "
                             f"set rounds.min_silos (and rounds.silos_per_round_count, if set) to {fewest} or more")


# ---------------------------------------------------------------------------------------------- the registry
RULES: dict[str, type[AggregationRule]] = {}  # name -> rule, in registration order (hub.yaml aggregation.rule)

R = TypeVar("R", bound=type[AggregationRule])


def register(name: str) -> Callable[[R], R]:
    """Class decorator: make a rule available as hub.yaml ``aggregation.rule: <name>``."""

    def add(cls: R) -> R:
        if name in RULES:
            raise ValueError(f"aggregation rule {name!r} is registered already ({RULES[name].__qualname__})")
        if cls.needs_updates and (cls.composes_with_secure_aggregation or cls.composes_with_dp):
            raise TypeError(f"aggregation rule {name!r} needs each silo's update, so it cannot compose with secure "
                            "aggregation or DP: the privacy layer gives the hub only the sum")
        cls.name = name
        RULES[name] = cls
        return cls

    return add


def get_rule(name: str) -> AggregationRule:
    """The registered rule called ``name``."""
    try:
        return RULES[name]()
    except KeyError:
        raise ValueError(f"unknown aggregation.rule {name!r}; choose one of {', '.join(RULES)}") from None
