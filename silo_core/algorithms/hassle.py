"""HASSLE with SUMA: dual models for annotation heterogeneity (Shang et al., "HASSLE", Alg. 1 in their appendix).

Any site may hold labeled data, unlabeled data, or both; the hub is a fully labeled participant. Four models travel:
the supervised model S, the unsupervised model U, and two compact residual models (1/4 of the channels): r_US
complements S with what U knows, r_SU complements U with what S knows. As this file runs Algorithm 1:

    hub:   S, U, r_US, r_SU <- initial models (optionally S = U warmed up on the hub's labels)   (init_state)
    for t = 1..T:
        hub sends S_t, U_t, r_US_t, r_SU_t (and S_{t-1}, see Eq. 11) to the sampled sites        (begin_round)
        site k with labeled data (x, y), n_L,k > 0:                                               (HASSLESilo)
            S_k    <- E epochs of CE(f(x; S_k), y) + gamma * ||S_k - U_t||^2                       (Eq. 3, 12)
            r_US,k <- E epochs of CE(f(x; S_t) + f(x; r), y)
                                  + lambda * KL(sm(f(x; r)/T_S) || sm((f(x; U_t) + f(x; r_SU_t) - f(x; S_t))/T_S))
            send n_L,k * (S_k - S_t), n_L,k * (r_US,k - r_US_t) and n_L,k
        site k with unlabeled data u, n_U,k > 0:
            y_hat = argmax(f(u; S_{t-1}) + f(u; r_US_t))   (optionally only where its softmax >= tau) (Eq. 11)
            U_k    <- E epochs of CE(f(u; U_k), y_hat) + gamma * ||U_k - S_t||^2
            r_SU,k <- the same with S and U exchanged, on (u, y_hat), temperature T_U
            send n_U,k * (U_k - U_t), n_U,k * (r_SU,k - r_SU_t) and n_U,k
        hub:   adds its own labeled-site update (hub_participates), then per model                (finish_round)
               W_{t+1} = W_t + sum_k n_k (W_k - W_t) / sum_k n_k    over the sites that trained W  (Eq. 1, 10)
               static BN statistics of all four from the hub's labeled images
    served: ( f(x; S_{t-1}) + f(x; r_US_t)  +  f(x; U_{t-1}) + f(x; r_SU_t) ) / 2                 (the ensemble)

Each model is one tensor GROUP of the plan: a site uploads only the groups it trained (RoundPlan.groups), and every
group carries its own weight (`S/delta/*` = n * delta, `S/weight` = n: the usual convention, per group), so the hub
weights each model by the right counts from sums alone. A site also reports `sent_<model>` = 1 in its metrics.
The KL target adds r_SU to U (the shared papers notes' reading of the authors' code; Eq. 7 writes U - S alone).
"""

from __future__ import annotations

import copy
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
    apply_mean_delta,
    delta_specs,
    groups_by_prefix,
    load_model,
    model_tensors,
    weighted_delta,
)
from silo_core.algorithms.semifl import pseudo_label_metrics
from silo_core.augment import weak_augment
from silo_core.data import Images, image_batches, readable
from silo_core.models import ModelSpec, head_names
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
    predict_logits,
    seeded_generator,
    sgd_step,
    shuffled_batches,
    train_supervised,
)

MODELS = ("S", "U", "rUS", "rSU")  # the four models on the wire, each one tensor group


