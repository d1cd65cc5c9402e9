"""Fixed-point encoding of real tensors into the ring Z_{2^m} that secure aggregation sums in.

A rule (clip c, bits b) maps a real x to an integer level in [0, L], L = 2^b - 1:

    x' = clamp(x, -c, c)
    u  = (x' + c) * s,        s = L / (2c)              (u in [0, L])
    q  = floor(u) + Bernoulli(u - floor(u))             (stochastic rounding: E[q] = u)

The sum over n silos of levels is at most n * L; as long as n * L < 2^m (checked by `check_capacity` before a
round: a configuration that could overflow is refused) the sum mod 2^m is the true integer sum, and

    sum_i x_i  ~=  Q / s - n * c,       Q = sum_i q_i

with an error below n / s = 2 n c / L for values inside [-c, c] (each silo's rounding error is below one level,
1/s, and is zero in expectation). Values outside [-c, c] are clipped; how many is reported to the caller.
"""

from __future__ import annotations

import fnmatch
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

MODULUS_BITS = (32, 64)
UINT = {32: np.uint32, 64: np.uint64}


class CapacityError(ValueError):
    """The configured bit widths could overflow the modulus for the number of silos in the round."""


@dataclass(frozen=True)
class Rule:
    """Tensors whose name matches `pattern` (fnmatch) are clipped to [-clip, clip] and encoded with `bits` bits."""

    pattern: str
    clip: float
    bits: int

    def __post_init__(self) -> None:
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ValueError(f"rule {self.pattern!r}: clip must be a positive finite number")
        if not 1 <= self.bits <= 48:
            raise ValueError(f"rule {self.pattern!r}: bits must be between 1 and 48")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def scale(self) -> float:
        return self.levels / (2.0 * self.clip)

    def error_bound(self, n: int) -> float:
        """Largest |decoded sum - true sum| for n silos whose values all lie in [-clip, clip]."""
        return n / self.scale

    def to_json(self) -> dict:
        return {"pattern": self.pattern, "clip": self.clip, "bits": self.bits}

    @classmethod
    def from_json(cls, d: Mapping) -> Rule:
        return cls(str(d["pattern"]), float(d["clip"]), int(d["bits"]))


def rule_for(rules: Sequence[Rule], name: str) -> Rule:
    """The first rule whose pattern matches the tensor name; every summed tensor must be covered by one."""
    for rule in rules:
        if fnmatch.fnmatchcase(name, rule.pattern):
            return rule
    raise ValueError(f"no quantization rule covers tensor {name!r}; add a rule (e.g. pattern '*')")


def max_silos(rules: Sequence[Rule], modulus_bits: int) -> int:
    """The most silos whose sum cannot wrap: the largest n with n * L < 2^m for every rule's L."""
    return min(((1 << modulus_bits) - 1) // r.levels for r in rules)


def check_capacity(rules: Sequence[Rule], modulus_bits: int, n: int) -> None:
    """Refuse a configuration where n silos at the top of some rule's range could wrap around 2^m."""
    if modulus_bits not in MODULUS_BITS:
        raise CapacityError(f"modulus bits must be one of {MODULUS_BITS}")
    if not rules:
        raise CapacityError("no quantization rules")
    for r in rules:
        if n * r.levels >= 1 << modulus_bits:
            raise CapacityError(
                f"{n} silos x (2^{r.bits} - 1) levels for tensors {r.pattern!r} can exceed the modulus 2^{modulus_bits}; "
                f"at most {max_silos(rules, modulus_bits)} silos fit: lower bits or raise modulus_bits"
            )
    # Decoding goes through float64; keep every possible sum exactly representable.
    if n * max(r.levels for r in rules) >= 1 << 53:
        raise CapacityError("sums beyond 2^53 cannot be decoded exactly; lower bits")


def encode(x: torch.Tensor, rule: Rule, modulus_bits: int, generator: np.random.Generator
           ) -> tuple[np.ndarray, int]:
    """Levels of a real tensor as a flat uint array of the ring's width, and how many values were clipped."""
    v = x.detach().to("cpu", torch.float64).reshape(-1).numpy()
    if not np.isfinite(v).all():
        raise ValueError("cannot encode NaN or infinite values")
    clipped = int(np.count_nonzero(np.abs(v) > rule.clip))
    u = (np.clip(v, -rule.clip, rule.clip) + rule.clip) * rule.scale
    q = np.floor(u)
    q += generator.random(u.shape) < (u - q)  # stochastic rounding: up with probability frac(u)
    np.clip(q, 0, rule.levels, out=q)
    return q.astype(UINT[modulus_bits]), clipped


def decode_sum(q: np.ndarray, rule: Rule, count: int) -> torch.Tensor:
    """The real sum of `count` silos' values from the integer sum of their levels (float64)."""
    return torch.from_numpy(q.astype(np.float64) / rule.scale - count * rule.clip)


def rounding_generator(seed: int | None = None) -> np.random.Generator:
    """Stochastic rounding needs fresh randomness (not secret, but it must not be predictable per silo)."""
    return np.random.default_rng(secrets.randbits(128) if seed is None else seed)
