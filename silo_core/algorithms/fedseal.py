"""FedSEAL: semi-supervised FL with self-ensemble learning and negative learning (Bian, Fu, Xu 2021).

Algorithm 1, as this file runs it:

    hub:   w_1 <- supervised training on a(x_s), y_s; sBN statistics; tau_1 on the validation split   (init_state)
    for t = 1..T:
        hub sends w_t, the per-class thresholds tau_t and lambda_t to the sampled silos             (begin_round)
        silo k: p_t(x) = p(x; w_t) for every local image (un-augmented, static BN)                   (FedSEALSilo)
                pbar_t = (n * pbar_{t-1} + p_t) / (n + 1): the mean over every global model received, on disk
                y+ = argmax pbar_t;            D+ = {x : pbar_t[y+] > tau_t[y+]}
                C(x) = {m != y+ : pbar_t[m] < theta};  D- = {x not in D+ : C(x) not empty},  ybar ~ U(C(x))
                E_c epochs of  lambda_t * CE(f(A(x)), y+) on D+  +  -log(1 - p_ybar(a(x))) on D-
                send (w_k - w_t) * n_k and n_k        (n_k = 1: the paper's plain average)
        silo j not sampled, with ensemble_every_round (the paper): receives w_t, folds p_t into pbar, sends nothing
        hub:   wbar_t = w_t + sum_k n_k (w_k - w_t) / sum_k n_k                                      (finish_round)
               w_{t+1} <- E_s epochs of CE(f(a(x_s)), y_s) from wbar_t; sBN statistics
               tau_{t+1}[m] = clip(sum_{i in val: argmax p(x_i) = m} p_m(x_i) / den_m, lo, hi)
                              den_m = #{i in val : y_i = m} (or #{argmax p(x_i) = m}); absent class -> fallback

The paper's equations were lost in extraction; the shared papers notes reconstruct them and name the flags.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from safetensors import safe_open
from safetensors.torch import save as st_save
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
from silo_core.data import ImageFiles, Images, image_batches, readable
from silo_core.rounds import threshold_metric
from silo_core.tensors import TensorSpec
from silo_core.training import (
    LocalWork,
    augmentation_batch,
    autocast,
    hub_update,
    make_sgd,
    model_input,
    on_device,
    pinned,
    predict_logits,
    seeded_generator,
    sgd_step,
    shuffled_batches,
)

log = logging.getLogger("silo_core.fedseal")


class FedSEALOptions(SGDOptions, StrongAugmentOptions):
    """Every FedSEAL knob. Defaults: the paper where it says (lr 0.001 decaying 0.995 per round, momentum 0.9,
    theta 0.05), the shared papers notes for the reconstructed parts, SemiFL's values where neither says."""

    lr: float = Field(0.001, gt=0.0, description="paper: 0.001 at hub and silos")
    lr_schedule: Literal["cosine", "constant", "exponential"] = "exponential"
    lr_decay: float = Field(0.995, gt=0.0, le=1.0, description="paper: 0.995 per round")
    nesterov: bool = False
    init_epochs: int | None = Field(None, ge=0, le=1000,
                                    description="hub epochs for w_1 before round 1; default hub_epochs")
    hub_epochs: int = Field(5, ge=0, le=1000, description="E_s: hub fine-tune epochs per round")
    local_epochs: int = Field(5, ge=1, le=1000, description="E_c: silo epochs per round")
    local_steps: int | None = Field(None, ge=1, le=1_000_000, description="silo SGD steps per round instead of "
                                    "local_epochs (passes repeat as needed); default: count epochs")
    hub_batch_size: int = Field(10, ge=2, le=65536, description="B_s")
    silo_batch_size: int = Field(10, ge=2, le=65536, description="B_c")
    theta: float = Field(0.05, gt=0.0, lt=1.0, description="complementary labels: classes with pbar below theta")
    threshold_denominator: Literal["true_class", "predicted_class"] = Field(
        "true_class", description="den_m: validation images of class m, or those predicted as m")
    threshold_min: float = Field(0.5, ge=0.0, le=1.0, description="clip tau_m from below")
    threshold_max: float = Field(0.99, ge=0.0, le=1.0, description="clip tau_m from above")
    threshold_fallback: float = Field(0.95, ge=0.0, le=1.0,
                                      description="tau_m when den_m is 0 (class m absent from the validation split)")
    lambda_max: float = Field(1.0, ge=0.0, description="weight of the positive loss once the ramp is over")
    ramp_fraction: float = Field(0.3, ge=0.0, le=1.0,
                                 description="lambda ramps linearly from lambda_max/R to lambda_max over the first "
                                             "R = ceil(ramp_fraction * rounds) rounds; 0: no ramp")
    aggregation: Literal["uniform", "samples"] = Field(
        "uniform", description="plain mean of silo models (paper) or weighted by images trained on")
    ensemble_every_round: bool = Field(
        False, description="every live silo receives w_t each round and folds it into its self-ensemble, sampled or "
                           "not (paper); default: only the sampled silos receive it, costing 1/C fewer downloads")

    @model_validator(mode="after")
    def _ordered(self) -> FedSEALOptions:
        if self.threshold_min > self.threshold_max:
            raise ValueError("threshold_min must not exceed threshold_max")
        return self


