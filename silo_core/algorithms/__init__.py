"""Registry of algorithms: name -> (options model, hub half, silo half or None for hub-only algorithms)."""

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


def get_algorithm(name: str) -> AlgorithmEntry:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None
