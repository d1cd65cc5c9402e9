"""Robust aggregation (hub.yaml `aggregation.rule`): how the hub combines the silos' updates when it cannot trust
every one of them.

`mean` sums each upload as it arrives (silo_server/aggregate.py) and needs nothing here. Every other rule needs
the individual updates: the intake writes each validated upload to its own safetensors file in the state folder
(UpdateStore), and at the round's end the rule reads them back one tensor at a time, so the hub holds at most one
tensor of every reporting silo at once (n x the largest tensor), never n models. The folder is deleted when the
round is applied or fails.

Every algorithm's result is made of groups (RoundPlan.groups; one group "" when it has none): a group holds a
weight ``<g>weight`` and weighted model changes ``<g>delta/*`` = weight x (trained - received). A rule works on each
group on its own, on the silos that uploaded that group, with their model changes u_i = delta_i / weight_i. It
replaces the group's weighted mean of the u_i by a robust estimate u and hands the algorithm the sums it expects:
``<g>delta/*`` = W x u and ``<g>weight`` = W, where W is the group's summed weight, so the algorithm's division by
the summed weight yields u and its finish_round is unchanged (HASSLE's four models are four groups).

- trimmed_mean (Yin et al. 2018): per coordinate, drop the k = floor(trim_fraction x n) largest and k smallest
  values, average the rest.
- median (Yin et al. 2018): per coordinate, the median (the mean of the two middle values when n is even).
- krum (Blanchard et al. 2017): each silo's score is the sum of squared distances to its n - f - 2 nearest
  neighbours; the silo with the lowest score is the update. Needs n >= 2f + 3.
- multi_krum (El Mhamdi et al. 2018): the m silos with the lowest Krum scores, averaged with their weights
  (the paper's plain average when the weights are uniform).
- fltrust (Cao et al. 2021): the hub's own update g0 on its labels is the root of trust; each silo's trust score
  is ReLU(cos(u_i, g0)), its update is rescaled to the norm of g0, and u = sum TS_i (|g0|/|u_i|) u_i / sum TS_i.

A silo's part in the result is compared with its part under the mean: none (not selected, zero trust, never
inside the kept band of a coordinate-wise rule) counts it as excluded; under half counts it as down-weighted.
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from safetensors import safe_open
from safetensors.torch import save_file

from silo_core.config_base import StrictConfig
from silo_core.rounds import AggregationRound

log = logging.getLogger("silo_server")

RULES = ("mean", "trimmed_mean", "median", "krum", "multi_krum", "fltrust")
UPDATES_DIR = "round-updates"


class AggregationSection(StrictConfig):
    """hub.yaml `aggregation`: the rule that combines the silos' updates (module docstring)."""

    rule: Literal["mean", "trimmed_mean", "median", "krum", "multi_krum", "fltrust"] = Field(
        "mean", description="mean, trimmed_mean, median, krum, multi_krum or fltrust")
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5, description="trimmed_mean: the share cut at each end")
    krum_byzantine: int = Field(1, ge=0, le=10_000, description="krum, multi_krum: f, the hostile silos tolerated")
    multi_krum_keep: int | None = Field(None, ge=1, le=10_000,
                                        description="multi_krum: m, the silos averaged (default n - f)")

    @model_validator(mode="after")
    def _rule_options(self) -> AggregationSection:
        if self.multi_krum_keep is not None and self.rule != "multi_krum":
            raise ValueError("aggregation.multi_krum_keep applies to aggregation.rule: multi_krum only")
        return self

    @property
    def fewest_silos(self) -> int:
        """The fewest updates a group needs under this rule (Krum: n >= 2f + 3)."""
        return 2 * self.krum_byzantine + 3 if self.rule in ("krum", "multi_krum") else 1


class AggregationRefused(Exception):
    """The rule cannot aggregate this round (too few updates for Krum): the round fails and is retried."""


