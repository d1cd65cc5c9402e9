"""Run an algorithm's hub and silo halves in one process, without the wire: the benchmark's fast path.

The objects are the very ones the deployment runs behind gRPC; only transport is skipped, so the numbers carry over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from silo_core.algorithms import get_algorithm
from silo_core.algorithms.base import HubAlgorithm, HubData, HubState, SiloAlgorithm, SiloData
from silo_core.data import load_labeled_folder, load_unlabeled_folder
from silo_core.models import ModelSpec
from silo_core.rounds import RoundRecord, Sampling, Scores
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
    on_round: Callable[[RoundRecord], None] | None = None,
    round_hyperparameters: dict[str, Any] | None = None,
    validate: Callable[[HubState], dict[str, float]] | None = None,
    silos_per_round_count: int | None = None,
) -> tuple[HubState, list[RoundRecord]]:
    """`round_hyperparameters` are added to every plan, as the hub core adds them (privacy.sample_dp); `validate`
    and `evaluate` score each round's state as the hub's validation split and test set do (validation_*, test_*).
    Each round samples the fraction `silos_per_round` of the silos, or `silos_per_round_count` of them when given
    (hub.yaml's rounds.silos_per_round and rounds.silos_per_round_count)."""
    if not 0 < silos_per_round <= 1:
        raise ValueError(f"silos_per_round is a fraction in (0, 1], got {silos_per_round}; for a number of silos "
                         "pass silos_per_round_count")
    state = hub.init_state()
    history: list[RoundRecord] = []
    # The deployed hub's draw (Sampling): the same seed and silo names sample the same silos in every round.
    sampling = Sampling(silos_per_round, silos_per_round_count, seed)
    by_name = {data.silo_id or f"silo-{i:03d}": data for i, data in enumerate(silos)}
    if len(by_name) != len(silos):
        raise ValueError("every silo needs its own silo_id: they seed the silos' randomness and the sampling")
    for _ in range(rounds):
        started = time.time()
        plan = hub.begin_round(state)
        plan.hyperparameters.update(round_hyperparameters or {})
        sums = RunningSum()
        sampled: list[SiloData] = []
        silo_seconds, skipped = 0.0, 0
        if hub.needs_silos and silo is not None and silos:
            sampled = [by_name[name] for name in sampling.sample(list(by_name), state.round + 1)]
            for data in sampled:
                silo_started = time.time()
                result = silo.local_update(plan, data)
                silo_seconds += time.time() - silo_started
                skipped += result.skipped
                sums.add({} if result.skipped else result.tensors, result.metrics)
        aggregation_started = time.time()
        state, metrics = hub.finish_round(state, sums.result(), sums.metrics)
        aggregation_seconds = time.time() - aggregation_started
        # The same record and timings as the deployment's hub (aggregation_seconds, evaluation_seconds,
        # silo_train_seconds: a silo's mean), so that the two can be compared phase by phase. Every sampled silo
        # reports here: none drops out.
        scoring_started = time.time()
        validation = validate(state) if validate is not None else None
        test = evaluate(state) if evaluate is not None else None
        record = RoundRecord(
            round=state.round, scores=Scores.measured(test=test, validation=validation),
            silos_sampled=len(sampled), silos_reported=len(sampled), silos_skipped=skipped, silos_dropped=0,
            silos_contributed=sums.contributors, aggregation_seconds=aggregation_seconds,
            evaluation_seconds=time.time() - scoring_started if validate is not None or evaluate is not None else None,
            silo_train_seconds=silo_seconds / len(sampled) if sampled else None,
            silo_train_loss=sums.metrics["train_loss"] / sums.contributors
            if "train_loss" in sums.metrics and sums.contributors else None,
            round_seconds=time.time() - started, algorithm=dict(metrics))
        history.append(record)
        if on_round is not None:
            on_round(record)
    return state, history


def replay_staged(work: Path, method: str, options: dict[str, Any], rounds: int, seed: int = 0,
                  model: str = "small_cnn", device: torch.device | None = None) -> list[RoundRecord]:
    """The rounds a silo-sim run staged in `work` took over the wire, again in one process: the same images (its
    PNG files), silo names (they seed each silo's randomness), options and seed, every silo in every round (the
    hub's sampling of a fraction is its own), and every CPU core, as silo-sim's hub and worker use (another thread
    count sums in another order: 0.6 points apart after 3 rounds at 1 thread against 2). Returns every round's
    metrics with the test accuracy."""
    work, device = Path(work), device or torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return _replay(work, method, options, rounds, seed, model, device)
    finally:
        torch.set_num_threads(threads)


def _replay(work: Path, method: str, options: dict[str, Any], rounds: int, seed: int, model: str,
            device: torch.device) -> list[RoundRecord]:
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


def run_silo_sim(work: Path, out: Path, args: list[str]) -> dict[str, Any]:
    """Run the silo-sim command (hub and silo processes over gRPC + mutual TLS) staging in `work`; returns its
    summary.json (every round's metrics). No baseline run: callers compare against their own."""
    command = [sys.executable, "-m", "silo_sim.cli", "--workdir", str(work), "--out", str(out), "--no-baseline", *args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"silo-sim failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((Path(out) / "summary.json").read_text())
