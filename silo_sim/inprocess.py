"""Run an algorithm's hub and silo halves in one process, without the wire: the benchmark's fast path.

The objects are the very ones the deployment runs behind gRPC; only transport is skipped, so the numbers carry over.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from silo_core.algorithms.base import HubAlgorithm, HubState, SiloAlgorithm, SiloData
from silo_server.aggregate import RunningSum


def run_inprocess(
    hub: HubAlgorithm,
    silo: SiloAlgorithm | None,
    silos: list[SiloData],
    rounds: int,
    silos_per_round: float = 1.0,
    seed: int = 0,
    evaluate: Callable[[HubState], dict[str, float]] | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    round_hyperparameters: dict[str, Any] | None = None,
) -> tuple[HubState, list[dict[str, Any]]]:
    """`round_hyperparameters` are added to every plan, as the hub core adds them (privacy.sample_dp)."""
    state = hub.init_state()
    history: list[dict[str, Any]] = []
    rng = random.Random(seed)
    for _ in range(rounds):
        started = time.time()
        plan = hub.begin_round(state)
        plan.hyperparameters.update(round_hyperparameters or {})
        sums = RunningSum()
        sampled: list[SiloData] = []
        if hub.needs_silos and silo is not None and silos:
            count = max(1, int(silos_per_round * len(silos))) if silos_per_round <= 1 else int(silos_per_round)
            sampled = rng.sample(silos, min(count, len(silos)))
            for data in sampled:
                result = silo.local_update(plan, data)
                sums.add({} if result.skipped else result.tensors, result.metrics)
        state, metrics = hub.finish_round(state, sums.result(), sums.metrics)
        entry: dict[str, Any] = {"round": state.round, **metrics, "silos_sampled": len(sampled),
                                 "silos_contributed": sums.contributors}
        if evaluate is not None:
            entry.update({f"test_{k}": v for k, v in evaluate(state).items()})
        entry["round_seconds"] = time.time() - started
        history.append(entry)
        if on_round is not None:
            on_round(entry)
    return state, history