class HASSLEOptions(SGDOptions):
    """Every HASSLE/SUMA knob; defaults from the paper (lr 0.1, momentum 0.9, batch 128), our choice where it names
    none (10 local epochs, docs/algorithms.md) and the shared papers notes (gamma, temperatures, residual width)."""

    lr: float = Field(0.1, gt=0.0, description="paper: 0.1")
    lr_schedule: Literal["cosine", "constant", "exponential"] = "constant"
    nesterov: bool = False
    local_epochs: int = Field(10, ge=1, le=1000, description="E: epochs per model per round at every site")
    local_steps: int | None = Field(None, ge=1, le=1_000_000, description="silo SGD steps per round instead of "
                                    "local_epochs (passes repeat as needed); default: count epochs")
    batch_size: int = Field(128, ge=2, le=65536)
    gamma: float = Field(0.001, ge=0.0, description="model proximity weight")
    proximity: Literal["squared", "l2"] = Field(
        "squared", description="squared: gamma*||w - w'||^2 (authors' code); l2: gamma*||w - w'|| (Eq. 12 as printed)")
    residual_lambda: float = Field(1.0, ge=0.0, description="lambda: weight of the residual KL term")
    temperature_supervised: float = Field(2.0, gt=0.0, description="T of r_US's KL term")
    temperature_unsupervised: float = Field(1.0, gt=0.0, description="T of r_SU's KL term")
    residual_width: float = Field(0.25, gt=0.0, le=1.0, description="channel fraction of the residual models")
    tau: float | None = Field(None, ge=0.0, le=1.0,
                              description="optional pseudo-label confidence threshold (paper: none, Table 6)")
    residual_pairing: Literal["previous", "current"] = Field(
        "previous", description="r_t pairs with S_{t-1}/U_{t-1} for pseudo-labels and inference (paper Eq. 11), "
                                "or with S_t/U_t (saves sending S_{t-1})")
    inference: Literal["ensemble", "supervised", "unsupervised"] = Field(
        "ensemble", description="the served model: mean of both logit sums, S + r_US, or U + r_SU")
    hub_participates: bool = Field(True, description="the hub trains S and r_US on its labels as a site")
    hub_epochs: int | None = Field(None, ge=1, le=1000, description="the hub's epochs as a site; default local_epochs")
    hub_batch_size: int | None = Field(None, ge=2, le=65536,
                                       description="the hub's batch size as a site; default batch_size")
    hub_warmup_epochs: int = Field(0, ge=0, le=1000, description="epochs of S on the hub's labels before round 1, "
                                   "copied to U (0: the paper's plain initialisation)")


# ---------------------------------------------------------------------------------------------- the math


def proximity_term(model: nn.Module, anchor: Mapping[str, torch.Tensor], gamma: float, kind: str = "squared"
                   ) -> torch.Tensor:
    """gamma * ||w - w'||^2 (squared) or gamma * ||w - w'|| (l2) over all parameters, w' the other global model."""
    sq = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
    if kind == "squared":
        return gamma * sq
    return gamma * torch.sqrt(sq + 1e-12)  # the epsilon keeps the gradient finite when w == w'


