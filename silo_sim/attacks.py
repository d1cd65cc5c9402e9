"""Simulated poisoning attacks (simulation only): what a hostile silo sends instead of its honest update, to show
what hub.yaml `aggregation.rule` buys (silo_server/rounds/robust.py).

An attack runs after the silo's honest local training and rewrites only the model changes of its result. Every
algorithm's result is made of groups (RoundPlan.groups; one group "" when it has none), each a weight
``<g>weight`` and weighted model changes ``<g>delta/*`` = weight x (trained - received). The weights are left as
the silo declared them (the hub checks them against its image count), so the attack is a well-formed upload that
passes every validation of the wire and moves the mean as far as its deltas can.

- ``sign_flip``: every delta tensor becomes -scale x itself (scale 10 by default): the honest direction, reversed
  and amplified (the sign-flipping attack of Li et al. 2019, with a factor).
- ``noise``: every delta tensor is replaced by weight x Gaussian noise, mean 0 and standard deviation `scale`
  (1.0 by default) in every coordinate of the model change: a model change that looks like an update and is pure
  noise, about the size of small_cnn's weights themselves (the Gaussian attack of Fang et al. 2020 and Cao et al.
  2021, who use a far larger deviation). The noise is drawn from a generator seeded by the silo's name and the
  round, so a run is reproducible whatever order silos train in.
- ``weight``: every weight tensor becomes -scale x itself (30 by default), deltas untouched: a weight no honest silo
  could send. In the clear the hub refuses the upload; under secure aggregation it makes the round's sum fail its
  check, which is how silo_server/rounds/breaker.py's search for the breaker is tested.

A real silo never poisons: silo-client has no flag for this; silo-sim's `--attackers K --attack KIND` sets it on
its first K simulated silos (silo_sim/worker.py wraps their algorithm: SiloSettings.wrap_algorithm), and the in-process benchmark wraps its
silo half the same way.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Mapping
from typing import Literal, get_args

import torch

from silo_core.algorithms.base import RoundPlan, SiloAlgorithm, SiloData, SiloResult
from silo_core.tensors import TensorSpec

AttackKind = Literal["sign_flip", "noise", "weight"]
ATTACKS: tuple[str, ...] = get_args(AttackKind)
POISONING: tuple[str, ...] = ("sign_flip", "noise")  # well-formed updates that pass every check: robust rules' job
DEFAULT_SCALES: dict[str, float] = {"sign_flip": 10.0, "noise": 1.0, "weight": 30.0}  # factor; the noise's deviation


def check_attack(kind: str, where: str = "attack") -> AttackKind:
    """The attack named ``kind``, or a ValueError naming the ones there are (``where``: the flag or key that set it)."""
    if kind not in ATTACKS:
        raise ValueError(f"{where} {kind!r} is no attack; choose one of {', '.join(ATTACKS)}")
    return kind  # type: ignore[return-value]


def is_delta(name: str) -> bool:
    """A weighted model change (``delta/*`` or ``<g>/delta/*``): what an attack rewrites."""
    return name.startswith("delta/") or "/delta/" in name


def attack_seed(silo_id: str, round_number: int) -> int:
    """A seed that depends only on the silo's name and the round (crc32: stable across processes, unlike hash())."""
    return zlib.crc32(f"{silo_id}/{round_number}".encode())


def group_weight(tensors: Mapping[str, torch.Tensor], delta_name: str) -> float:
    """The weight of the group a delta belongs to (``a/delta/x`` -> ``a/weight``; ``delta/x`` -> ``weight``)."""
    group = delta_name.split("delta/", 1)[0]
    return float(tensors[f"{group}weight"].sum())


def poison(tensors: Mapping[str, torch.Tensor], kind: AttackKind, seed: int,
           scale: float | None = None) -> dict[str, torch.Tensor]:
    """``tensors`` with every delta (every weight, for ``weight``) rewritten by the attack ``kind`` (``scale``: its
    factor or deviation, default DEFAULT_SCALES); the rest as it was."""
    scale = DEFAULT_SCALES[kind] if scale is None else scale
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):  # a fixed order, so the noise each tensor gets does not depend on dict order
        value = tensors[name]
        if kind == "weight":
            out[name] = value * -scale if name.split("/")[-1] == "weight" else value
        elif not is_delta(name) or not value.is_floating_point():
            out[name] = value
        elif kind == "sign_flip":
            out[name] = value * -scale
        else:  # weighted like an honest delta: the hub's division by the weight leaves N(0, scale^2) per coordinate
            noise = torch.randn(value.shape, generator=generator) * (scale * group_weight(tensors, name))
            out[name] = noise.to(value.dtype)
    return out


class PoisonedSilo(SiloAlgorithm):
    """A silo half that trains honestly with ``inner`` and then poisons its result (module docstring). Everything
    else (its model, groups, what it trains on) is the inner algorithm's, so it serves wherever a silo half does:
    the in-process runner and silo-client. ``only``: the silos (SiloData.silo_id) that attack, where one silo half
    serves every silo (the in-process runner); None: every silo this half serves (a silo-client is one silo)."""

    def __init__(self, inner: SiloAlgorithm, kind: str, scale: float | None = None,
                 only: Collection[str] | None = None):
        super().__init__(inner.options, inner.model_spec, inner.device)
        self.inner = inner
        self.kind = check_attack(kind)
        self.scale = scale
        self.only = None if only is None else frozenset(only)
        self.name = inner.name
        self.sample_dp_ledgers = inner.sample_dp_ledgers
        for flag in ("trains_on_labeled", "trains_on_unlabeled", "needs_true_labels", "supports_sample_dp"):
            setattr(self, flag, getattr(inner, flag))

    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult:
        result = self.inner.local_update(plan, data)
        if result.skipped or (self.only is not None and data.silo_id not in self.only):
            return result
        seed = attack_seed(data.silo_id, plan.round)
        return SiloResult(tensors=poison(result.tensors, self.kind, seed, self.scale), metrics=result.metrics,
                          skipped=False)

    def result_groups(self, expected: Mapping[str, TensorSpec]) -> dict[str, list[str]]:
        return self.inner.result_groups(expected)

    def receive_model(self, plan: RoundPlan, data: SiloData) -> None:
        self.inner.receive_model(plan, data)  # a round it was left out of: nothing is sent, so nothing to poison
