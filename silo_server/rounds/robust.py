"""Robust aggregation (hub.yaml `aggregation.rule`): how the hub combines the silos' updates when it cannot trust
every one of them. The rules themselves live in silo_server/rules/, one module each behind one interface
(rules/base.py, which also says how a rule sees a result group); this module is hub.yaml's `aggregation` section
and the plumbing around a rule.

`mean` sums each upload as it arrives (silo_server/rounds/aggregate.py) and needs nothing here. Every rule that
needs_updates needs the individual updates: the intake writes each validated upload to its own safetensors file in
the state folder (UpdateStore), and at the round's end the rule reads them back one tensor at a time, so the hub
holds at most one tensor of every reporting silo at once (n x the largest tensor), never n models. The folder is
deleted when the round is applied or fails.

A silo's part in the result is compared with its part under the mean: none (not selected, zero trust, never
inside the kept band of a coordinate-wise rule) counts it as excluded; under half counts it as down-weighted.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from safetensors import safe_open
from safetensors.torch import save_file

from silo_core.config_base import StrictConfig
from silo_core.rounds import AggregationRound
from silo_server.rules import RULES, AggregationRefused, AggregationRule, Group, get_rule
from silo_server.rules.fltrust import fltrust_coefficients
from silo_server.rules.krum import krum_scores, krum_select
from silo_server.rules.trimmed_mean import TrimmedMean, coordinate_wise

# Where these names lived before silo_server/rules/ (imported from here by older code and tests).
__all__ = ["RULES", "UPDATES_DIR", "AggregationRefused", "AggregationSection", "UpdateStore", "aggregate",
           "coordinate_band", "coordinate_wise", "fltrust_coefficients", "krum_scores", "krum_select", "split_group"]

log = logging.getLogger("silo_server")

UPDATES_DIR = "round-updates"


def _one_of(names: Sequence[str]) -> str:
    """'a', 'b' or 'c', as pydantic lists a Literal's values."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class AggregationSection(StrictConfig):
    """hub.yaml `aggregation`: the rule that combines the silos' updates (module docstring)."""

    rule: str = Field("mean", description="a registered rule (silo_server/rules/): mean, trimmed_mean, median, "
                                          "krum, multi_krum or fltrust")
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5, description="trimmed_mean: the share cut at each end")
    krum_byzantine: int = Field(1, ge=0, le=10_000, description="krum, multi_krum: f, the hostile silos tolerated")
    multi_krum_keep: int | None = Field(None, ge=1, le=10_000,
                                        description="multi_krum: m, the silos averaged (default n - f)")

    @field_validator("rule", mode="before")
    @classmethod
    def _registered(cls, rule: Any) -> Any:
        if not isinstance(rule, str) or rule not in RULES:
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": _one_of(list(RULES))})
        return rule

    @model_validator(mode="after")
    def _rule_options(self) -> AggregationSection:
        readers: dict[str, list[str]] = {}
        for name, rule in RULES.items():
            for option in rule.exclusive_options:
                readers.setdefault(option, []).append(name)
        for option, names in readers.items():
            # Set in hub.yaml (even to its default) under a rule that never reads it: refused by name.
            if option in self.model_fields_set and self.rule not in names:
                raise ValueError(f"aggregation.{option} applies to aggregation.rule: {_one_of(names)} only; "
                                 f"remove it or choose that rule")
        return self

    def aggregator(self) -> AggregationRule:
        """The rule object this section names."""
        return get_rule(self.rule)

    @property
    def fewest_silos(self) -> int:
        """The fewest updates a group needs under this rule (Krum: n >= 2f + 3)."""
        return self.aggregator().min_updates(self)


def coordinate_band(n: int, rule: str, trim_fraction: float) -> tuple[int, int]:
    """The sorted positions [lo, hi) that a coordinate-wise rule (median, trimmed_mean) keeps out of n values."""
    coordinate_rule = get_rule(rule)
    if not isinstance(coordinate_rule, TrimmedMean):
        raise ValueError(f"aggregation.rule {rule} is not coordinate-wise")
    # model_copy: the median reads no trim_fraction, and a section that sets one for it is refused by validation
    return coordinate_rule.band(n, AggregationSection(rule=rule).model_copy(update={"trim_fraction": trim_fraction}))


