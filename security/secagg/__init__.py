"""Secure aggregation (SecAgg+, Bell et al. 2020, on Bonawitz et al. 2017), transport-free.

The hub learns the sum of the silos' quantized tensors and nothing else about any one silo's tensors, even when
silos drop out at any stage, as long as every silo keeps at least t of its k neighbours; below that the round is
abandoned, never answered with a wrong sum. The silo side is `SiloSession`, the hub side `HubSession`; they
exchange opaque bytes (JSON and safetensors) that a wire layer relays. See hub.py and silo.py for the algebra.

Threat model: an honest-but-curious hub and silos (and a network that may alter relayed shares, which AES-GCM
detects). A hub that substitutes public keys is an active attack this layer alone does not stop: Bonawitz et al.'s
malicious-server variant adds signatures over the advertised keys and a consistency round.
"""

from security.secagg.hub import HubSession, RoundAbandoned, SecAggResult
from security.secagg.messages import ProtocolError
from security.secagg.params import QuantizationRule, SecAggParams
from security.secagg.primitives import TamperedShare
from security.secagg.quantize import CapacityError, Rule, check_capacity, max_silos
from security.secagg.silo import SecAggError, SiloSession

__all__ = [
    "CapacityError",
    "HubSession",
    "ProtocolError",
    "QuantizationRule",
    "Rule",
    "RoundAbandoned",
    "SecAggError",
    "SecAggParams",
    "SecAggResult",
    "SiloSession",
    "TamperedShare",
    "check_capacity",
    "max_silos",
]