# ---------------------------------------------------------------------------------------------- the math


def class_thresholds(probs: torch.Tensor, labels: torch.Tensor, num_classes: int, denominator: str = "true_class",
                     lo: float = 0.5, hi: float = 0.99, fallback: float = 0.95) -> torch.Tensor:
    """Server-gauged per-class thresholds on a labeled validation split.

    tau_m = sum_{i : argmax p(x_i) = m} p_m(x_i) / den_m, clipped to [lo, hi]; den_m is the number of validation
    images of class m (`true_class`) or predicted as m (`predicted_class`). Where den_m = 0 the ratio is undefined,
    and where class m is absent from the validation split it gauges nothing (under `predicted_class` it would be
    made of wrong predictions only): there tau_m = `fallback` (not clipped: it is the operator's own threshold).
    """
    confidence, predicted = probs.max(dim=1)
    numerator = torch.zeros(num_classes, dtype=torch.float64).index_add_(0, predicted, confidence.double())
    counted = labels if denominator == "true_class" else predicted
    den = torch.bincount(counted, minlength=num_classes)[:num_classes].double()
    present = torch.bincount(labels, minlength=num_classes)[:num_classes] > 0
    tau = (numerator / den.clamp_min(1)).clamp(lo, hi)
    return torch.where((den > 0) & present, tau, torch.full_like(tau, fallback)).float()


