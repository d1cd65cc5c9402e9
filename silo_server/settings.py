"""The hub's settings, grouped by the part that uses them; HubSettings.from_config fills them from hub.yaml and Hub is
built from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from silo_core.tensors import TensorSpec

if TYPE_CHECKING:
    from silo_server.config import HubConfig

HALF_MIN_ELEMENTS = 1024


@dataclass(frozen=True)
class RoundSettings:
    """hub.yaml `rounds` (and run.seed): how many rounds, how many silos each samples and how long it waits.
    Each of sampling and quorum is a fraction, or a count when the count is given (never a value read as either)."""

    total_rounds: int
    silos_per_round: float = 1.0
    silos_per_round_count: int | None = None
    min_silos: int = 1
    quorum: float = 0.5
    quorum_silos: int | None = None
    deadline_s: float = 600.0
    max_attempts: int = 5
    seed: int = 0
    wait_after_quorum_s: float | None = None  # None: twice the round's median report time, at least 10 s
    # Weighted runs: no silo carries more than this many times the median images declared by the round's sampled
    # silos (security.max_weight_factor).
    max_weight_factor: float = 4.0


@dataclass(frozen=True)
class WireLimits:
    """hub.yaml `wire` (and security.max_update_norm): what an upload may be."""

    max_upload_bytes: int = 512 << 20
    max_inflight_upload_bytes: int = 64 << 20
    max_update_norm: float | None = None
    half_precision: bool = False


@dataclass(frozen=True)
class HubSettings:
    """All hub.yaml says about how the hub runs rounds and takes calls: the rounds (RoundLoop), the uploads
    (TaskIntake) and when a silo counts as gone (SiloRegistry)."""

    rounds: RoundSettings
    wire: WireLimits = field(default_factory=WireLimits)
    liveness_s: float = 60.0

    @classmethod
    def from_config(cls, config: HubConfig) -> HubSettings:
        r, w = config.rounds, config.wire
        return cls(
            RoundSettings(r.total, r.silos_per_round, r.silos_per_round_count, r.min_silos, r.quorum, r.quorum_silos,
                          r.deadline_s, r.max_attempts, config.run.seed, r.wait_after_quorum_s,
                          config.security.max_weight_factor),
            WireLimits(w.max_upload_bytes, w.max_inflight_upload_bytes, config.security.max_update_norm,
                       w.half_precision),
            r.liveness_s,
        )


def wire_specs(expected: dict[str, TensorSpec], half: bool) -> dict[str, TensorSpec]:
    """With half precision, large float32 tensors (weights, deltas) travel as float16; small ones (weights, counts)
    stay float32 so that counts remain exact."""
    if not half:
        return dict(expected)
    return {name: TensorSpec(spec.shape, "float16")
            if spec.dtype == "float32" and math.prod(spec.shape) >= HALF_MIN_ELEMENTS else spec
            for name, spec in expected.items()}
