"""Secure-aggregation settings shared by hub and silos (the hub.yaml `privacy.secure_aggregation` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from security.secagg.graph import degree_for, threshold_for
from security.secagg.quantize import Rule
from silo_core.config_base import StrictConfig


class QuantizationRule(StrictConfig):
    pattern: str = Field(description="fnmatch pattern over tensor names; the first matching rule applies")
    clip: float = Field(gt=0, description="values are clipped to [-clip, clip] before encoding")
    bits: int = Field(ge=1, le=48, description="levels per value: 2^bits - 1 across [-clip, clip]")

    def rule(self) -> Rule:
        return Rule(self.pattern, self.clip, self.bits)


def _default_rules() -> list[QuantizationRule]:
    return [
        QuantizationRule(pattern="weight", clip=1024.0, bits=20),
        QuantizationRule(pattern="*", clip=1.0, bits=20),
    ]


@dataclass(frozen=True)
class RoundShape:
    """What secure aggregation looks like for a round of `sampled` silos."""

    sampled: int
    neighbours: int  # k
    threshold: int  # t
    survives: int  # dropouts the round survives: k - t


class SecAggParams(StrictConfig):
    """SecAgg+ knobs. Defaults: a neighbourhood of ~3 log2 n, t = 2/3 of it (always a strict majority, >= 2),
    sums in Z_{2^32}, every tensor clipped to [-1, 1] in 20 bits except `weight` (up to 1024)."""

    enabled: bool = Field(False, description="mask every silo upload; the hub learns only the sum")
    neighbours: int | None = Field(
        None, ge=2, le=10_000, description="k: each silo masks with and shares among k others (None: 3*ceil(log2 n))"
    )
    threshold: float = Field(
        2 / 3, gt=0, le=1, description="t as a fraction of k (raised to a strict majority and at least 2)"
    )
    modulus_bits: Literal[32, 64] = Field(32, description="sums live in Z_{2^m}; 32 halves the upload of 64")
    quantization: list[QuantizationRule] = Field(default_factory=_default_rules, min_length=1)
    max_masked_bytes: int = Field(1 << 30, ge=1024, le=64 << 30, description="cap on one masked upload")
    stage_deadline_s: float = Field(120.0, gt=0, le=86_400, description="time limit of each stage after training "
                                    "(the stages before unmask close sooner: rounds.wait_after_quorum_s after their quorum)")
    min_cohort: int = Field(
        2, ge=2, le=100_000, description="every round's sum holds the inputs of at least this many silos: the hub "
        "samples and waits for at least this many, and states it in the run's terms (a branch policy may require more)")
    dropouts: int = Field(
        1, ge=0, le=1000, description="a round must survive this many sampled silos dropping out after they were "
        "sampled; the hub samples (and waits for) enough silos for it")

    def plan(self, n: int) -> RoundShape:
        """Neighbourhood k, threshold t and the dropouts a round of n sampled silos survives (k - t: any silo whose
        neighbourhood keeps t members can still be unmasked). ValueError when n silos cannot run at all."""
        k = degree_for(n, self.neighbours)
        t = threshold_for(k, self.threshold)
        return RoundShape(n, k, t, k - t)

    def fewest_silos(self, limit: int = 10_000) -> int:
        """The smallest round that survives `dropouts` (t must stay a strict majority of k, so each dropout to
        survive costs about two more silos in the round)."""
        for n in range(3, limit + 1):
            try:
                if self.plan(n).survives >= self.dropouts:
                    return n
            except ValueError:
                continue
        raise ValueError(f"no round of up to {limit} silos survives {self.dropouts} dropouts with threshold "
                         f"{self.threshold:g} and neighbours {self.neighbours}: lower dropouts or threshold")

    def fewest_sampled(self) -> int:
        """The fewest silos a round samples (and the hub waits for): enough to survive `dropouts`, and at least
        `min_cohort`. The hub, its --check and silo-sim's size check all ask this one method."""
        return max(self.fewest_silos(), self.min_cohort)

    @model_validator(mode="after")
    def _dropouts_possible(self) -> SecAggParams:
        if self.enabled:
            self.fewest_silos()  # ValueError: no round size survives the dropouts asked for
        return self

    @model_validator(mode="after")
    def _bits_fit(self) -> SecAggParams:
        for r in self.quantization:
            if r.bits >= self.modulus_bits:
                raise ValueError(f"rule {r.pattern!r}: bits ({r.bits}) must be below modulus_bits ({self.modulus_bits})")
        return self

    def rules(self) -> list[Rule]:
        return [r.rule() for r in self.quantization]
