"""Run an algorithm's hub and silo halves in one process, without the wire: the benchmark's fast path.

The hub side is the deployed hub's own round loop (silo_server/rounds/round_loop.py: sampling, weight caps, robust
aggregation, scoring, records, checkpoints); only the transport differs (InProcessSilos instead of gRPC calls),
so the numbers carry over.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from security import validation
from silo.v1 import silo_pb2
from silo_client.privacy import SiloPrivacy
from silo_core.algorithms import get_algorithm
from silo_core.algorithms.base import HubAlgorithm, HubData, HubState, SiloAlgorithm, SiloData
from silo_core.data import load_labeled_folder, load_unlabeled_folder
from silo_core.models import ModelSpec, starting_weights
from silo_core.rounds import RoundRecord
from silo_core.training import evaluate as evaluate_model
from silo_server.config import load_config
from silo_server.rounds.privacy import HubPrivacy
from silo_server.rounds.robust import AggregationSection
from silo_server.rounds.round_loop import RoundLoop
from silo_server.rounds.task import ActiveTask
from silo_server.settings import RoundSettings
from silo_server.state.registry import ChangeCondition, SiloRegistry
from silo_server.state.scoring import RunRecords
from silo_sim.staged import StagedFederation


class InProcessSilos:
    """The round loop's transport when the silos live in this process (silo_server/rounds/round_loop.py Transport): each
    sampled silo runs its algorithm half on the round's plan, as a silo-client would on what it downloaded, and its
    result goes through the hub's checks (exact tensors, finite, weight within the round's cap) into the round;
    when the hub half broadcasts the round's model, every other silo then gets it too (receive_model). No silo drops
    out and no deadline applies: a round waits for every sampled silo. A failed round (a robust rule refusing too few
    updates) is drawn again up to rounds.max_attempts times, then the run stops."""

    silos_can_change = False

    # ------------------------------------------------------------------ privacy: the silo-client's own layer
    def _submit_private(self, loop: RoundLoop, task: ActiveTask, name: str, result: Any) -> None:
        """The silo's privacy layer (silo_client/privacy.py) on its result, with the hub's intake as its wire: DP
        clipping and noise at the silo, then either a clear upload (central noise) or the secure-aggregation
        session's first stage; the later stages are answered when the hub's stage driver hands them out
        (answer_stage). No clear metrics leave, as over the wire."""

        def send_result(_task, tensors, _metrics, skipped, _charge=None) -> int:
            HubPrivacy.check_clear_upload(task.privacy, tensors)
            with loop.cond:
                loop.accept_result(name, task, dict(tensors), {}, skipped)
            return 0

        def send_stage(_task_id, _round, stage, payload, _charge=None, _tensors=None) -> None:
            with loop.cond:
                loop.accept_stage(name, task, stage, payload, len(payload))

        privacy = self.privacies[name] = SiloPrivacy(send_result, send_stage)
        wire_task = silo_pb2.Task(task_id=task.task_id, round=task.round,
                                  privacy=task.privacy.task_privacy(task.task_id))
        privacy.submit(name, loop.records.run_id, wire_task, result, task.expected)

    def answer_stage(self, rp: Any) -> None:
        """Each silo's answer to the stage the hub's driver just handed out (silo_server/rounds/privacy.py RoundHooks)."""
        for name, payload in sorted(rp.outbox.items()):
            task = silo_pb2.Task(task_id=rp.session.session, secagg_stage=rp.outbox_stage, secagg_payload=payload)
            self.privacies[name].run_stage(task)

    def __init__(self, silo: SiloAlgorithm | None, silos: dict[str, SiloData]):
        self.silo = silo
        self.silos = silos
        self.privacies: dict[str, SiloPrivacy] = {}  # each silo's privacy layer in a private round (its session)

    def collect(self, loop: RoundLoop, task: ActiveTask) -> None:
        if self.silo is None:
            raise ValueError(f"algorithm {loop.algorithm.name!r} needs silos, but no silo half was given")
        # What a silo-client builds from the task it fetched: the hyperparameters as the wire carries them (JSON),
        # with the round's DP-SGD settings (a silo-client takes those from the task's typed privacy).
        plan = replace(task.plan, hyperparameters={**json.loads(task.hyperparameters_json),
                                                   **task.round_hyperparameters})
        for name in sorted(task.sampled):
            if loop.stop_event.is_set():
                raise InterruptedError("stopping")
            started = time.time()
            result = self.silo.local_update(plan, self.silos[name])
            if task.privacy is not None:  # DP and/or secure aggregation: what a silo-client's privacy layer sends
                self._submit_private(loop, task, name, result)
                continue
            metrics = {**result.metrics, "train_seconds": time.time() - started}
            tensors = {} if result.skipped else dict(result.tensors)
            if tensors:
                validation.check_update(tensors, task.expected, None, None, task.plan.groups,
                                        unit_weight=task.plan.unit_weight)
                if not task.plan.unit_weight:
                    validation.cap_weight(tensors, task.weight_caps.get(name, math.inf),
                                          validation.weight_prefixes(tensors))
            stored = task.updates.write(tensors) if task.updates is not None and tensors else None
            with loop.cond:
                loop.accept_result(name, task, tensors, metrics, result.skipped, stored=stored)
        if task.broadcast is not None:  # the algorithm hands the round's model to the silos left out of it too
            for name in sorted(set(self.silos) - task.sampled - task.broadcast.received):
                if loop.stop_event.is_set():
                    raise InterruptedError("stopping")
                self.silo.receive_model(plan, self.silos[name])
                with loop.cond:
                    task.broadcast.received.add(name)


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
    aggregation: AggregationSection | None = None,
    state_dir: Path | None = None,
    privacy: HubPrivacy | None = None,
    quorum: float = 1.0,
) -> tuple[HubState, list[RoundRecord]]:
    """Run `rounds` rounds of the deployed hub's round loop (silo_server/rounds/round_loop.py: sampling, weight caps,
    aggregation under hub.yaml's `aggregation` rule, scoring, records, checkpoints) with the silos in this process
    (InProcessSilos) instead of behind gRPC.

    `round_hyperparameters` are added to every plan, as the hub adds them (privacy.sample_dp); `validate` and
    `evaluate` score each round's state as the hub's validation split and test set do (validation_*, test_*).
    Each round samples the fraction `silos_per_round` of the silos, or `silos_per_round_count` of them when given
    (hub.yaml's rounds.silos_per_round and rounds.silos_per_round_count). Checkpoints and history.json go to
    `state_dir` (default: a temporary folder, removed after the run). `privacy` (HubPrivacy: secure aggregation,
    client-level DP) runs the hub's privacy layer and each silo's as over the wire (unsigned sessions: the silos
    here have no certificates), so a private benchmark's numbers come from the same round loop. Every sampled silo
    reports here; `quorum` (hub.yaml's rounds.quorum) is what the round plans for all the same: distributed DP
    noise is split over the quorum's silos (per silo total / sqrt(quorum count)), and secure aggregation survives
    down to it, as a hub with that quorum does (its default, 0.5, puts sqrt(2) times the noise of 1.0 on each silo)."""
    if not 0 < silos_per_round <= 1:
        raise ValueError(f"silos_per_round is a fraction in (0, 1], got {silos_per_round}; for a number of silos "
                         "pass silos_per_round_count")
    by_name = {data.silo_id or f"silo-{i:03d}": data for i, data in enumerate(silos)}
    if len(by_name) != len(silos):
        raise ValueError("every silo needs its own silo_id: they seed the silos' randomness and the sampling")
    if hub.needs_silos and not silos:
        raise ValueError(f"algorithm {hub.name!r} needs silos: pass at least one")
    with tempfile.TemporaryDirectory(prefix="silokit-inprocess-") as scratch:
        cond = ChangeCondition()
        registry = SiloRegistry(cond, liveness_s=math.inf)  # silos in this process never go quiet
        for name, data in by_name.items():
            unlabeled = int(data.images.shape[0]) if data.images is not None else 0
            registry.join(name, unlabeled, data.num_labeled, "cpu")
        privacy = privacy if privacy is not None and privacy.enabled else None
        # The checkpoint writer holds the accountant too, as the hub's does: a run resumed from state_dir goes on
        # with the epsilon it spent.
        records = RunRecords(state_dir or Path(scratch), evaluate=evaluate, validate=validate, privacy=privacy)
        loop = RoundLoop(
            hub, RoundSettings(total_rounds=rounds, silos_per_round=silos_per_round,
                               silos_per_round_count=silos_per_round_count, quorum=quorum, seed=seed),
            registry, records, stop_event=threading.Event(), round_hyperparameters=round_hyperparameters,
            on_round=on_round, aggregation=aggregation, transport=InProcessSilos(silo, by_name), privacy=privacy)
        state = loop.run()
        return state, list(loop.records.history)


def replay_staged(work: Path, method: str, options: dict[str, Any], rounds: int, seed: int = 0,
                  model: str | None = None, device: torch.device | None = None) -> list[RoundRecord]:
    """The rounds a silo-sim run staged in `work` took over the wire, again in one process: the same images (its
    PNG files), model (its hub.yaml's model section: geometry, normalisation, options), silo names (they seed each
    silo's randomness), options and seed, every silo in every round (the hub's sampling of a fraction is its own),
    and every CPU core, as silo-sim's hub and worker use (another thread count sums in another order: 0.6 points
    apart after 3 rounds at 1 thread against 2). `model` names another model to replay with (its default
    options). Returns every round's metrics with the test accuracy."""
    work, device = Path(work), device or torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return _replay(work, method, options, rounds, seed, model, device)
    finally:
        torch.set_num_threads(threads)


def _replay(work: Path, method: str, options: dict[str, Any], rounds: int, seed: int, model: str | None,
            device: torch.device) -> list[RoundRecord]:
    entry = get_algorithm(method)
    opts = entry.options.model_validate(options)
    config = load_config(work / "hub.yaml")  # the folders the hub read (in `work`, or in a kept federation)
    staged = config.model  # the geometry the images were staged and the hub ran with
    size, channels = staged.image_size, staged.in_channels
    labeled = load_labeled_folder(config.data.labeled.path, size, channels)
    test = load_labeled_folder(config.data.test.path, size, channels)
    validation = (load_labeled_folder(config.data.validation.path, size, channels)
                  if config.data.validation is not None else None)
    silos = []
    for silo in sorted(StagedFederation.read(work).silos, key=lambda s: s.name):  # by name, as the folders were read before
        # As the silo client reads them (silo_client/local_data.py): its unlabeled folder, if it has one, and its
        # labeled folder (--labeled-silos), which the replay dropped, so that HASSLE's labeled silos trained on less.
        images, true_labels = torch.zeros((0, channels, size, size), dtype=torch.uint8), None
        if silo.data is not None:
            images = load_unlabeled_folder(silo.data, size, channels).images
            true_labels = torch.tensor(json.loads(silo.labels.read_text()), dtype=torch.int64)
        own = load_labeled_folder(silo.labeled, size, channels) if silo.labeled is not None else None
        silos.append(SiloData(images=images, true_labels=true_labels, silo_id=silo.name,
                              labeled_images=own.images if own is not None else None,
                              labeled_labels=own.labels if own is not None else None))
    spec = ModelSpec.from_config(staged, len(labeled.classes))  # as the hub made it
    other_model = model is not None and model != spec.name
    if other_model:
        spec = replace(spec, name=model, factory=None, options={})
    hub_data = HubData(labeled.images, labeled.labels, *((validation.images, validation.labels) if validation else ()))
    hub = entry.hub(opts, spec, hub_data, device, seed, rounds)
    start = None if other_model else starting_weights(staged.init_from_run, staged.init_weights, spec)
    if start is not None:  # the staged run's starting model (another `model` starts from its own random weights)
        hub.initial_weights = start[0]
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
