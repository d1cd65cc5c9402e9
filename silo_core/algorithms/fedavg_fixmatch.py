"""FedAvg+FixMatch: the vanilla combination of FedAvg and FixMatch that SemiFL's ablation measures (SemiFL Fig. 4a,
Table 2; also the FedMatch/FedRGD style), a baseline every SSFL method must beat.

As this file runs it:

    hub:   W_1 <- random init, or `init_epochs` of CE on the labels (0 = vanilla)               (init_state)
    for t = 1..T:
        hub sends W_t to the sampled silos                                                       (begin_round)
        in parallel:
          silo k: E epochs over its images; EVERY batch is pseudo-labeled by the model being trained:
                  y = argmax f(a(u); W_k), mask = max softmax >= tau
                  loss = lambda_u * mean_batch(mask * CE(f(A(u); W_k), y))
                  send (W_k - W_t) * n_k and n_k
          hub:    E_s epochs of CE on a(x_s) from W_t, as one more participant with weight n_hub   (finish_round)
        hub:   W_{t+1} = W_t + (sum_k n_k delta_k + n_hub delta_hub) / (sum_k n_k + n_hub); sBN statistics
               from the hub's labeled images (our models keep no running statistics of their own)

Unlike SemiFL there is no fine-tune of the aggregate and no pseudo-labelling with the global model: that is what
makes it the "vanilla" baseline. `supervised.py` reuses the hub half with true labels at the silos.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.nn import functional as F

from silo_core.algorithms.base import (
    HubAlgorithm,
    HubState,
    RoundPlan,
    SGDOptions,
    SiloAlgorithm,
    SiloData,
    SiloResult,
    StrongAugmentOptions,
    apply_mean_delta,
    delta_specs,
    load_model,
    model_tensors,
    weighted_delta,
)
from silo_core.algorithms.semifl import pseudo_label_metrics
from silo_core.augment import strong_augment, weak_augment
from silo_core.data import image_batches, readable
from silo_core.sbn import compute_static_bn
from silo_core.tensors import TensorSpec
from silo_core.training import (
    LocalWork,
    augmentation_batch,
    autocast,
    clean_batches,
    make_sgd,
    model_input,
    on_device,
    pinned,
    seeded_generator,
    sgd_step,
    shuffled_batches,
    train_supervised,
)


class ParallelFedAvgOptions(SGDOptions):
    """FedAvg with the hub as one more participant; SemiFL's optimiser settings (the ablation's source)."""

    init_epochs: int = Field(0, ge=0, le=1000,
                             description="hub epochs on its labels before round 1 (0: vanilla random start)")
    hub_epochs: int = Field(5, ge=0, le=1000,
                            description="E_s: the hub's own epochs per round, in parallel with the silos")
    local_epochs: int = Field(5, ge=1, le=1000, description="E: silo epochs per round")
    local_steps: int | None = Field(None, ge=1, le=1_000_000, description="silo SGD steps per round instead of "
                                    "local_epochs (passes repeat as needed); default: count epochs")
    hub_batch_size: int = Field(10, ge=2, le=65536, description="B_s")
    silo_batch_size: int = Field(10, ge=2, le=65536, description="B_m")
    hub_participates: bool = Field(True, description="average the hub's model in with the silos'")
    aggregation: Literal["uniform", "samples"] = Field(
        "uniform", description="uniform: every participant weighs 1 (SemiFL's code); samples: weighted by images")


class FedAvgFixMatchOptions(ParallelFedAvgOptions, StrongAugmentOptions):
    tau: float = Field(0.95, ge=0.0, le=1.0, description="FixMatch confidence threshold")
    unlabeled_weight: float = Field(1.0, ge=0.0, description="lambda_u, the weight of the unlabeled loss")


class ParallelFedAvgHub(HubAlgorithm):
    """Hub half shared by the FedAvg baselines: send W, average the silos' models with the hub's own."""

    options: ParallelFedAvgOptions

    def _train_hub(self, model: nn.Module, round_number: int, epochs: int) -> float:
        """Train on the hub's labels, batches from round_number's own stream (0: the warm-up before round 1, which
        shares round 1's learning rate, not its batches)."""
        o, spec = self.options, self.model_spec
        return train_supervised(
            model, self.data.labeled_images, self.data.labeled_labels, epochs=epochs, batch_size=o.hub_batch_size,
            lr=o.lr_at(max(round_number, 1), self.total_rounds), opt=o.optimizer(), mean=spec.mean, std=spec.std,
            device=self.device, generator=seeded_generator(self.seed, round_number, 1), flip=o.flip,
        )

    def _static_bn(self, model: nn.Module) -> None:
        spec = self.model_spec
        compute_static_bn(model.to(self.device), clean_batches(self.data.labeled_images, spec.mean, spec.std,
                                                               self.device))

    def init_state(self) -> HubState:
        torch.manual_seed(self.seed)
        model = self.initial_model()
        loss = self._train_hub(model, 0, self.options.init_epochs)
        self._static_bn(model)
        return HubState(round=0, tensors=model_tensors(model), meta={"hub_loss": loss})

    def begin_round(self, state: HubState) -> RoundPlan:
        r = state.round + 1
        expected = delta_specs(load_model(self.model_spec, state.tensors))
        expected["weight"] = TensorSpec((1,), "float32")
        return RoundPlan(round=r, tensors=dict(state.tensors), expected=expected,
                         hyperparameters={"lr": self.options.lr_at(r, self.total_rounds), "seed": self.seed},
                         unit_weight=self.options.aggregation == "uniform")

    def finish_round(
        self, state: HubState, summed: Mapping[str, torch.Tensor], summed_metrics: Mapping[str, float]
    ) -> tuple[HubState, dict[str, float]]:
        r, o = state.round + 1, self.options
        model = load_model(self.model_spec, state.tensors)
        silo_weight = float(summed["weight"].sum()) if "weight" in summed else 0.0
        sums = {k: v.clone() for k, v in summed.items() if k.startswith("delta/")}
        metrics: dict[str, float] = {"aggregated_weight": silo_weight}
        hub_weight = 0.0
        if o.hub_participates:
            # The hub trains from the same W_t as the silos: "in parallel", only later in wall-clock time.
            hub_model = load_model(self.model_spec, state.tensors)
            start = {n: p.detach().clone() for n, p in hub_model.named_parameters()}
            metrics["hub_loss"] = self._train_hub(hub_model, r, o.hub_epochs)
            hub_weight = 1.0 if o.aggregation == "uniform" else float(len(self.data.labeled_labels))
            for name, delta in weighted_delta(hub_model, start, hub_weight).items():
                sums[name] = sums[name] + delta if name in sums else delta
        apply_mean_delta(model, sums, silo_weight + hub_weight)
        self._static_bn(model)
        metrics.update(pseudo_label_metrics(summed_metrics))
        return HubState(round=r, tensors=model_tensors(model), meta=dict(state.meta)), metrics

    def served_model(self, state: HubState) -> nn.Module:
        return load_model(self.model_spec, state.tensors).eval()


class FedAvgFixMatchHub(ParallelFedAvgHub):
    name = "fedavg-fixmatch"
    options: FedAvgFixMatchOptions


def fixmatch_loss(weak_logits: torch.Tensor, strong_logits: torch.Tensor, tau: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FixMatch's unlabeled loss: mean over the batch of 1[max p(weak) >= tau] * CE(strong, argmax p(weak)).
    The pseudo-label is a constant (no gradient through the weak view). Returns (loss, pseudo-labels, mask)."""
    confidence, pseudo = weak_logits.detach().softmax(dim=1).max(dim=1)
    mask = (confidence >= tau).float()
    loss = (F.cross_entropy(strong_logits, pseudo, reduction="none") * mask).mean()
    return loss, pseudo, mask.bool()


class FedAvgFixMatchSilo(SiloAlgorithm):
    name = "fedavg-fixmatch"
    options: FedAvgFixMatchOptions

    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult:
        o, spec, device = self.options, self.model_spec, self.device
        gen = seeded_generator(int(plan.hyperparameters.get("seed", 0)), plan.round, zlib.crc32(data.silo_id.encode()))
        n = len(data.images)
        metrics = {"pl_total": 0.0, "pl_selected": 0.0}
        if n < 2:
            return SiloResult(tensors={}, metrics=metrics, skipped=True)
        model = on_device(load_model(spec, plan.tensors), device)
        start = {k: p.detach().clone() for k, p in model.named_parameters()}
        model.train()
        optimizer = make_sgd(model, float(plan.hyperparameters["lr"]), o.optimizer())
        total_loss, steps, correct = 0.0, 0, 0.0
        work = LocalWork(o.local_epochs, o.local_steps)
        for _ in work.passes():
            # Each pass pseudo-labels the silo's images again: the counts are the last pass's, so that they count
            # images ("how many passed the threshold"), not images times local epochs.
            metrics["pl_total"], metrics["pl_selected"], correct = 0.0, 0.0, 0.0
            for idx, x in image_batches(data.images, shuffled_batches(n, o.silo_batch_size, gen), pinned(device)):
                if len(idx) < 2:  # unreadable files left fewer images than batch norm needs
                    continue
                x = augmentation_batch(x, device)
                weak = weak_augment(x, flip=o.flip, generator=gen)
                strong = strong_augment(x, num_ops=o.randaugment_ops, magnitude=o.randaugment_magnitude,
                                        cutout=o.cutout, flip=o.flip, generator=gen)
                with autocast(device):
                    # Pseudo-labels come from the model being trained, batch by batch: the vanilla choice.
                    logits = model(model_input(torch.cat([weak, strong]), device, spec.mean, spec.std))
                    loss, pseudo, mask = fixmatch_loss(logits[: len(idx)], logits[len(idx):], o.tau)
                sgd_step(model, optimizer, o.unlabeled_weight * loss, o.grad_clip)
                metrics["pl_total"] += len(idx)
                metrics["pl_selected"] += float(mask.sum())
                if data.true_labels is not None:
                    correct += float(((pseudo.cpu() == data.true_labels[idx]) & mask.cpu()).sum())
                total_loss, steps = total_loss + loss.item(), steps + 1
                if work.step():
                    break
        if data.true_labels is not None:
            metrics["pl_correct"] = correct
        # n_k: the images it trained on, less files found unreadable on the way (the count its next join declares)
        n_read = int(readable(data.images).sum())
        if n_read < 2:  # its files went unreadable while it trained (a lost mount, say): nothing to send
            return SiloResult(tensors={}, metrics=metrics, skipped=True)
        weight = 1.0 if o.aggregation == "uniform" else float(n_read)
        tensors = weighted_delta(model, start, weight)
        tensors["weight"] = torch.tensor([weight], dtype=torch.float32)
        metrics.update({"train_loss": total_loss / max(steps, 1), "train_steps": float(steps)})
        return SiloResult(tensors=tensors, metrics=metrics)
