"""Client-level differential privacy for federated rounds (DP-FedAvg, McMahan et al. 2018), with adaptive clipping
(Andrew et al. 2021) and accounting by Opacus' accountants.

The mechanism, per round t with clip norm C_t and noise multiplier z:

    silo i:   Delta_i <- Delta_i * min(1, C_t / ||Delta_i||_2)                (clip the update: sensitivity C_t)
    hub:      S = sum_i Delta_i + N(0, (z C_t)^2 I)                           (the Gaussian mechanism on the sum)

The noise is added either centrally (the hub, trusted with the clear sum, adds it after summing) or distributed:
each of at least m contributors adds N(0, (z C_t)^2 / m) before masking, so the securely aggregated sum carries
variance >= (z C_t)^2 and the hub never sees an un-noised sum. (A silo colluding with the hub can subtract its own
share; with c such silos the noise left is (m - c)/m of the total.)

Adaptive clipping follows a target quantile gamma of the update norms. Every silo also reports
b_i = 1[||Delta_i|| <= C_t] - 1/2 (sensitivity 1/2), the hub releases the noisy mean

    b_bar = (sum_i b_i + N(0, sigma_b^2)) / n + 1/2

and moves the clip geometrically:  C_{t+1} = C_t * exp(-eta (b_bar - gamma)).  To keep the total at noise
multiplier z, the update noise is raised to z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): two Gaussian mechanisms with
multipliers z_Delta and 2 sigma_b compose to one with multiplier z, which is what the accountant is charged.

Accounting: each applied round is one step of the sampled Gaussian mechanism with noise multiplier z and sampling
rate q = silos per round / silos enrolled (RDP by default, PRV optional). The hub samples a fixed number of silos
rather than Poisson-sampling each one; the accountant's Poisson analysis is the customary approximation.
A round that is abandoned releases nothing and costs nothing. `PrivacyAccountant.allows` tells the hub whether one
more round would still be within the epsilon budget, so training stops BEFORE the budget is exceeded.

Limits: the count of contributing silos (and their weights) is not noised: with uniform weights it is the number
of silos that reported, which the hub sees anyway. Floating-point Gaussian samples are used (a discrete Gaussian
would close the known floating-point side channels).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from silo_core.accounting import PrivacyAccountant
from silo_core.config_base import StrictConfig
from silo_core.rounds import DPRound

__all__ = ["UNCLIPPED", "AdaptiveClipping", "BudgetExhausted", "DPConfig", "DPController", "PrivacyAccountant",
           "SiloInstructions", "clip_update", "gaussian_like", "next_clip_norm", "noise_generator", "per_silo_std",
           "privatize_update", "quantization_clip", "update_noise_multiplier", "update_norm"]

UNCLIPPED = "dp/unclipped"  # the adaptive-clipping indicator, centered: b_i - 1/2


# ---------------------------------------------------------------------------------------------- configuration
class AdaptiveClipping(StrictConfig):
    enabled: bool = Field(False, description="follow a quantile of the update norms (Andrew et al. 2021)")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="gamma: the fraction of updates left unclipped")
    learning_rate: float = Field(0.2, gt=0, description="eta: C <- C * exp(-eta * (unclipped fraction - gamma))")
    count_noise_multiplier: float | None = Field(
        None, gt=0, description="sigma_b, noise std on the unclipped count (default: max(expected silos / 20, "
                                "1.64 z), i.e. at most 5% more noise on the update)"
    )
    max_clip_norm: float | None = Field(
        None, gt=0, description="the clip norm never grows past this (stated in the run's privacy terms, so a "
                                "branch policy with a maximum clip can accept the run; default: no bound)"
    )


class DPConfig(StrictConfig):
    """Client-level DP (the hub.yaml `privacy.dp` section)."""

    enabled: bool = Field(False, description="clip every silo update and add Gaussian noise to the sum")
    noise_multiplier: float = Field(1.0, gt=0, description="z: noise std on the sum is z * clip_norm")
    clip_norm: float = Field(1.0, gt=0, description="C: L2 bound on one silo's update (the initial C when adaptive)")
    clip_tensors: list[str] = Field(
        default_factory=lambda: ["delta/"], min_length=1,
        description="name prefixes of the tensors clipped together as one update and noised",
    )
    noise: Literal["auto", "central", "distributed"] = Field(
        "auto", description="who adds the noise; auto: distributed when secure aggregation is on, else central"
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta of (epsilon, delta)")
    epsilon_budget: float | None = Field(None, gt=0, description="stop before this epsilon would be exceeded")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus accountant: rdp (default) or prv")
    adaptive_clipping: AdaptiveClipping = Field(default_factory=AdaptiveClipping)

    @model_validator(mode="after")
    def _adaptive_fits(self) -> DPConfig:
        top = self.adaptive_clipping.max_clip_norm
        if top is not None and top < self.clip_norm:
            raise ValueError(f"adaptive_clipping.max_clip_norm ({top:g}) is below clip_norm ({self.clip_norm:g}), "
                             "the clip a run starts at")
        sb = self.adaptive_clipping.count_noise_multiplier
        if self.adaptive_clipping.enabled and sb is not None and 2 * sb <= self.noise_multiplier:
            raise ValueError("adaptive_clipping.count_noise_multiplier must exceed noise_multiplier / 2")
        return self


# ---------------------------------------------------------------------------------------------- silo side
@dataclass
class SiloInstructions:
    """What the hub tells every sampled silo for one round (JSON in the task)."""

    clip_norm: float
    noise_std: float  # std of the Gaussian each silo adds per coordinate (0 when the hub adds the noise)
    indicator_noise_std: float = 0.0  # std each silo adds to its unclipped indicator (distributed + adaptive)
    adaptive: bool = False
    clip_tensors: list[str] = field(default_factory=lambda: ["delta/"])

    def to_json(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "noise_std": self.noise_std,
                "indicator_noise_std": self.indicator_noise_std, "adaptive": self.adaptive,
                "clip_tensors": list(self.clip_tensors)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SiloInstructions:
        out = cls(float(d["clip_norm"]), float(d["noise_std"]), float(d.get("indicator_noise_std", 0.0)),
                  bool(d.get("adaptive", False)), [str(p) for p in d.get("clip_tensors", ["delta/"])])
        if not (out.clip_norm > 0 and out.noise_std >= 0 and out.indicator_noise_std >= 0):
            raise ValueError("DP instructions must have clip_norm > 0 and non-negative noise")
        return out


def _selected(tensors: Mapping[str, torch.Tensor], prefixes: Sequence[str]) -> list[str]:
    return sorted(n for n in tensors if any(n.startswith(p) for p in prefixes) and tensors[n].is_floating_point())


def update_norm(tensors: Mapping[str, torch.Tensor], prefixes: Sequence[str]) -> float:
    """||Delta||_2 over all selected tensors taken together as one vector."""
    return math.sqrt(sum(float(tensors[n].double().pow(2).sum()) for n in _selected(tensors, prefixes)))


def clip_update(tensors: Mapping[str, torch.Tensor], clip_norm: float, prefixes: Sequence[str]
                ) -> tuple[dict[str, torch.Tensor], float]:
    """Delta * min(1, C / ||Delta||): the selected tensors scaled together; others untouched. Returns the norm too."""
    norm = update_norm(tensors, prefixes)
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    out = dict(tensors)
    for n in _selected(tensors, prefixes):
        out[n] = tensors[n] * factor
    return out, norm


def noise_generator(seed: int | None = None) -> torch.Generator:
    """DP noise must be unpredictable to everyone else: seeded from the OS's CSPRNG unless a test pins it."""
    g = torch.Generator()
    g.manual_seed(secrets.randbits(63) if seed is None else seed)
    return g