# ---------------------------------------------------------------------------------------------- individual updates
class UpdateStore:
    """One round's individual updates: a safetensors file per silo in ``state_dir/round-updates/<task>/``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, Path] = {}

    @staticmethod
    def clear_leftovers(state_dir: Path) -> None:
        """Round folders a stopped hub left behind (their rounds will be run again)."""
        shutil.rmtree(Path(state_dir) / UPDATES_DIR, ignore_errors=True)

    def write(self, tensors: Mapping[str, torch.Tensor]) -> Path:
        path = self.folder / f"{uuid.uuid4().hex}.safetensors"
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
        return path

    def keep(self, silo_id: str, path: Path) -> None:
        self.files[silo_id] = path

    @staticmethod
    def discard(path: Path) -> None:
        path.unlink(missing_ok=True)

    def delete(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.files.clear()

    def names(self, silo_id: str) -> set[str]:
        with safe_open(str(self.files[silo_id]), framework="pt") as f:
            return set(f.keys())

    def read(self, silo_id: str, name: str) -> torch.Tensor:
        """One tensor of one silo, as float64 (the file is mapped for this read only and released after)."""
        with safe_open(str(self.files[silo_id]), framework="pt") as f:
            return f.get_tensor(name).to(torch.float64)


# ---------------------------------------------------------------------------------------------- one round
def split_group(names: Sequence[str]) -> tuple[str, list[str]]:
    """A group's weight name and its delta names; anything else cannot be aggregated robustly."""
    weights = [n for n in names if n == "weight" or n.endswith("/weight")]
    deltas = [n for n in names if n.startswith("delta/") or "/delta/" in n]
    other = sorted(set(names) - set(weights) - set(deltas))
    if len(weights) != 1 or other:
        raise ValueError(f"robust aggregation needs each result group to be one weight and delta/* tensors; "
                         f"this algorithm sends {', '.join(other or weights)}: use aggregation.rule: mean")
    return weights[0], deltas


def aggregate(store: UpdateStore, groups: Mapping[str, Sequence[str]], settings: AggregationSection,
              root: Callable[[], Mapping[str, torch.Tensor]] | None = None
              ) -> tuple[dict[str, torch.Tensor], AggregationRound]:
    """The sums the algorithm expects, from the stored updates under ``settings.rule``, and the rule's decision.
    ``root`` gives the trusted update of a rule that needs one (FLTrust: the hub's own model change, names as in
    the plan, weight 1)."""
    rule = settings.aggregator()
    present = {silo: store.names(silo) for silo in sorted(store.files)}
    sums: dict[str, torch.Tensor] = {}
    share: dict[str, list[float]] = {silo: [] for silo in present}  # the silo's part against its part in the mean
    root_update = root() if rule.needs_trusted_update and root is not None else None
    if rule.needs_trusted_update and root_update is None:
        raise ValueError(f"aggregation.rule: {rule.name} needs the hub's trusted update, which this algorithm lacks")
    for names in groups.values():
        weight_name, delta_names = split_group(names)
        silos = [s for s, held in present.items() if weight_name in held]
        if not silos:
            continue
        weights = {s: float(store.read(s, weight_name).sum()) for s in silos}
        group = Group(silos, weights, delta_names, store.read, root_update)
        result = rule.aggregate_group(group, settings)
        sums.update(result.sums)
        for silo, part in result.parts.items():
            share[silo].append(part)
        sums[weight_name] = torch.tensor([group.total], dtype=torch.float64)
    excluded = sorted(s for s, parts in share.items() if parts and max(parts) == 0)
    down = sorted(s for s, parts in share.items() if parts and 0 < min(parts) < 0.5)
    decision = AggregationRound(rule=settings.rule, updates=len(present), down_weighted=len(down),
                                excluded=len(excluded), excluded_silos=tuple(excluded),
                                down_weighted_silos=tuple(down))
    return sums, decision