def residual_losses(base_logits: torch.Tensor, residual_logits: torch.Tensor, target_logits: torch.Tensor,
                    labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_CE, L_res) of a residual model r complementing a global base model (Eq. 7, 8):
    L_CE  = CE(f(x; base) + f(x; r), y)
    L_res = KL(softmax(f(x; r)/T) || softmax(target/T)), batch mean, with target the logit difference to learn."""
    ce = F.cross_entropy(base_logits + residual_logits, labels)
    log_p = F.log_softmax(residual_logits / temperature, dim=1)
    log_q = F.log_softmax(target_logits / temperature, dim=1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=1).mean()
    return ce, kl


def hassle_pseudo_labels(logits_sum: torch.Tensor, tau: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """y_hat = argmax of the complemented supervised logits (Eq. 11); keep all unless a threshold tau is set."""
    confidence, labels = logits_sum.softmax(dim=1).max(dim=1)
    keep = torch.ones_like(labels, dtype=torch.bool) if tau is None else confidence >= tau
    return labels, keep


class DualEnsemble(nn.Module):
    """HASSLE inference: (S(x) + r_US(x) + U(x) + r_SU(x)) / 2, or one of the two complemented models."""

    def __init__(self, supervised: nn.Module, residual_us: nn.Module, unsupervised: nn.Module, residual_su: nn.Module,
                 mode: str = "ensemble"):
        super().__init__()
        self.supervised, self.residual_us = supervised, residual_us
        self.unsupervised, self.residual_su = unsupervised, residual_su
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "supervised":
            return self.supervised(x) + self.residual_us(x)
        if self.mode == "unsupervised":
            return self.unsupervised(x) + self.residual_su(x)
        return (self.supervised(x) + self.residual_us(x) + self.unsupervised(x) + self.residual_su(x)) / 2


def zero_output(model: nn.Module, num_classes: int) -> nn.Module:
    """Zero the classifier (models/weights.py head_names: a Linear or a squeezenet's final convolution, both heads
    of a distilled DeiT): a residual model starts by adding nothing to the model it complements. (A random residual
    would add logit noise as large as a trained model's margins: with a warmed-up S, round 1's pseudo-labels
    S + r_US lost 16 points of accuracy to it on the demo data.)"""
    head = head_names(model, num_classes)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name in head:
                tensor.zero_()
    return model


def _specs(spec: ModelSpec, o: HASSLEOptions) -> dict[str, ModelSpec]:
    residual = spec.scaled(o.residual_width)
    return {"S": spec, "U": spec, "rUS": residual, "rSU": residual, "prevS": spec, "prevU": spec}


# ---------------------------------------------------------------------------------------------- hub half


class HASSLEHub(HubAlgorithm):
    name = "hassle"
    options: HASSLEOptions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.specs = _specs(self.model_spec, self.options)
        o = self.options
        site = o.model_copy(update={"local_epochs": o.hub_epochs or o.local_epochs, "local_steps": None,
                                    "batch_size": o.hub_batch_size or o.batch_size})
        self._site = HASSLESilo(site, self.model_spec, self.device)  # the hub as a labeled site

    def _model(self, state: HubState, key: str) -> nn.Module:
        return load_model(self.specs[key], state.tensors, prefix=f"{key}/")

    def _static_bn(self, model: nn.Module) -> None:
        s = self.model_spec
        compute_static_bn(model.to(self.device), clean_batches(self.data.labeled_images, s.mean, s.std, self.device))

    def init_state(self) -> HubState:
        o = self.options
        torch.manual_seed(self.seed)
        supervised = self.initial_model()  # S and U start from the initial weights; the residuals from zero
        loss = train_supervised(
            supervised, self.data.labeled_images, self.data.labeled_labels, epochs=o.hub_warmup_epochs,
            batch_size=o.hub_batch_size or o.batch_size, lr=o.lr_at(1, self.total_rounds), opt=o.optimizer(),
            mean=self.model_spec.mean,
            std=self.model_spec.std, device=self.device, generator=seeded_generator(self.seed, 0, 1), flip=o.flip,
        )
        models = {"S": supervised, "U": copy.deepcopy(supervised),
                  **{r: zero_output(self.specs[r].build(), self.specs[r].num_classes) for r in ("rUS", "rSU")}}
        tensors: dict[str, torch.Tensor] = {}
        for key, model in models.items():
            self._static_bn(model)
            tensors.update(model_tensors(model, f"{key}/"))
        for key in ("S", "U"):  # before round 1 the "previous" global models are the initial ones
            tensors.update(model_tensors(models[key], f"prev{key}/"))
        return HubState(round=0, tensors=tensors, meta={"hub_loss": loss})

    def begin_round(self, state: HubState) -> RoundPlan:
        r, o = state.round + 1, self.options
        sent = MODELS + (("prevS",) if o.residual_pairing == "previous" else ())
        tensors = {k: v for k, v in state.tensors.items() if k.split("/", 1)[0] in sent}
        expected: dict[str, TensorSpec] = {}
        for key in MODELS:
            expected.update(delta_specs(self._model(state, key), prefix=f"{key}/delta/"))
            expected[f"{key}/weight"] = TensorSpec((1,), "float32")
        return RoundPlan(round=r, tensors=tensors, hyperparameters={"lr": o.lr_at(r, self.total_rounds),
                                                                    "seed": self.seed},
                         expected=expected, groups=groups_by_prefix(expected))

    def finish_round(
        self, state: HubState, summed: Mapping[str, torch.Tensor], summed_metrics: Mapping[str, float]
    ) -> tuple[HubState, dict[str, float]]:
        r, o = state.round + 1, self.options
        sums = {k: v.clone() for k, v in summed.items()}
        metrics: dict[str, float] = {}
        for key in MODELS:  # what the silos sent, before the hub adds its own update
            metrics[f"contributors_{key}"] = float(summed_metrics.get(f"sent_{key}", 0.0))
            metrics[f"samples_{key}"] = float(sums[f"{key}/weight"].sum()) if f"{key}/weight" in sums else 0.0
        if o.hub_participates:
            plan = self.begin_round(state)  # the very plan the silos trained on
            empty = self.data.labeled_images[:0]
            hub = self._site.local_update(plan, SiloData(images=empty, labeled_images=self.data.labeled_images,
                                                         labeled_labels=self.data.labeled_labels, silo_id="hub"))
            for name, value in hub.tensors.items():
                sums[name] = sums[name] + value if name in sums else value.clone()
            metrics["hub_loss"] = hub.metrics.get("loss_S", float("nan"))
        tensors = dict(state.tensors)
        for key in ("S", "U"):  # the models of round t become the "previous" ones of round t+1
            tensors.update({f"prev{key}/{k.split('/', 1)[1]}": v for k, v in state.tensors.items()
                            if k.startswith(f"{key}/")})
        for key in MODELS:
            model = self._model(state, key)
            weight = float(sums[f"{key}/weight"].sum()) if f"{key}/weight" in sums else 0.0
            apply_mean_delta(model, sums, weight, prefix=f"{key}/delta/")  # Eq. 1 / 10 from sums
            self._static_bn(model)
            tensors.update(model_tensors(model, f"{key}/"))
        metrics.update(pseudo_label_metrics(summed_metrics))
        return HubState(round=r, tensors=tensors, meta=dict(state.meta)), metrics

    def served_model(self, state: HubState) -> nn.Module:
        pair = "prev" if self.options.residual_pairing == "previous" else ""
        return DualEnsemble(self._model(state, f"{pair}S"), self._model(state, "rUS"),
                            self._model(state, f"{pair}U"), self._model(state, "rSU"), self.options.inference).eval()

    served_structure = ("HASSLE's dual ensemble (silo_core.algorithms.hassle.DualEnsemble): the named model as S and "
                        "U, each with a residual network of it scaled by algorithm_options.residual_width")

    @classmethod
    def served_network(cls, spec: ModelSpec, options: HASSLEOptions) -> nn.Module:
        specs = _specs(spec, options)
        return DualEnsemble(specs["S"].build(), specs["rUS"].build(), specs["U"].build(), specs["rSU"].build(),
                            options.inference)


# ---------------------------------------------------------------------------------------------- site half


class HASSLESilo(SiloAlgorithm):
    name = "hassle"
    clear_metrics = ("pl_total", "pl_selected", "pl_correct", "loss_*", "sent_*")
    trains_on_labeled = True
    trains_on_unlabeled = True
    options: HASSLEOptions

    def result_groups(self, expected: Mapping[str, TensorSpec]) -> dict[str, list[str]]:
        return groups_by_prefix(expected)

    def _dual_update(self, plan: RoundPlan, images: Images, labels: torch.Tensor, own: str, other: str,
                     temperature: float, gen: torch.Generator,
                     weight: float | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Train model `own` (S or U) with proximity to the global `other`, and its residual r_{other,own}, on
        (images, labels); return n * delta and n for both groups, n being `weight` when given (Eq. 2's n_U,k: all
        of the silo's unlabeled images, even where a threshold kept fewer to train on), else the readable images."""
        o, spec, device = self.options, self.model_spec, self.device
        specs = _specs(spec, o)
        res = f"r{other}{own}"  # r_US complements S, r_SU complements U
        other_res = f"r{own}{other}"
        glob = {k: on_device(load_model(specs[k], plan.tensors, prefix=f"{k}/"), device).eval()
                for k in (own, other, res, other_res)}
        anchor = {n: p.detach() for n, p in glob[other].named_parameters()}
        model = on_device(load_model(specs[own], plan.tensors, prefix=f"{own}/"), device).train()
        residual = on_device(load_model(specs[res], plan.tensors, prefix=f"{res}/"), device).train()
        starts = {m: {n: p.detach().clone() for n, p in net.named_parameters()}
                  for m, net in ((own, model), (res, residual))}
        lr = float(plan.hyperparameters["lr"])
        # One optimizer per model and per site (the released code shared one across sites: a bug we avoid).
        opt_model, opt_res = make_sgd(model, lr, o.optimizer()), make_sgd(residual, lr, o.optimizer())
        loss_model = loss_res = 0.0
        steps = 0
        work = LocalWork(o.local_epochs, o.local_steps)
        for _ in work.passes():
            for idx, x in image_batches(images, shuffled_batches(len(images), o.batch_size, gen), pinned(device)):
                if len(idx) < 2:  # unreadable files left fewer images than batch norm needs
                    continue
                x = model_input(weak_augment(augmentation_batch(x, device), flip=o.flip, generator=gen), device,
                                spec.mean, spec.std)
                y = labels[idx].to(device)
                # The global models are fixed teachers this round, run in float32 even on a GPU: the residual learns
                # partner + partner_res - base, a difference of near-equal logits that bfloat16 would round away.
                with torch.no_grad():
                    base, partner, partner_res = glob[own](x), glob[other](x), glob[other_res](x)
                with autocast(device):
                    loss = F.cross_entropy(model(x), y) + proximity_term(model, anchor, o.gamma, o.proximity)
                sgd_step(model, opt_model, loss, o.grad_clip)
                with autocast(device):
                    ce, kl = residual_losses(base, residual(x), partner + partner_res - base, y, temperature)
                    rloss = ce + o.residual_lambda * kl
                sgd_step(residual, opt_res, rloss, o.grad_clip)
                loss_model, loss_res, steps = loss_model + loss.item(), loss_res + rloss.item(), steps + 1
                if work.step():
                    break
        # n: less files found unreadable while training (the count the silo's next join declares)
        n = float(readable(images).sum()) if weight is None else float(weight)
        tensors: dict[str, torch.Tensor] = {}
        for key, net in ((own, model), (res, residual)):
            tensors.update(weighted_delta(net, starts[key], n, prefix=f"{key}/delta/"))
            tensors[f"{key}/weight"] = torch.tensor([n])
        return tensors, {f"loss_{own}": loss_model / max(steps, 1), f"loss_{res}": loss_res / max(steps, 1),
                         f"sent_{own}": 1.0, f"sent_{res}": 1.0}

    def local_update(self, plan: RoundPlan, data: SiloData) -> SiloResult:
        o, spec, device = self.options, self.model_spec, self.device
        gen = seeded_generator(int(plan.hyperparameters.get("seed", 0)), plan.round, zlib.crc32(data.silo_id.encode()))
        tensors: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        if data.num_labeled >= 2:
            if data.labeled_labels is None or len(data.labeled_labels) != data.num_labeled:
                raise ValueError("labeled images need one label each (SiloData.labeled_labels)")
            t, m = self._dual_update(plan, data.labeled_images, data.labeled_labels, "S", "U",
                                     o.temperature_supervised, gen)
            if float(t["S/weight"]) >= 2:  # else its files went unreadable while it trained: the group is left out
                tensors.update(t)
                metrics.update(m)
        if len(data.images) >= 2:
            # Eq. 11: pseudo-labels from the supervised model complemented by its residual.
            specs = _specs(spec, o)
            base_key = "prevS" if any(k.startswith("prevS/") for k in plan.tensors) else "S"
            base = load_model(specs["S"], plan.tensors, prefix=f"{base_key}/")
            residual = load_model(specs["rUS"], plan.tensors, prefix="rUS/")
            logits = (predict_logits(base, data.images, spec.mean, spec.std, device)
                      + predict_logits(residual, data.images, spec.mean, spec.std, device))
            ok = readable(data.images)  # an image whose file turned out unreadable (zero logits) gets no label
            pseudo, keep = hassle_pseudo_labels(logits, o.tau)
            keep &= ok
            metrics.update({"pl_total": float(ok.sum()), "pl_selected": float(keep.sum())})
            if data.true_labels is not None:
                metrics["pl_correct"] = float((pseudo[keep] == data.true_labels[keep]).sum())
            if int(keep.sum()) >= 2:
                t, m = self._dual_update(plan, data.images[keep], pseudo[keep], "U", "S",
                                         o.temperature_unsupervised, gen, weight=float(ok.sum()))
                tensors.update(t)
                metrics.update(m)
        return SiloResult(tensors=tensors, metrics=metrics, skipped=not tensors)

