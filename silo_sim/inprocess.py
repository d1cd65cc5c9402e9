"""Run an algorithm's hub and silo halves in one process, without the wire: the benchmark's fast path.

The objects are the very ones the deployment runs behind gRPC; only transport is skipped, so the numbers carry over.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from silo_core.algorithms import get_algorithm
from silo_core.algorithms.base import HubAlgorithm, HubData, HubState, SiloAlgorithm, SiloData
from silo_core.data import load_labeled_folder, load_unlabeled_folder
from silo_core.models import ModelSpec
from silo_core.training import evaluate as evaluate_model
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


def replay_staged(work: Path, method: str, options: dict[str, Any], rounds: int, seed: int = 0,
                  model: str = "small_cnn", device: torch.device | None = None) -> list[dict[str, Any]]:
    """The rounds a silo-sim run staged in `work` took over the wire, again in one process: the same images (its
    PNG files), silo names (they seed each silo's randomness), options and seed, every silo in every round (the
    hub's sampling of a fraction is its own). Returns every round's metrics with the test accuracy."""
    work, device = Path(work), device or torch.device("cpu")
    entry = get_algorithm(method)
    opts = entry.options.model_validate(options)
    labeled = load_labeled_folder(work / "hub" / "labeled", 28, 1)
    test = load_labeled_folder(work / "hub" / "test", 28, 1)
    validation = load_labeled_folder(work / "hub" / "validation", 28, 1) if (work / "hub" / "validation").is_dir() else None
    silos = []
    for folder in sorted((work / "silos").iterdir()):
        images = load_unlabeled_folder(folder / "images", 28, 1).images
        true_labels = torch.tensor(json.loads((folder / "labels.json").read_text()), dtype=torch.int64)
        silos.append(SiloData(images=images, true_labels=true_labels, silo_id=folder.name))
    spec = ModelSpec(name=model, num_classes=len(test.classes))
    hub_data = HubData(labeled.images, labeled.labels, *((validation.images, validation.labels) if validation else ()))
    hub = entry.hub(opts, spec, hub_data, device, seed, rounds)
    silo = entry.silo(opts, spec, device) if entry.silo is not None else None
    _, history = run_inprocess(hub, silo, silos, rounds, 1.0, seed, evaluate=lambda state: evaluate_model(
        hub.served_model(state), test.images, test.labels, spec.mean, spec.std, device))
    return history
