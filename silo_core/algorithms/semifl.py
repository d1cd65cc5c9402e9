"""SemiFL: semi-supervised federated learning with alternate training (Diao, Ding, Tarokh, NeurIPS 2022).

Algorithm 1, as this file runs it:

    hub:   W <- ServerUpdate(x_s, y_s, W); update sBN statistics                    (init_state)
    for t = 1..T:
        hub sends W (with its sBN statistics) to the sampled silos                   (begin_round)
        silo m: y_u = argmax f(a(x_u); W), keep max-prob >= tau  (D_fix)             (SemiFLSilo.local_update)
                if D_fix is empty: send nothing
                D_mix = |D_fix| draws with replacement from all pseudo-labeled images
                E epochs of L_fix + lambda * L_mix on (D_fix, D_mix) batches
                (under privacy.sample_dp: E epochs of DP-SGD on L_fix alone, see silo_core/dp_sgd.py)
                send (W_m - W) * w_m and w_m   (w_m = 1: uniform averaging)
        hub:   mean delta = sum / sum of weights; global momentum step                (finish_round)
               W <- ServerUpdate(x_s, y_s, W); update sBN statistics
    (the ServerUpdate after round T is the paper's final fine-tune)
"""

from __future__ import annotations

import random
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
    SiloAlgorithm,
    SiloData,
    SiloResult,
    load_model,
    model_tensors,
    weighted_delta,
)
from silo_core.augment import strong_augment, to_float, weak_augment
from silo_core.config_base import StrictConfig
from silo_core.data import padded_image_batches, readable
from silo_core.dp_sgd import SampleDPConfig, dp_schedule, dp_sgd_train, ledger_for
from silo_core.rounds import PSEUDO_LABEL_ACCURACY, PSEUDO_LABEL_RATIO
from silo_core.tensors import TensorSpec
from silo_core.training import (
    LocalWork,
    OptimizerSettings,
    augmentation_batch,
    autocast,
    cosine_lr,
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


class SemiFLOptions(StrictConfig):
    """Every SemiFL knob; defaults are the paper's (see shared papers notes)."""

    tau: float = Field(0.95, ge=0.0, le=1.0, description="confidence threshold for pseudo-labels")
    threshold_rule: Literal["fixed", "flexmatch", "freematch"] = Field(
        "fixed",
        description="fixed: tau for every class (paper); flexmatch: tau scaled down for classes whose images "
        "rarely pass it; freematch: mean confidence scaled by each class's mean probability (ignores tau)",
    )
    hub_epochs: int = Field(5, ge=0, le=1000, description="E_s: hub fine-tune epochs per round")
    init_epochs: int | None = Field(None, ge=0, le=1000, description="hub epochs before round 1; default hub_epochs")
    local_epochs: int = Field(5, ge=1, le=1000, description="E: silo epochs per round")
    local_steps: int | None = Field(None, ge=1, le=1_000_000, description="silo SGD steps per round instead of "
                                    "local_epochs (passes repeat as needed); default: count epochs")
    hub_batch_size: int | None = Field(None, ge=2, le=65536, description="B_s; default 10 for <=1000 labels, else 250")
    silo_batch_size: int = Field(10, ge=2, le=65536, description="B_m")
    lr: float = Field(0.03, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(5e-4, ge=0.0)
    nesterov: bool = True
    grad_clip: float = Field(1.0, ge=0.0, description="gradient-norm clip; 0 disables")
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    mix_weight: float = Field(1.0, ge=0.0, description="lambda: weight of L_mix")
    mix_alpha: float = Field(0.75, gt=0.0, description="a: Mixup Beta(a, a)")
    global_momentum: float = Field(0.5, ge=0.0, lt=1.0, description="hub SGD momentum on the pseudo-gradient")
    global_lr: float = Field(1.0, gt=0.0)
    aggregation: Literal["uniform", "samples"] = Field(
        "uniform", description="uniform mean of silo models (paper) or weighted by pseudo-labeled count"
    )
    sbn: Literal["hub"] = Field("hub", description="static BN statistics from hub data (paper Table 3)")
    flip: bool = Field(True, description="horizontal flips in augmentation (off for digits/text)")
    randaugment_ops: int = Field(2, ge=0, le=16)
    randaugment_magnitude: int = Field(10, ge=0, le=30)
    cutout: float = Field(0.5, ge=0.0, le=1.0, description="Cutout side as a fraction of the image side")

    def optimizer(self) -> OptimizerSettings:
        return OptimizerSettings(self.lr, self.momentum, self.weight_decay, self.nesterov, self.grad_clip)

    def hub_batch(self, num_labeled: int) -> int:
        return self.hub_batch_size or (10 if num_labeled <= 1000 else 250)


def _param_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


class SemiFLHub(HubAlgorithm):
    name = "semifl"
    options: SemiFLOptions

    def _server_update(self, model: nn.Module, round_number: int, epochs: int) -> float:
        """Fine-tune on the hub's labels, batches drawn from round_number's own stream, at its learning rate, the
        last round's past the end: the fine-tune after round T (round_number T + 1) shares round T's rate, not its
        batches."""
        o, spec = self.options, self.model_spec
        return hub_update(
            model,
            self.data.labeled_images,
            self.data.labeled_labels,
            epochs=epochs,
            batch_size=o.hub_batch(len(self.data.labeled_labels)),
            lr=cosine_lr(o.lr, min(round_number, self.total_rounds), self.total_rounds, o.lr_schedule),
            opt=o.optimizer(),
            mean=spec.mean,
            std=spec.std,
            device=self.device,
            generator=seeded_generator(self.seed, round_number, 1),
            flip=o.flip,
        )

    def init_state(self) -> HubState:
        torch.manual_seed(self.seed)
        model = self.initial_model()
        o = self.options
        loss = self._server_update(model, 1, o.hub_epochs if o.init_epochs is None else o.init_epochs)
        # On the CPU like every tensor of the hub's state (the server update may have moved the model to CUDA).
        momentum = {f"momentum/{n}": torch.zeros_like(p, device="cpu") for n, p in model.named_parameters()}
        return HubState(round=0, tensors={**model_tensors(model), **momentum}, meta={"hub_loss": loss})

    def begin_round(self, state: HubState) -> RoundPlan:
        r = state.round + 1
        o = self.options
        model_part = {k: v for k, v in state.tensors.items() if k.startswith("model/")}
        names = _param_names(load_model(self.model_spec, state.tensors))
        expected = {f"delta/{n}": TensorSpec.of(state.tensors[f"model/{n}"]) for n in names}
        expected["weight"] = TensorSpec((1,), "float32")
        return RoundPlan(
            round=r,
            tensors=model_part,
            hyperparameters={"lr": cosine_lr(o.lr, r, self.total_rounds, o.lr_schedule), "seed": self.seed},
            expected=expected,
            unit_weight=o.aggregation == "uniform",
        )

    def finish_round(
        self, state: HubState, summed: Mapping[str, torch.Tensor], summed_metrics: Mapping[str, float]
    ) -> tuple[HubState, dict[str, float]]:
        r = state.round + 1
        o = self.options
        model = load_model(self.model_spec, state.tensors)
        tensors = dict(state.tensors)
        total_weight = float(summed["weight"].sum()) if "weight" in summed else 0.0
        if total_weight > 0:
            # Pseudo-gradient g = W - mean(W_m) = -mean(delta); a persistent SGD(momentum) step at the hub.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    g = -summed[f"delta/{name}"].to(param.dtype) / total_weight
                    buf = o.global_momentum * tensors[f"momentum/{name}"] + g
                    tensors[f"momentum/{name}"] = buf
                    param.sub_(o.global_lr * buf)
        hub_loss = self._server_update(model, r + 1, o.hub_epochs)
        tensors.update(model_tensors(model))
        metrics = {"hub_loss": hub_loss, "aggregated_weight": total_weight}
        metrics.update(pseudo_label_metrics(summed_metrics))
        return HubState(round=r, tensors=tensors, meta=dict(state.meta)), metrics

    def served_model(self, state: HubState) -> nn.Module:
        return load_model(self.model_spec, state.tensors).eval()

    def trusted_update(self, state: HubState) -> dict[str, torch.Tensor]:
        """The hub's own round of training on its labels, from the model the silos received: FLTrust's root."""
        model = load_model(self.model_spec, state.tensors)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        self._server_update(model, state.round + 1, self.options.hub_epochs)
        return weighted_delta(model, start, 1.0)


def pseudo_label_metrics(summed: Mapping[str, float]) -> dict[str, float]:
    """Ratio of unlabeled images that passed tau, and (simulation only) how many of those were right."""
    out = {}
    total, selected = summed.get("pl_total", 0.0), summed.get("pl_selected", 0.0)
    if total > 0:
        out[PSEUDO_LABEL_RATIO] = selected / total
    if selected > 0 and "pl_correct" in summed:
        out[PSEUDO_LABEL_ACCURACY] = summed["pl_correct"] / selected
    return out


def select_confident(probs: torch.Tensor, tau: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard pseudo-labels and the mask of those whose confidence reaches tau (eq. 3); tau may be one per class."""
    confidence, labels = probs.max(dim=1)
    threshold = tau[labels] if isinstance(tau, torch.Tensor) else tau
    return labels, confidence >= threshold


def class_thresholds(probs: torch.Tensor, tau: float, rule: str) -> torch.Tensor:
    """One threshold per class from the silo's own predictions over all its images (no extra communication).

    A single tau passes the images the model is already sure of, which early on are the easy classes; both
    adaptive rules lower the bar for the classes the model is still unsure of, so they too reach the silo's
    training. They are computed from one pass over every image, as SemiFL pseudo-labels once per round.
    - flexmatch (Zhang et al. 2021, curriculum pseudo-labeling without warm-up): beta_c = images predicted c that
      pass tau / the most that pass for any class; threshold_c = tau * beta_c / (2 - beta_c), so a class none of
      whose images pass gets 0 and every image predicted as it is kept.
    - freematch (Wang et al. 2023, self-adaptive thresholds): threshold_c = mean max-probability over the silo's
      images * mean probability of c / the largest class's mean probability.
    """
    num_classes = probs.shape[1]
    confidence, labels = probs.max(dim=1)
    if rule == "fixed":
        return torch.full((num_classes,), float(tau))
    if rule == "flexmatch":
        passed = torch.bincount(labels[confidence >= tau], minlength=num_classes).float()
        beta = passed / passed.max().clamp(min=1.0)
        return tau * beta / (2.0 - beta)
    if rule == "freematch":
        class_mean = probs.mean(dim=0)
        return confidence.mean() * class_mean / class_mean.max()
    raise ValueError(f"unknown threshold_rule {rule!r}; choose fixed, flexmatch or freematch")


def mix_loss(logits: torch.Tensor, y_fix: torch.Tensor, y_partner: torch.Tensor, lam: float) -> torch.Tensor:
    """L_mix = lam * CE(f(x_mix), y_fix) + (1 - lam) * CE(f(x_mix), y_partner) (eq. 5)."""
    return lam * F.cross_entropy(logits, y_fix) + (1.0 - lam) * F.cross_entropy(logits, y_partner)


class SemiFLSilo(SiloAlgorithm):
    name = "semifl"
    options: SemiFLOptions
    supports_sample_dp = True

    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult:
        o, spec, device = self.options, self.model_spec, self.device
        gen = seeded_generator(int(plan.hyperparameters.get("seed", 0)), plan.round, zlib.crc32(data.silo_id.encode()))
        model = on_device(load_model(spec, plan.tensors), device)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}

        # (1) Pseudo-label every image once, with the received model on the weak view. An image whose file turned
        # out unreadable in this pass (zero logits) takes no part: not in the thresholds, D_fix or D_mix.
        probs = predict_logits(model, data.images, spec.mean, spec.std, device, weak=True, flip=o.flip,
                               generator=gen).softmax(dim=1)
        ok = readable(data.images)
        pseudo, confident = select_confident(probs, class_thresholds(probs[ok], o.tau, o.threshold_rule))
        confident &= ok
        n_fix = int(confident.sum())
        metrics = {"pl_total": float(ok.sum()), "pl_selected": float(n_fix)}
        if data.true_labels is not None:
            metrics["pl_correct"] = float((pseudo[confident] == data.true_labels[confident]).sum())
        if n_fix < 2:  # nothing (or a single image) passed tau: skip the round and send nothing
            return SiloResult(tensors={}, metrics=metrics, skipped=True)

        # (2) D_fix and an equal-size D_mix drawn with replacement from all (readable) pseudo-labeled images. Both
        # are indices into data.images: pixels are read batch by batch below.
        if plan.hyperparameters.get("sample_dp"):
            return self._private_update(plan, data, model, start, data.images[confident], pseudo[confident],
                                        metrics)
        fix_idx, y_fix = torch.nonzero(confident).squeeze(1), pseudo[confident]
        candidates = torch.nonzero(ok).squeeze(1)
        partner_idx = candidates[torch.randint(len(candidates), (n_fix,), generator=gen)]
        y_partner = pseudo[partner_idx]

        # (3) E local epochs of L_fix + lambda * L_mix.
        model.train()
        optimizer = make_sgd(model, float(plan.hyperparameters["lr"]), o.optimizer())
        mix_rng = random.Random(int(torch.randint(2**31, (1,), generator=gen)))  # Beta draws, seeded too
        total_loss, steps = 0.0, 0
        work = LocalWork(o.local_epochs, o.local_steps)
        for _ in work.passes():
            fix_batches = shuffled_batches(n_fix, o.silo_batch_size, gen)
            mix_batches = shuffled_batches(n_fix, o.silo_batch_size, gen)
            pairs = [(fb[:m], mb[:m]) for fb, mb in zip(fix_batches, mix_batches, strict=False)
                     for m in [min(len(fb), len(mb))]]
            # Each step reads its D_fix images and then their D_mix partners, in one batch.
            wanted = [torch.cat([fix_idx[fb], partner_idx[mb]]) for fb, mb in pairs]
            for (fb, mb), (read, x) in zip(pairs, padded_image_batches(data.images, wanted, pinned(device)),
                                           strict=True):
                m = len(fb)
                x_fix, x_partner = x[:m], x[m:]
                keep = read[:m] & read[m:]
                if not bool(keep.all()):  # a file turned out unreadable: its pair is left out of this step
                    fb, mb, x_fix, x_partner = fb[keep], mb[keep], x_fix[keep], x_partner[keep]
                    m = len(fb)
                    if m < 2:
                        continue
                x_fix, x_partner = augmentation_batch(x_fix, device), augmentation_batch(x_partner, device)
                lam = mix_rng.betavariate(o.mix_alpha, o.mix_alpha)
                strong = strong_augment(x_fix, num_ops=o.randaugment_ops, magnitude=o.randaugment_magnitude,
                                        cutout=o.cutout, flip=o.flip, generator=gen)
                views = [strong, weak_augment(x_fix, flip=o.flip, generator=gen),
                         weak_augment(x_partner, flip=o.flip, generator=gen)]
                x_strong, weak_fix, weak_partner = model_input(torch.cat(views), device, spec.mean, spec.std).split(m)
                x_mix = lam * weak_fix + (1.0 - lam) * weak_partner
                with autocast(device):
                    # One forward pass over both views: cheaper, and BN sees a batch of 2m.
                    logits = model(torch.cat([x_strong, x_mix]))
                    loss_fix = F.cross_entropy(logits[:m], y_fix[fb].to(device))
                    loss_mix = mix_loss(logits[m:], y_fix[fb].to(device), y_partner[mb].to(device), lam)
                    loss = loss_fix + o.mix_weight * loss_mix
                sgd_step(model, optimizer, loss, o.grad_clip)
                total_loss, steps = total_loss + loss.item(), steps + 1
                if work.step():
                    break

        # (4) Send the weighted delta and its weight: the hub only ever needs sums.
        weight = 1.0 if o.aggregation == "uniform" else float(n_fix)
        tensors = weighted_delta(model, start, weight)
        tensors["weight"] = torch.tensor([weight], dtype=torch.float32)
        metrics["train_loss"] = total_loss / max(steps, 1)
        metrics["train_steps"] = float(steps)
        return SiloResult(tensors=tensors, metrics=metrics)

    def _private_update(self, plan: RoundPlan, data: SiloData, model: nn.Module, start: dict[str, torch.Tensor],
                        x_fix: torch.Tensor, y_fix: torch.Tensor, metrics: dict[str, float]) -> SiloResult:
        """Step (3) under sample-level DP: E epochs of DP-SGD on L_fix (one strong view per confident image; no
        Mixup, which would mix two people's images into one example). The silo's ledger is charged for every
        scheduled step; a round that would overrun the silo's budget is skipped before any training."""
        o, spec = self.options, self.model_spec
        dp = SampleDPConfig.model_validate(plan.hyperparameters["sample_dp"])
        ledger = ledger_for(self.sample_dp_ledgers, data.silo_id, data.run_id, data.state_dir, dp.delta)
        rate, scheduled = dp_schedule(len(y_fix), o.silo_batch_size, o.local_epochs)
        if not ledger.allows(dp.epsilon_budget, dp.noise_multiplier, rate, scheduled):
            metrics.update(sample_dp_epsilon=ledger.epsilon(), sample_dp_budget_spent=1.0)
            return SiloResult(tensors={}, metrics=metrics, skipped=True)

        def strong_view(images: torch.Tensor) -> torch.Tensor:
            return to_float(strong_augment(images, num_ops=o.randaugment_ops, magnitude=o.randaugment_magnitude,
                                           cutout=o.cutout, flip=o.flip), spec.mean, spec.std)

        # DP-SGD keeps float32 and the plain memory format: Opacus computes per-sample gradients its own way.
        model.to(memory_format=torch.contiguous_format)
        optimizer = make_sgd(model, float(plan.hyperparameters["lr"]), o.optimizer())
        loss, steps = dp_sgd_train(model, x_fix, y_fix, strong_view, epochs=o.local_epochs,
                                   batch_size=o.silo_batch_size, optimizer=optimizer,
                                   noise_multiplier=dp.noise_multiplier, clip_norm=dp.clip_norm, device=self.device)
        metrics.update(train_loss=loss, train_steps=float(steps),
                       sample_dp_epsilon=ledger.charge(dp.noise_multiplier, rate, scheduled))
        # Weight 1 whatever `aggregation` says: a weight of |D_fix| would publish a count of this silo's images.
        tensors = weighted_delta(model, start, 1.0)
        tensors["weight"] = torch.tensor([1.0], dtype=torch.float32)
        return SiloResult(tensors=tensors, metrics=metrics)
