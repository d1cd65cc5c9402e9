"""Tests build many small hubs with a few of hub.yaml's settings changed each: this helper takes those settings as
flat keywords and builds the typed HubSettings that Hub is made from (HubSettings.from_config does it for hub.yaml)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from silo_core.algorithms.base import HubAlgorithm
from silo_server.hub import Hub, HubSettings, RoundSettings, WireLimits

_ROUNDS = {f.name for f in fields(RoundSettings)}
_WIRE = {f.name for f in fields(WireLimits)}


def build_hub(algorithm: HubAlgorithm, *, liveness_s: float = 60.0, **keywords: Any) -> Hub:
    rounds = {k: keywords.pop(k) for k in list(keywords) if k in _ROUNDS}
    wire = {k: keywords.pop(k) for k in list(keywords) if k in _WIRE}
    return Hub(algorithm, HubSettings(RoundSettings(**rounds), WireLimits(**wire), liveness_s), **keywords)
