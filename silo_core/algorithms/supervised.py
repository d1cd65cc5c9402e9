"""Fully supervised FedAvg: the ceiling of every semi-supervised method, possible ONLY in simulation.

Every silo trains on its images with their TRUE labels (which a real branch does not have: that is the whole
problem). silo-sim passes each silo its labels.json; a silo without them refuses to take part. As this file runs it:

    hub:   W_1 <- random init, or `init_epochs` of CE on the hub's labels                        (init_state)
    for t = 1..T:
        silo k: E epochs of CE(f(a(x)), y_true) from W_t; send (W_k - W_t) * n_k and n_k          (SupervisedSilo)
        hub:    E_s epochs of CE on its labels from W_t, as one more participant                  (finish_round)
                W_{t+1} = weighted mean of all participants (FedAvg: weights = image counts); sBN statistics
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch
from pydantic import Field

from silo_core.algorithms.base import (
    RoundPlan,
    SiloAlgorithm,
    SiloData,
    SiloResult,
    load_model,
    weighted_delta,
)
from silo_core.algorithms.fedavg_fixmatch import ParallelFedAvgHub, ParallelFedAvgOptions
from silo_core.data import readable
from silo_core.training import seeded_generator, train_supervised


class SupervisedOptions(ParallelFedAvgOptions):
    aggregation: Literal["uniform", "samples"] = Field(
        "samples", description="samples: FedAvg's n_k / n weights (default); uniform: every participant weighs 1")


class SupervisedHub(ParallelFedAvgHub):
    name = "supervised"
    options: SupervisedOptions


class SupervisedSilo(SiloAlgorithm):
    name = "supervised"
    needs_true_labels = True
    options: SupervisedOptions

    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult:
        o, spec = self.options, self.model_spec
        if data.true_labels is None:
            raise ValueError("the 'supervised' ceiling trains on the silos' true labels, which exist only in "
                             "simulation (silo-sim passes them); a real silo cannot take part in it")
        n = len(data.images)
        if n < 2:
            return SiloResult(tensors={}, metrics={}, skipped=True)
        gen = seeded_generator(int(plan.hyperparameters.get("seed", 0)), plan.round, zlib.crc32(data.silo_id.encode()))
        model = load_model(spec, plan.tensors)
        start = {k: p.detach().clone() for k, p in model.named_parameters()}
        loss = train_supervised(
            model, data.images, data.true_labels, epochs=o.local_epochs, steps=o.local_steps,
            batch_size=o.silo_batch_size,
            lr=float(plan.hyperparameters["lr"]), opt=o.optimizer(), mean=spec.mean, std=spec.std,
            device=self.device, generator=gen, flip=o.flip,
        )
        # n_k: less files found unreadable while training (the count its next join declares)
        n_read = int(readable(data.images).sum())
        if n_read < 2:  # its files went unreadable while it trained: nothing to send
            return SiloResult(tensors={}, metrics={}, skipped=True)
        weight = 1.0 if o.aggregation == "uniform" else float(n_read)
        tensors = weighted_delta(model, start, weight)
        tensors["weight"] = torch.tensor([weight], dtype=torch.float32)
        return SiloResult(tensors=tensors, metrics={"train_loss": loss})
