"""Privacy accounting shared by the hub (client-level DP, security/dp.py) and the silos (their DP-SGD ledger,
silo_core/dp_sgd.py; the branch's own ledger, silo_client/ledger.py): one accountant both import, from below.

RDP (Opacus' analysis) or PRV (Opacus' accountant) over a ledger of our own, with a JSON state and a look-ahead.
Opacus is imported only when an epsilon is computed, so reading a ledger needs neither Opacus nor torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

_ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))  # Opacus' default RDP orders


@functools.lru_cache(maxsize=64)
def _rdp_curve(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of one step of the sampled Gaussian mechanism at every order (Opacus' analysis)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=_ALPHAS))


class PrivacyAccountant:
    """RDP (Opacus' analysis) or PRV (Opacus' accountant) over our own ledger, with a JSON state and a look-ahead.

    The ledger is a list of (noise multiplier, sampling rate, steps), consecutive equal (z, q) merged; epsilon is
    reported at `delta`. It is ours, not Opacus' private `history`, so an Opacus upgrade that changes that
    attribute cannot silently reset a restarted hub's budget: RDP composes the per-step curves of the public
    analysis functions, PRV replays the ledger through the accountant's public `step`.
    """

    def __init__(self, mechanism: Literal["rdp", "prv"] = "rdp", delta: float = 1e-5):
        if mechanism not in ("rdp", "prv"):
            raise ValueError(f"unknown accountant {mechanism!r}; choose rdp or prv")
        self.mechanism, self.delta = mechanism, delta
        self.ledger: list[tuple[float, float, int]] = []

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        if not (noise_multiplier > 0 and 0 < sample_rate <= 1 and steps >= 1):
            raise ValueError("a step needs noise_multiplier > 0, 0 < sample_rate <= 1 and steps >= 1")
        if self.ledger and self.ledger[-1][:2] == (noise_multiplier, sample_rate):
            self.ledger[-1] = (noise_multiplier, sample_rate, self.ledger[-1][2] + steps)
        else:
            self.ledger.append((noise_multiplier, sample_rate, steps))

    @property
    def history(self) -> list[tuple[float, float, int]]:
        return list(self.ledger)

    @property
    def steps(self) -> int:
        return sum(s for _, _, s in self.ledger)

    def epsilon(self, delta: float | None = None) -> float:
        if not self.ledger:
            return 0.0
        delta = delta or self.delta
        if self.mechanism == "prv":
            from opacus.accountants import PRVAccountant

            prv = PRVAccountant()
            for z, q, steps in self.ledger:
                for _ in range(steps):
                    prv.step(noise_multiplier=z, sample_rate=q)
            return float(prv.get_epsilon(delta=delta))
        # RDP composes additively: the curve of s steps is s times that of one, cached per (z, q), so a hub asking
        # every round pays for each curve once.
        from opacus.accountants.analysis.rdp import get_privacy_spent

        rdp = sum(steps * _rdp_curve(z, q) for z, q, steps in self.ledger)
        eps, _ = get_privacy_spent(orders=_ALPHAS, rdp=rdp, delta=delta)
        return float(eps)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> float:
        """The epsilon this accountant would report after `steps` more steps (itself unchanged)."""
        trial = PrivacyAccountant(self.mechanism, self.delta)
        trial.ledger = list(self.ledger)
        trial.step(noise_multiplier, sample_rate, steps)
        return trial.epsilon()

    def allows(self, budget: float | None, noise_multiplier: float, sample_rate: float) -> bool:
        """True if one more step keeps epsilon within the budget (always true without a budget)."""
        return budget is None or self.epsilon_after(noise_multiplier, sample_rate) <= budget

    def to_json(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "delta": self.delta,
                "history": [[float(z), float(q), int(s)] for z, q, s in self.ledger]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrivacyAccountant:
        acc = cls(d["mechanism"], float(d["delta"]))
        for z, q, s in d.get("history", []):
            z, q, s = float(z), float(q), int(s)
            if not (z > 0 and 0 < q <= 1 and s >= 1):
                raise ValueError(f"bad accountant history entry {[z, q, s]}")
            acc.ledger.append((z, q, s))
        return acc