def positive_set(pbar: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y+ = argmax pbar and the mask pbar[y+] > tau[y+] (strictly above its class's threshold)."""
    confidence, labels = pbar.max(dim=1)
    return labels, confidence > thresholds[labels]


def complementary_labels(pbar: torch.Tensor, theta: float, positive: torch.Tensor,
                         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For each image outside the positive set, one class drawn uniformly from {m != argmax pbar : pbar[m] < theta};
    returns (labels, mask of images that got one). Images in the positive set or without a candidate get none."""
    candidates = pbar < theta
    # argmax can only fall below theta when theta * K > 1, but it must never be a complementary label.
    candidates[torch.arange(len(pbar)), pbar.argmax(dim=1)] = False
    chosen = candidates.any(dim=1) & ~positive
    labels = torch.full((len(pbar),), -1, dtype=torch.int64)
    if bool(chosen.any()):
        labels[chosen] = torch.multinomial(candidates[chosen].float(), 1, generator=generator).squeeze(1)
    return labels, chosen


def negative_loss(logits: torch.Tensor, ybar: torch.Tensor) -> torch.Tensor:
    """Negative learning: mean of -log(1 - p_ybar(x)), pushing the complementary class's probability to zero."""
    p = logits.softmax(dim=1).gather(1, ybar[:, None]).squeeze(1)
    # 1 - p underflows to 0 when the model is sure of the wrong class; the clamp keeps the loss finite.
    return -torch.log((1.0 - p).clamp_min(1e-7)).mean()


def ramp_weight(round_number: int, total_rounds: int, fraction: float, lambda_max: float = 1.0) -> float:
    """lambda_t: linear from lambda_max / R in round 1 to lambda_max in round R = ceil(fraction * T), then flat."""
    ramp_rounds = math.ceil(fraction * total_rounds)
    if ramp_rounds <= 1:
        return lambda_max
    return lambda_max * min(1.0, round_number / ramp_rounds)


# ---------------------------------------------------------------------------------------------- the self-ensemble

ENSEMBLE_PREFIX = "fedseal-ensemble-"


@dataclass
class SelfEnsemble:
    """pbar: the running mean of the confidence vectors of every global model received (N x K)."""

    mean: torch.Tensor
    count: int = 0  # global models folded in
    last_round: int = 0  # the round whose model was folded in last

    def add(self, probs: torch.Tensor, round_number: int) -> bool:
        """pbar_t = (n * pbar_{t-1} + p_t) / (n + 1). A round already folded in (a retried round, or the same
        round re-sent after a restart) is not counted twice: returns False then."""
        if round_number <= self.last_round:
            return False
        self.mean = (self.count * self.mean.double() + probs.double()).div(self.count + 1).float()
        self.count += 1
        self.last_round = round_number
        return True


def image_fingerprint(images: Images) -> str:
    """Ties a stored ensemble to exactly these images in this order: a changed folder starts afresh. Images in
    memory are hashed pixel by pixel; files read lazily by path, size and modification time (ImageFiles)."""
    if isinstance(images, ImageFiles):
        return images.fingerprint()
    return hashlib.sha256(images.contiguous().numpy().tobytes()).hexdigest()


def ensemble_path(state_dir: Path, run_id: str) -> Path:
    return Path(state_dir) / f"{ENSEMBLE_PREFIX}{run_id or 'norun'}.safetensors"


def load_ensemble(state_dir: Path, run_id: str, fingerprint: str, shape: tuple[int, int]) -> SelfEnsemble:
    """The stored ensemble of this run for these images, or a fresh one (first round, new run, images changed,
    unreadable file: the ensemble is an accelerator, never a reason to stop a silo)."""
    path = ensemble_path(state_dir, run_id)
    fresh = SelfEnsemble(torch.zeros(shape))
    if not path.is_file():
        return fresh
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            mean = f.get_tensor("mean")
        if meta.get("run_id") != run_id or meta.get("fingerprint") != fingerprint:
            log.info("stored self-ensemble %s belongs to other images; starting a new one", path)
            return fresh
        if tuple(mean.shape) != tuple(shape) or not bool(torch.isfinite(mean).all()):
            raise ValueError(f"shape {tuple(mean.shape)} or values do not fit {shape}")
        return SelfEnsemble(mean.float(), int(meta["count"]), int(meta["last_round"]))
    except Exception as err:  # a damaged file costs the ensemble's history, nothing else
        log.warning("cannot use the stored self-ensemble %s (%s); starting a new one", path, err)
        return fresh


def save_ensemble(state_dir: Path, run_id: str, fingerprint: str, ensemble: SelfEnsemble) -> Path:
    """Atomic write (temporary file, fsync, rename): a crash leaves the previous ensemble intact. Ensembles of
    other runs are removed: they describe models of a finished run and are of no further use."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = ensemble_path(state_dir, run_id)
    payload = st_save({"mean": ensemble.mean.contiguous()}, metadata={
        "format": "fedseal self-ensemble v1", "run_id": run_id, "fingerprint": fingerprint,
        "count": str(ensemble.count), "last_round": str(ensemble.last_round),
    })
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for other in state_dir.glob(f"{ENSEMBLE_PREFIX}*.safetensors"):
        if other != path:
            other.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------- hub half


class FedSEALHub(HubAlgorithm):
    name = "fedseal"
    needs_validation = True
    options: FedSEALOptions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.data.validation_images is None or self.data.validation_labels is None:
            raise ValueError("FedSEAL computes its per-class thresholds on a held-out labeled validation split: "
                             "set data.validation in hub.yaml (disjoint from data.labeled)")

    def _server_update(self, model: nn.Module, round_number: int, epochs: int) -> float:
        """Fine-tune on the hub's labels, batches drawn from round_number's own stream, at its learning rate, the
        last round's past the end: the fine-tune after round T (round_number T + 1) shares round T's rate, not its
        batches."""
        o, spec = self.options, self.model_spec
        return hub_update(
            model, self.data.labeled_images, self.data.labeled_labels, epochs=epochs,
            batch_size=o.hub_batch_size, lr=o.lr_at(min(round_number, self.total_rounds), self.total_rounds), opt=o.optimizer(),
            mean=spec.mean, std=spec.std, device=self.device,
            generator=seeded_generator(self.seed, round_number, 1), flip=o.flip,
        )

    def _thresholds(self, model: nn.Module) -> torch.Tensor:
        o, spec = self.options, self.model_spec
        probs = predict_logits(model, self.data.validation_images, spec.mean, spec.std, self.device).softmax(dim=1)
        labels = self.data.validation_labels
        ok = readable(self.data.validation_images)
        if not bool(ok.all()):  # validation images whose files turned out unreadable are left out
            probs, labels = probs[ok], labels[ok]
        tau = class_thresholds(probs, labels, spec.num_classes, o.threshold_denominator, o.threshold_min,
                               o.threshold_max, o.threshold_fallback)
        return tau

    def init_state(self) -> HubState:
        o = self.options
        torch.manual_seed(self.seed)
        model = self.initial_model()
        loss = self._server_update(model, 1, o.hub_epochs if o.init_epochs is None else o.init_epochs)
        tau = self._thresholds(model)
        return HubState(round=0, tensors={**model_tensors(model), "thresholds": tau}, meta={"hub_loss": loss})

    def begin_round(self, state: HubState) -> RoundPlan:
        r, o = state.round + 1, self.options
        model = load_model(self.model_spec, state.tensors)
        expected = delta_specs(model)
        expected["weight"] = TensorSpec((1,), "float32")
        return RoundPlan(
            round=r,
            tensors={k: v for k, v in state.tensors.items() if k.startswith("model/")},
            hyperparameters={"lr": o.lr_at(r, self.total_rounds), "seed": self.seed,
                             "lambda": ramp_weight(r, self.total_rounds, o.ramp_fraction, o.lambda_max)},
            expected=expected,
            class_thresholds=[float(v) for v in state.tensors["thresholds"]],
            unit_weight=o.aggregation == "uniform",
        )

    def finish_round(
        self, state: HubState, summed: Mapping[str, torch.Tensor], summed_metrics: Mapping[str, float]
    ) -> tuple[HubState, dict[str, float]]:
        r, o = state.round + 1, self.options
        model = load_model(self.model_spec, state.tensors)
        total_weight = float(summed["weight"].sum()) if "weight" in summed else 0.0
        apply_mean_delta(model, summed, total_weight)  # no silo contributed: the hub fine-tunes w_t itself
        hub_loss = self._server_update(model, r + 1, o.hub_epochs)
        tau = self._thresholds(model)
        # The validation accuracy is the round record's own score: the hub (and the benchmark) score every round's
        # served model on the same split.
        metrics = {"hub_loss": hub_loss, "aggregated_weight": total_weight,
                   "lambda": ramp_weight(r, self.total_rounds, o.ramp_fraction, o.lambda_max)}
        metrics.update({threshold_metric(m): float(v) for m, v in enumerate(tau)})
        metrics.update(pseudo_label_metrics(summed_metrics))
        total, negatives = summed_metrics.get("pl_total", 0.0), summed_metrics.get("nl_selected", 0.0)
        if total > 0:
            metrics["negative_label_ratio"] = negatives / total
        if negatives > 0 and "nl_correct" in summed_metrics:
            metrics["negative_label_accuracy"] = summed_metrics["nl_correct"] / negatives
        tensors = {**state.tensors, **model_tensors(model), "thresholds": tau}
        return HubState(round=r, tensors=tensors, meta=dict(state.meta)), metrics

    def served_model(self, state: HubState) -> nn.Module:
        return load_model(self.model_spec, state.tensors).eval()

    def broadcasts_model(self) -> bool:
        return self.options.ensemble_every_round


# ---------------------------------------------------------------------------------------------- silo half


class FedSEALSilo(SiloAlgorithm):
    name = "fedseal"
    clear_metrics = ("pl_total", "pl_selected", "pl_correct", "nl_selected", "nl_correct", "train_loss", "train_steps")
    options: FedSEALOptions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._memory: dict[tuple[str, str], SelfEnsemble] = {}  # ensembles of silos without a state_dir

    def _ensemble(self, data: SiloData, probs: torch.Tensor, round_number: int) -> SelfEnsemble:
        """Fold this round's confidences into the silo's ensemble and persist it before training on it."""
        if data.state_dir is None:  # in-process runs and tests: kept in memory, per silo and run
            key = (data.silo_id, data.run_id)
            ensemble = self._memory.setdefault(key, SelfEnsemble(torch.zeros_like(probs)))
            ensemble.add(probs, round_number)
            return ensemble
        fingerprint = image_fingerprint(data.images)
        ensemble = load_ensemble(data.state_dir, data.run_id, fingerprint, tuple(probs.shape))
        if ensemble.add(probs, round_number):
            save_ensemble(data.state_dir, data.run_id, fingerprint, ensemble)
        return ensemble

    def _confidences(self, model: nn.Module, data: SiloData) -> torch.Tensor:
        """p(x; w_t) on the un-augmented images."""
        spec = self.model_spec
        return predict_logits(model, data.images, spec.mean, spec.std, self.device).softmax(dim=1)

    def receive_model(self, plan: RoundPlan, data: SiloData) -> None:
        """A round this silo was not sampled in (ensemble_every_round): w_t joins the self-ensemble exactly as in
        a sampled round, and nothing is trained or sent."""
        model = on_device(load_model(self.model_spec, plan.tensors), self.device)
        self._ensemble(data, self._confidences(model, data), plan.round)

    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult:
        o, spec, device = self.options, self.model_spec, self.device
        if len(plan.class_thresholds) != spec.num_classes:
            raise ValueError(f"FedSEAL needs {spec.num_classes} class thresholds with the model, got "
                             f"{len(plan.class_thresholds)}")
        gen = seeded_generator(int(plan.hyperparameters.get("seed", 0)), plan.round, zlib.crc32(data.silo_id.encode()))
        model = on_device(load_model(spec, plan.tensors), device)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}

        # (1) p(x; w_t) on the un-augmented images, folded into the self-ensemble pbar_t.
        pbar = self._ensemble(data, self._confidences(model, data), plan.round).mean

        # (2) Positive set against the hub's per-class thresholds; negative set with complementary labels. An image
        # whose file turned out unreadable (a uniform prediction) is in neither.
        ok = readable(data.images)
        y_pos, positive = positive_set(pbar, torch.tensor(plan.class_thresholds))
        y_neg, negative = complementary_labels(pbar, o.theta, positive, gen)
        positive, negative = positive & ok, negative & ok
        metrics = {"pl_total": float(ok.sum()), "pl_selected": float(positive.sum()),
                   "nl_selected": float(negative.sum())}
        if data.true_labels is not None:
            metrics["pl_correct"] = float((y_pos[positive] == data.true_labels[positive]).sum())
            metrics["nl_correct"] = float((y_neg[negative] != data.true_labels[negative]).sum())
        used = torch.nonzero(positive | negative).squeeze(1)
        if len(used) < 2:  # batch norm needs two images; nothing to learn from this round
            return SiloResult(tensors={}, metrics=metrics, skipped=True)

        # (3) E_c epochs of lambda_t * L+ (strong view) + L- (weak view) over batches of D+ and D- together.
        lam = float(plan.hyperparameters.get("lambda", 1.0))
        model.train()
        optimizer = make_sgd(model, float(plan.hyperparameters["lr"]), o.optimizer())
        total_loss, steps = 0.0, 0
        work = LocalWork(o.local_epochs, o.local_steps)
        for _ in work.passes():
            order = [used[batch] for batch in shuffled_batches(len(used), o.silo_batch_size, gen)]
            for b, x in image_batches(data.images, order, pinned(device)):
                if len(b) < 2:  # unreadable files left fewer images than batch norm needs
                    continue
                x = augmentation_batch(x, device)
                in_pos, in_neg = positive[b], negative[b]
                bp, bn = b[in_pos], b[in_neg]
                strong = strong_augment(x[in_pos.to(x.device)], num_ops=o.randaugment_ops,
                                        magnitude=o.randaugment_magnitude, cutout=o.cutout, flip=o.flip,
                                        generator=gen)
                weak = weak_augment(x[in_neg.to(x.device)], flip=o.flip, generator=gen)
                with autocast(device):
                    logits = model(model_input(torch.cat([strong, weak]), device, spec.mean, spec.std))
                    loss = torch.zeros((), device=device)
                    if len(bp):
                        loss = loss + lam * F.cross_entropy(logits[: len(bp)], y_pos[bp].to(device))
                    if len(bn):
                        loss = loss + negative_loss(logits[len(bp):], y_neg[bn].to(device))
                sgd_step(model, optimizer, loss, o.grad_clip)
                total_loss, steps = total_loss + loss.item(), steps + 1
                if work.step():
                    break

        # (4) The weighted delta and its weight: the hub only needs sums.
        weight = 1.0 if o.aggregation == "uniform" else float(len(used))
        tensors = weighted_delta(model, start, weight)
        tensors["weight"] = torch.tensor([weight], dtype=torch.float32)
        metrics.update({"train_loss": total_loss / max(steps, 1), "train_steps": float(steps)})
        return SiloResult(tensors=tensors, metrics=metrics)
