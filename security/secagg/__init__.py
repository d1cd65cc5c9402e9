"""Secure aggregation (SecAgg+, Bell et al. 2020, on Bonawitz et al. 2017), transport-free.

The hub learns the sum of the silos' quantized tensors and nothing else about any one silo's tensors, even when
silos drop out at any stage, as long as every silo keeps at least t of its k neighbours; below that the round is
abandoned, never answered with a wrong sum. The silo side is `SiloSession`, the hub side `HubSession`; they
exchange opaque bytes (JSON and safetensors) that a wire layer relays, in five stages: advertise_keys,
share_keys, masked_input, consistency, unmask. See hub.py and silo.py for the algebra.

Threat model. Signed sessions (every silo holds its federation certificate, `SiloIdentity`, and checks its peers'
with a `PeerVerifier` of the CA and CRL) hold against a hub that deviates, Bonawitz et al.'s malicious-server
variant applied to SecAgg+: each silo signs its advertised keys and, in the consistency round, the survivor set it
was shown, and verifies its neighbours' signatures itself. A hub that substitutes or replays public keys, names a
revoked silo, shows different survivor sets to different silos, shrinks the cohort below a silo's policy
(`min_cohort`) or asks a silo twice, is refused by every honest silo it tries it on, and reconstructs no single
silo's update. What remains: silos that collude with the hub (as many as t of one silo's neighbours, or about
2t + 1 - k in a complete graph signing two sets) can unmask that silo; the hub alone can always stop a round
(abandon, drop silos) and chooses which silos are sampled; the network may alter relayed shares, which AES-GCM
detects. Unsigned sessions (no identity) keep the older, honest-but-curious hub model: they cannot tell
substituted keys from real ones, nor whether other silos were shown the same survivor set.
"""

from security.secagg.hub import HubSession, RoundAbandoned, SecAggResult
from security.secagg.identity import (
    IdentityError,
    PeerVerifier,
    SiloIdentity,
    advertise_statement,
    survivors_statement,
)
from security.secagg.messages import ProtocolError
from security.secagg.params import QuantizationRule, SecAggParams
from security.secagg.primitives import TamperedShare
from security.secagg.quantize import CapacityError, Rule, check_capacity, max_silos
from security.secagg.silo import SecAggError, SiloSession

__all__ = [
    "CapacityError",
    "HubSession",
    "IdentityError",
    "PeerVerifier",
    "ProtocolError",
    "QuantizationRule",
    "Rule",
    "RoundAbandoned",
    "SecAggError",
    "SecAggParams",
    "SecAggResult",
    "SiloIdentity",
    "SiloSession",
    "TamperedShare",
    "advertise_statement",
    "check_capacity",
    "max_silos",
    "survivors_statement",
]