def gaussian_like(t: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype) * std


def privatize_update(tensors: Mapping[str, torch.Tensor], instructions: SiloInstructions,
                     generator: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The silo's half: clip; in distributed mode add its share of the noise; with adaptive clipping add the
    (noised) centered indicator b_i - 1/2 as the tensor `dp/unclipped`. Returns the tensors and local stats."""
    g = generator or noise_generator()
    out, norm = clip_update(tensors, instructions.clip_norm, instructions.clip_tensors)
    if instructions.noise_std > 0:
        for n in _selected(out, instructions.clip_tensors):
            out[n] = out[n] + gaussian_like(out[n], instructions.noise_std, g)
    if instructions.adaptive:
        b = (1.0 if norm <= instructions.clip_norm else 0.0) - 0.5
        indicator = torch.tensor([b], dtype=torch.float32)
        if instructions.indicator_noise_std > 0:
            indicator = indicator + gaussian_like(indicator, instructions.indicator_noise_std, g)
        out[UNCLIPPED] = indicator
    return out, {"update_norm": norm, "clipped": float(norm > instructions.clip_norm)}


# ---------------------------------------------------------------------------------------------- noise algebra
def update_noise_multiplier(z: float, sigma_b: float | None) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2); z itself without adaptive clipping."""
    if sigma_b is None:
        return z
    if 2 * sigma_b <= z:
        raise ValueError("the count noise must exceed z / 2 for adaptive clipping")
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5


def per_silo_std(total_std: float, min_contributors: int) -> float:
    """Each of m silos adds N(0, s^2 / m): any m or more of them together carry variance >= s^2."""
    if min_contributors < 1:
        raise ValueError("distributed noise needs at least one contributor")
    return total_std / math.sqrt(min_contributors)


def next_clip_norm(clip_norm: float, unclipped_fraction: float, target: float, learning_rate: float) -> float:
    """Geometric update towards the target quantile: C * exp(-eta (b_bar - gamma))."""
    return clip_norm * math.exp(-learning_rate * (unclipped_fraction - target))


def quantization_clip(clip_norm: float, noise_std: float, tails: float = 6.0) -> float:
    """A fixed-point range that holds every clipped coordinate (|x| <= C) and all but ~2e-9 of the noise."""
    return clip_norm + tails * noise_std


# ---------------------------------------------------------------------------------------------- the hub's controller
class BudgetExhausted(RuntimeError):
    """One more round would exceed the configured epsilon budget: the hub must stop now."""


class DPController:
    """The hub's DP state machine: plan a round (instructions for silos, after a budget check), then finish it
    (central noise, adaptive clip update, one accountant step). Its state is JSON, for the hub checkpoint."""

    def __init__(self, config: DPConfig, secure_aggregation: bool, seed: int | None = None):
        self.config = config
        mode = config.noise if config.noise != "auto" else ("distributed" if secure_aggregation else "central")
        if mode == "distributed" and not secure_aggregation:
            raise ValueError("distributed noise needs secure aggregation (privacy.secure_aggregation.enabled)")
        self.mode = mode
        self.clip_norm = config.clip_norm
        self.accountant = PrivacyAccountant(config.accountant, config.delta)
        self.rounds = 0
        self.generator = noise_generator(seed)
        # Which silos a round samples is drawn from this, not from run.seed: the accountant's amplification by
        # sampling (q < 1) holds only while no one outside the hub can repeat the draw, and run.seed is in every
        # plan the silos receive. Checkpointed, so that a restarted hub keeps drawing from the same secret.
        self.sampling_seed = secrets.randbits(62) if seed is None else seed
        self.last: DPRound | None = None

    # -- per round
    def sigma_b(self, expected_silos: int) -> float | None:
        a = self.config.adaptive_clipping
        if not a.enabled:
            return None
        # Andrew et al. suggest m / 20; small federations need more so that z_Delta stays near z:
        # z_Delta = 1.05 z  <=>  2 sigma_b = z / sqrt(1 - 1/1.05^2)  <=>  sigma_b ~ 1.64 z.
        floor = self.config.noise_multiplier / (2 * math.sqrt(1 - 1 / 1.05**2))
        return a.count_noise_multiplier or max(expected_silos / 20.0, floor)

    def plan_round(self, expected_silos: int, enrolled: int, min_contributors: int) -> SiloInstructions:
        """Instructions for this round's silos; BudgetExhausted if the round would exceed the budget."""
        q = self.sample_rate(expected_silos, enrolled)
        z = self.config.noise_multiplier
        if not self.accountant.allows(self.config.epsilon_budget, z, q):
            raise BudgetExhausted(
                f"one more round would spend epsilon {self.accountant.epsilon_after(z, q):.3f} > budget "
                f"{self.config.epsilon_budget} (spent {self.accountant.epsilon():.3f} in {self.rounds} rounds)")
        sigma_b = self.sigma_b(expected_silos)
        z_delta = update_noise_multiplier(z, sigma_b)
        total_std = z_delta * self.clip_norm
        distributed = self.mode == "distributed"
        return SiloInstructions(
            clip_norm=self.clip_norm,
            noise_std=per_silo_std(total_std, min_contributors) if distributed else 0.0,
            indicator_noise_std=per_silo_std(sigma_b, min_contributors) if (distributed and sigma_b) else 0.0,
            adaptive=sigma_b is not None,
            clip_tensors=list(self.config.clip_tensors),
        )

    @staticmethod
    def sample_rate(expected_silos: int, enrolled: int) -> float:
        if enrolled < 1 or expected_silos < 1:
            raise ValueError("the sampling rate needs at least one enrolled and one sampled silo")
        return min(1.0, expected_silos / enrolled)

    def finish_round(self, summed: Mapping[str, torch.Tensor], contributors: int, expected_silos: int,
                     enrolled: int) -> tuple[dict[str, torch.Tensor], DPRound]:
        """Add the central noise (central mode), move the clip (adaptive), charge the accountant one step.
        Returns the sums the algorithm may use (without the indicator) and the round's privacy record."""
        if contributors < 1:
            raise ValueError("a DP round needs at least one contributor")
        out = dict(summed)
        sigma_b = self.sigma_b(expected_silos)
        if self.mode == "central":
            std = update_noise_multiplier(self.config.noise_multiplier, sigma_b) * self.clip_norm
            for n in _selected(out, self.config.clip_tensors):
                out[n] = out[n] + gaussian_like(out[n], std, self.generator)
        clip_norm, unclipped = self.clip_norm, None  # the clip this round's updates were held to
        if sigma_b is not None:
            b = out.pop(UNCLIPPED, None)
            if b is None:
                raise ValueError(f"adaptive clipping needs the silos' {UNCLIPPED} sum")
            noisy = float(b.sum())
            if self.mode == "central":
                noisy += float(torch.randn((), generator=self.generator, dtype=torch.float64)) * sigma_b
            unclipped = min(1.0, max(0.0, noisy / contributors + 0.5))
            a = self.config.adaptive_clipping
            self.clip_norm = next_clip_norm(self.clip_norm, unclipped, a.target_quantile, a.learning_rate)
            if a.max_clip_norm is not None:  # the bound the run's terms promise the silos
                self.clip_norm = min(self.clip_norm, a.max_clip_norm)
        q = self.charge(expected_silos, enrolled)
        self.last = DPRound(epsilon=self.accountant.epsilon(), delta=self.config.delta,
                            epsilon_budget=self.config.epsilon_budget, noise_multiplier=self.config.noise_multiplier,
                            sample_rate=q, clip_norm=clip_norm, unclipped_fraction=unclipped)
        return out, self.last

    def charge(self, expected_silos: int, enrolled: int) -> float:
        """One accountant step at the round's sampling rate (returned): a sum the hub saw is charged whether or not
        it is applied (a securely aggregated sum refused after unmasking was released all the same, and the silos'
        ledgers count it)."""
        q = self.sample_rate(expected_silos, enrolled)
        self.accountant.step(self.config.noise_multiplier, q)
        self.rounds += 1
        return q

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    # -- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.to_json(), "clip_norm": self.clip_norm, "rounds": self.rounds,
                "mode": self.mode, "sampling_seed": self.sampling_seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        acc = PrivacyAccountant.from_json(state["accountant"])
        if acc.mechanism != self.config.accountant or acc.delta != self.config.delta:
            raise ValueError(f"the checkpoint's accountant ({acc.mechanism}, delta {acc.delta}) differs from the "
                             f"config ({self.config.accountant}, delta {self.config.delta}); privacy spent under "
                             f"one cannot be continued under the other")
        clip = float(state["clip_norm"])
        if not clip > 0:
            raise ValueError("checkpointed clip norm must be positive")
        self.accountant, self.clip_norm, self.rounds = acc, clip, int(state["rounds"])
        if isinstance(state.get("sampling_seed"), int):  # (a checkpoint from before it was kept: a fresh secret)
            self.sampling_seed = state["sampling_seed"]