# ---------------------------------------------------------------------------------------------- the rules' arithmetic
def coordinate_band(n: int, rule: str, trim_fraction: float) -> tuple[int, int]:
    """The sorted positions [lo, hi) a coordinate-wise rule keeps out of n values."""
    if rule == "median":
        return (n - 1) // 2, n // 2 + 1
    k = min(math.floor(trim_fraction * n), (n - 1) // 2)
    return k, n - k


def coordinate_wise(stack: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of the sorted values [lo, hi) of every coordinate of ``stack`` (n x ...), and how many coordinates of
    each of the n rows fell inside that band."""
    n = stack.shape[0]
    values, order = stack.sort(dim=0)
    kept = torch.bincount(order[lo:hi].reshape(-1), minlength=n)
    return values[lo:hi].mean(dim=0), kept


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
    if n < 2 * byzantine + 3:
        raise AggregationRefused(f"Krum tolerates f = {byzantine} hostile silos (aggregation.krum_byzantine) only "
                                 f"with at least 2f + 3 = {2 * byzantine + 3} updates; this round has {n}")
    order = krum_scores(distances, byzantine).argsort().tolist()
    return order[: min(keep, n)]


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
    ``root`` gives FLTrust's trusted update (the hub's own model change, names as in the plan, weight 1)."""
    present = {silo: store.names(silo) for silo in sorted(store.files)}
    sums: dict[str, torch.Tensor] = {}
    share: dict[str, list[float]] = {silo: [] for silo in present}  # the silo's part against its part in the mean
    root_update = root() if settings.rule == "fltrust" and root is not None else None
    if settings.rule == "fltrust" and root_update is None:
        raise ValueError("aggregation.rule: fltrust needs the hub's trusted update, which this algorithm lacks")
    for names in groups.values():
        weight_name, delta_names = split_group(names)
        silos = [s for s, held in present.items() if weight_name in held]
        if not silos:
            continue
        weights = {s: float(store.read(s, weight_name).sum()) for s in silos}
        total = sum(weights.values())
        change = functools.partial(_model_change, store, weights)  # u_i = delta_i / weight_i, one tensor
        parts = _group(settings, silos, weights, delta_names, change, root_update, sums, total)
        for silo, part in parts.items():
            share[silo].append(part)
        sums[weight_name] = torch.tensor([total], dtype=torch.float64)
    excluded = sorted(s for s, parts in share.items() if parts and max(parts) == 0)
    down = sorted(s for s, parts in share.items() if parts and 0 < min(parts) < 0.5)
    decision = AggregationRound(rule=settings.rule, updates=len(present), down_weighted=len(down),
                                excluded=len(excluded), excluded_silos=tuple(excluded),
                                down_weighted_silos=tuple(down))
    return sums, decision


def _model_change(store: UpdateStore, weights: Mapping[str, float], silo: str, name: str) -> torch.Tensor:
    return store.read(silo, name) / weights[silo]


def _group(settings: AggregationSection, silos: list[str], weights: dict[str, float], delta_names: list[str],
           change: Callable[[str, str], torch.Tensor], root: Mapping[str, torch.Tensor] | None,
           sums: dict[str, torch.Tensor], total: float) -> dict[str, float]:
    """Write one group's robust sums; return each silo's part in them against its part in the mean (1: equal)."""
    n, rule = len(silos), settings.rule
    if rule in ("median", "trimmed_mean"):
        lo, hi = coordinate_band(n, rule, settings.trim_fraction)
        kept = torch.zeros(n, dtype=torch.float64)
        coordinates = 0
        for name in delta_names:
            value, inside = coordinate_wise(torch.stack([change(s, name) for s in silos]), lo, hi)
            sums[name] = value * total
            kept += inside
            coordinates += value.numel()
        expected = coordinates * (hi - lo) / n  # a silo's coordinates in the band if every silo were alike
        return {s: float(kept[i]) / expected for i, s in enumerate(silos)}
    if rule in ("krum", "multi_krum"):
        distances = torch.zeros(n, n, dtype=torch.float64)
        for name in delta_names:
            flat = torch.stack([change(s, name).reshape(-1) for s in silos])
            distances += torch.cdist(flat, flat).square()
        keep = 1 if rule == "krum" else settings.multi_krum_keep or n - settings.krum_byzantine
        chosen = [silos[i] for i in krum_select(distances, settings.krum_byzantine, keep)]
        chosen_weight = sum(weights[s] for s in chosen)
        coefficients = {s: weights[s] / chosen_weight if s in chosen else 0.0 for s in silos}
    else:  # fltrust
        assert root is not None
        missing = [name for name in delta_names if name not in root]
        if missing:
            raise ValueError(f"the hub's trusted update lacks {', '.join(missing[:3])}: fltrust cannot weigh them")
        dots = torch.zeros(n, dtype=torch.float64)
        squares = torch.zeros(n, dtype=torch.float64)
        root_square = 0.0
        for name in delta_names:
            g0 = root[name].to(torch.float64)
            root_square += float(g0.square().sum())
            for i, s in enumerate(silos):
                u = change(s, name)
                dots[i] += (u * g0).sum()
                squares[i] += u.square().sum()
        values, trust = fltrust_coefficients(dots, squares.sqrt(), math.sqrt(root_square))
        coefficients = {s: float(values[i]) for i, s in enumerate(silos)}
        log.info("fltrust trust scores: %s", ", ".join(f"{s} {float(trust[i]):.3f}" for i, s in enumerate(silos)))
        trusted = float(trust.sum())
        parts = {s: (float(trust[i]) / trusted * n if trusted > 0 else 0.0) for i, s in enumerate(silos)}
        _weighted_sums(silos, coefficients, delta_names, change, sums, total)
        return parts
    _weighted_sums(silos, coefficients, delta_names, change, sums, total)
    return {s: coefficients[s] * total / weights[s] for s in silos}


def _weighted_sums(silos: list[str], coefficients: dict[str, float], delta_names: list[str],
                   change: Callable[[str, str], torch.Tensor], sums: dict[str, torch.Tensor], total: float) -> None:
    """sums[name] = W x sum_i a_i u_i, reading one silo's tensor at a time."""
    for name in delta_names:
        out: torch.Tensor | None = None
        for s in silos:
            if coefficients[s] == 0.0:
                continue
            term = change(s, name) * coefficients[s]
            out = term if out is None else out.add_(term)
        if out is None:  # nothing chosen (FLTrust: no update points the root's way): no change
            out = torch.zeros_like(change(silos[0], name))
        sums[name] = out * total
