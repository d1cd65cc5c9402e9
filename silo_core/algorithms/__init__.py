"""Registry of algorithms: name -> (options model, hub half, silo half or None for hub-only algorithms).

A new algorithm is one module with its options model, its hub half and its silo half (silo_core/algorithms/base.py),
registered here by name, or from anywhere with `register_algorithm` (tests/silo_core/test_algorithm_registry.py adds
one in a few dozen lines). Hub and silo look it up by the name hub.yaml's algorithm.name gives; a silo runs only
algorithms registered in its own installation, never code the hub names."""

from __future__ import annotations

from dataclasses import dataclass

from silo_core.algorithms.base import HubAlgorithm, SiloAlgorithm
from silo_core.algorithms.fedavg_fixmatch import FedAvgFixMatchHub, FedAvgFixMatchOptions, FedAvgFixMatchSilo
from silo_core.algorithms.fedseal import FedSEALHub, FedSEALOptions, FedSEALSilo
from silo_core.algorithms.hassle import HASSLEHub, HASSLEOptions, HASSLESilo
from silo_core.algorithms.semifl import SemiFLHub, SemiFLOptions, SemiFLSilo
from silo_core.algorithms.server_only import ServerOnlyHub, ServerOnlyOptions
from silo_core.algorithms.supervised import SupervisedHub, SupervisedOptions, SupervisedSilo
from silo_core.config_base import StrictConfig


@dataclass(frozen=True)
class AlgorithmEntry:
    options: type[StrictConfig]
    hub: type[HubAlgorithm]
    silo: type[SiloAlgorithm] | None


ALGORITHMS: dict[str, AlgorithmEntry] = {
    "semifl": AlgorithmEntry(SemiFLOptions, SemiFLHub, SemiFLSilo),
    "fedseal": AlgorithmEntry(FedSEALOptions, FedSEALHub, FedSEALSilo),
    "hassle": AlgorithmEntry(HASSLEOptions, HASSLEHub, HASSLESilo),
    "server-only": AlgorithmEntry(ServerOnlyOptions, ServerOnlyHub, None),
    "fedavg-fixmatch": AlgorithmEntry(FedAvgFixMatchOptions, FedAvgFixMatchHub, FedAvgFixMatchSilo),
    "supervised": AlgorithmEntry(SupervisedOptions, SupervisedHub, SupervisedSilo),
}


def register_algorithm(name: str, options: type[StrictConfig], hub: type[HubAlgorithm],
                       silo: type[SiloAlgorithm] | None = None) -> AlgorithmEntry:
    """Add an algorithm under `name` (refused when the name is taken: an algorithm is never replaced silently)."""
    if name in ALGORITHMS:
        raise ValueError(f"an algorithm named {name!r} is already registered")
    if silo is None and hub.needs_silos:
        raise ValueError(f"algorithm {name!r} needs silos ({hub.__name__}.needs_silos) but has no silo half")
    ALGORITHMS[name] = entry = AlgorithmEntry(options, hub, silo)
    return entry


def get_algorithm(name: str) -> AlgorithmEntry:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None
