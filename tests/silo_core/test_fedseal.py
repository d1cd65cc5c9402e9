"""FedSEAL's math pinned on hand-made cases: thresholds, self-ensemble (and its persistence), positive and
negative sets, the negative-learning loss, the lambda ramp; then one hub round and one silo update."""

import dataclasses
import math

import pytest
import torch

from silo_core.algorithms.base import HubData, SiloData, load_model
from silo_core.algorithms.fedseal import (
    FedSEALHub,
    FedSEALOptions,
    FedSEALSilo,
    SelfEnsemble,
    class_thresholds,
    complementary_labels,
    ensemble_path,
    image_fingerprint,
    load_ensemble,
    negative_loss,
    positive_set,
    ramp_weight,
    save_ensemble,
)
from silo_core.models import ModelSpec
from silo_core.training import predict_logits

SPEC = ModelSpec(options={"width": 4})

# A 10-image validation split over 4 classes; class 3 is absent. Rows: confidence vectors p(x_i).
VAL_PROBS = torch.tensor([
    [0.90, 0.05, 0.03, 0.02],  # y=0, predicted 0 (0.90)
    [0.70, 0.20, 0.05, 0.05],  # y=0, predicted 0 (0.70)
    [0.60, 0.30, 0.05, 0.05],  # y=1, predicted 0 (0.60)
    [0.10, 0.80, 0.05, 0.05],  # y=1, predicted 1 (0.80)
    [0.05, 0.85, 0.05, 0.05],  # y=1, predicted 1 (0.85)
    [0.20, 0.40, 0.35, 0.05],  # y=2, predicted 1 (0.40)
    [0.10, 0.10, 0.75, 0.05],  # y=2, predicted 2 (0.75)
    [0.05, 0.05, 0.88, 0.02],  # y=2, predicted 2 (0.88)
    [0.30, 0.10, 0.55, 0.05],  # y=2, predicted 2 (0.55)
    [0.10, 0.10, 0.78, 0.02],  # y=0, predicted 2 (0.78)
])
VAL_LABELS = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 0])


def test_thresholds_with_true_class_denominator_clipping_and_fallback():
    tau = class_thresholds(VAL_PROBS, VAL_LABELS, 4, "true_class", lo=0.5, hi=0.99, fallback=0.95)
    # class 0: (0.90 + 0.70 + 0.60) / 3 true class-0 images = 0.7333
    # class 1: (0.80 + 0.85 + 0.40) / 3 = 0.6833
    # class 2: (0.75 + 0.88 + 0.55 + 0.78) / 4 = 0.74
    # class 3: absent from the split -> fallback 0.95
    assert tau.tolist() == pytest.approx([2.2 / 3, 2.05 / 3, 2.96 / 4, 0.95], abs=1e-6)
    clipped = class_thresholds(VAL_PROBS, VAL_LABELS, 4, "true_class", lo=0.7, hi=0.72, fallback=0.6)
    assert clipped.tolist() == pytest.approx([0.72, 0.7, 0.72, 0.6], abs=1e-6)  # fallback is used as given


def test_thresholds_with_predicted_class_denominator():
    tau = class_thresholds(VAL_PROBS, VAL_LABELS, 4, "predicted_class", lo=0.5, hi=0.99, fallback=0.9)
    # the mean confidence of the images predicted as m: class 0 (3 images), class 1 (3), class 2 (4); class 3 never
    assert tau.tolist() == pytest.approx([2.2 / 3, 2.05 / 3, 2.96 / 4, 0.9], abs=1e-6)
    # A model that predicts everything as class 0: the true-class ratio exceeds 1 and is clipped to hi.
    sure = torch.tensor([[0.9, 0.05, 0.05]] * 4)
    labels = torch.tensor([0, 1, 1, 2])
    assert class_thresholds(sure, labels, 3, "true_class", 0.5, 0.99, 0.95).tolist() == pytest.approx(
        [0.99, 0.5, 0.5])  # class 0: 3.6 / 1 -> 0.99; classes 1, 2 present but never predicted: 0 -> 0.5
    assert class_thresholds(sure, labels, 3, "predicted_class", 0.5, 0.99, 0.95).tolist() == pytest.approx(
        [0.9, 0.95, 0.95])
    # A class absent from the validation split gauges nothing, even when the model predicts it (wrongly): its
    # threshold is the fallback under either denominator, not the mean confidence of those wrong predictions.
    wrong = torch.tensor([[0.2, 0.2, 0.6]] * 3 + [[0.9, 0.05, 0.05]])
    absent = torch.tensor([0, 1, 1, 0])  # no image of class 2
    for denominator in ("predicted_class", "true_class"):
        assert class_thresholds(wrong, absent, 3, denominator, 0.5, 0.99, 0.95)[2] == pytest.approx(0.95)


def test_incremental_ensemble_equals_the_batch_mean_and_survives_a_reload(tmp_path):
    g = torch.Generator().manual_seed(0)
    rounds = [torch.randn(6, 4, generator=g).softmax(dim=1) for _ in range(5)]
    fingerprint = "f" * 64
    for t, probs in enumerate(rounds, start=1):
        # Each round: a "fresh process" loads from disk, folds in p(x; w_t), saves.
        ens = load_ensemble(tmp_path, "run-a", fingerprint, (6, 4))
        assert ens.count == t - 1
        assert ens.add(probs, t)
        save_ensemble(tmp_path, "run-a", fingerprint, ens)
    again = load_ensemble(tmp_path, "run-a", fingerprint, (6, 4))
    assert again.count == 5 and again.last_round == 5
    assert torch.allclose(again.mean, torch.stack(rounds).mean(dim=0), atol=1e-6)
    # The same round offered again (retried round, restart) is not counted twice.
    assert not again.add(rounds[0], 5) and again.count == 5
    # A new run starts fresh, and writing it removes the old run's file.
    other = load_ensemble(tmp_path, "run-b", fingerprint, (6, 4))
    assert other.count == 0 and float(other.mean.abs().sum()) == 0.0
    other.add(rounds[0], 1)
    save_ensemble(tmp_path, "run-b", fingerprint, other)
    assert not ensemble_path(tmp_path, "run-a").exists() and ensemble_path(tmp_path, "run-b").exists()
    assert load_ensemble(tmp_path, "run-b", "0" * 64, (6, 4)).count == 0  # other images: fresh
    ensemble_path(tmp_path, "run-b").write_bytes(b"garbage")
    assert load_ensemble(tmp_path, "run-b", fingerprint, (6, 4)).count == 0  # damaged file: fresh, no crash


def test_positive_set_is_strictly_above_the_class_threshold():
    pbar = torch.tensor([[0.8, 0.1, 0.1], [0.6, 0.3, 0.1], [0.1, 0.7, 0.2], [0.2, 0.2, 0.6]])
    labels, keep = positive_set(pbar, torch.tensor([0.6, 0.65, 0.9]))
    assert labels.tolist() == [0, 0, 1, 2]
    assert keep.tolist() == [True, False, True, False]  # 0.6 is not above 0.6; 0.6 < 0.9


def test_complementary_labels_come_only_from_classes_below_theta_and_never_the_positive_label():
    g = torch.Generator().manual_seed(1)
    pbar = torch.rand(400, 6, generator=g) ** 4
    pbar = pbar / pbar.sum(dim=1, keepdim=True)
    positive = torch.rand(400, generator=g) < 0.3
    labels, chosen = complementary_labels(pbar, 0.05, positive, torch.Generator().manual_seed(2))
    argmax = pbar.argmax(dim=1)
    has_candidate = ((pbar < 0.05) & (torch.arange(6) != argmax[:, None])).any(dim=1)
    assert torch.equal(chosen, has_candidate & ~positive)
    assert int(chosen.sum()) > 100 and bool((labels[~chosen] == -1).all())
    picked = pbar[chosen].gather(1, labels[chosen][:, None]).squeeze(1)
    assert bool((picked < 0.05).all())
    assert bool((labels[chosen] != argmax[chosen]).all())
    # Draws are spread over the candidates: with 6 classes, more than one distinct label per candidate set.
    assert len(set(labels[chosen].tolist())) >= 4
    # theta * K > 1: every class (argmax included) is below theta, yet the argmax is never chosen.
    flat = torch.full((50, 4), 0.25)
    flat[:, 2] = 0.26
    flat = flat / flat.sum(dim=1, keepdim=True)
    lab, ch = complementary_labels(flat, 0.5, torch.zeros(50, dtype=torch.bool), torch.Generator().manual_seed(3))
    assert bool(ch.all()) and bool((lab != 2).all())


def test_negative_loss_is_minus_log_one_minus_the_complementary_probability():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    ybar = torch.tensor([1, 0])
    p = logits.softmax(dim=1)
    expected = -(math.log(1 - float(p[0, 1])) + math.log(1 - float(p[1, 0]))) / 2
    assert float(negative_loss(logits, ybar)) == pytest.approx(expected, rel=1e-6)
    assert math.isfinite(float(negative_loss(torch.tensor([[100.0, -100.0]]), torch.tensor([0]))))


def test_lambda_ramps_linearly_over_the_first_30_percent_of_rounds():
    lams = [ramp_weight(t, 20, 0.3) for t in range(1, 21)]
    assert lams[:6] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0]) and set(lams[6:]) == {1.0}
    assert ramp_weight(1, 20, 0.0, 0.5) == 0.5


def tiny_hub(options=None, rounds=3, validation=True):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8, generator=g)
    val = torch.randint(0, 256, (10, 1, 28, 28), dtype=torch.uint8, generator=g)
    data = HubData(images, torch.arange(20) % 10, val if validation else None,
                   (torch.arange(10) % 10) if validation else None)
    opts = FedSEALOptions(**{"hub_epochs": 1, **(options or {})})
    return FedSEALHub(opts, SPEC, data, torch.device("cpu"), seed=0, total_rounds=rounds)


def test_hub_needs_a_validation_split():
    with pytest.raises(ValueError, match="data.validation"):
        tiny_hub(validation=False)


def test_a_round_sends_thresholds_and_reports_them_per_class(tmp_path):
    hub = tiny_hub({"threshold_min": 0.0, "threshold_max": 1.0})
    state = hub.init_state()
    plan = hub.begin_round(state)
    assert len(plan.class_thresholds) == 10 and plan.hyperparameters["lambda"] == 1.0  # ceil(0.3*3)=1 round ramp
    assert set(plan.expected) == {f"delta/{k[6:]}" for k in plan.tensors if "running" not in k
                                  and "num_batches" not in k} | {"weight"}
    # Thresholds low enough that the silo's images enter the positive set.
    plan.class_thresholds = [0.0] * 10
    silo = FedSEALSilo(FedSEALOptions(local_epochs=1, silo_batch_size=4), SPEC, torch.device("cpu"))
    images = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    data = SiloData(images=images, true_labels=torch.arange(8), state_dir=tmp_path, silo_id="s1", run_id="r1")
    result = silo.local_update(plan, data)
    assert not result.skipped and set(result.tensors) == set(plan.expected)
    assert result.metrics["pl_selected"] == 8 and result.metrics["nl_selected"] == 0
    assert result.metrics["train_steps"] == 2
    stored = load_ensemble(tmp_path, "r1", image_fingerprint(images), (8, 10))
    assert stored.count == 1 and stored.last_round == 1
    summed = {k: v.clone() for k, v in result.tensors.items()}
    state1, metrics = hub.finish_round(state, summed, result.metrics)
    assert metrics["aggregated_weight"] == 1.0 and metrics["pseudo_label_ratio"] == 1.0
    assert metrics["negative_label_ratio"] == 0.0
    assert [metrics[f"threshold_class_{m}"] for m in range(10)] == pytest.approx(state1.tensors["thresholds"].tolist())
    assert hub.begin_round(state1).class_thresholds == pytest.approx(state1.tensors["thresholds"].tolist())


def test_silo_skips_when_no_image_is_positive_or_negative():
    hub = tiny_hub()
    plan = hub.begin_round(hub.init_state())
    plan.class_thresholds = [1.0] * 10  # nothing is above 1
    silo = FedSEALSilo(FedSEALOptions(theta=1e-9), SPEC, torch.device("cpu"))
    images = torch.randint(0, 256, (6, 1, 28, 28), dtype=torch.uint8)
    result = silo.local_update(plan, SiloData(images=images, silo_id="s"))
    assert result.skipped and result.metrics == {"pl_total": 6.0, "pl_selected": 0.0, "nl_selected": 0.0}


def test_in_memory_ensemble_is_kept_per_silo():
    silo = FedSEALSilo(FedSEALOptions(), SPEC, torch.device("cpu"))
    a = SiloData(images=torch.zeros(3, 1, 28, 28, dtype=torch.uint8), silo_id="a")
    b = SiloData(images=torch.zeros(3, 1, 28, 28, dtype=torch.uint8), silo_id="b")
    p1, p2 = torch.full((3, 2), 0.5), torch.tensor([[1.0, 0.0]] * 3)
    silo._ensemble(a, p1, 1)
    assert torch.allclose(silo._ensemble(a, p2, 2).mean, torch.tensor([[0.75, 0.25]] * 3))
    assert torch.allclose(silo._ensemble(b, p2, 2).mean, p2)
    assert isinstance(silo._memory[("a", "")], SelfEnsemble)


def test_a_silo_left_out_of_a_round_folds_the_received_model_into_its_ensemble(tmp_path):
    """ensemble_every_round (the paper): a silo not sampled receives w_t and averages p(x; w_t) into pbar, on disk,
    exactly as a sampled round would; nothing is trained."""
    hub = tiny_hub({"ensemble_every_round": True})
    assert hub.broadcasts_model() and not tiny_hub().broadcasts_model()
    plan1 = hub.begin_round(hub.init_state())
    # Round 2's model: another w (every weight halved), so the two rounds' confidences differ.
    plan2 = dataclasses.replace(plan1, round=2, tensors={k: (v * 0.5 if v.is_floating_point() else v)
                                                         for k, v in plan1.tensors.items()})
    images = torch.randint(0, 256, (6, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    data = SiloData(images=images, state_dir=tmp_path, silo_id="s1", run_id="r1")
    silo = FedSEALSilo(FedSEALOptions(), SPEC, torch.device("cpu"))

    def probs(plan):
        return predict_logits(load_model(SPEC, plan.tensors), images, SPEC.mean, SPEC.std,
                              torch.device("cpu")).softmax(dim=1)

    p1, p2 = probs(plan1), probs(plan2)
    assert not torch.allclose(p1, p2, atol=1e-4)
    before = {k: v.clone() for k, v in plan1.tensors.items()}
    assert silo.receive_model(plan1, data) is None
    assert all(torch.equal(before[k], plan1.tensors[k]) for k in before)  # the received model is not trained
    silo.receive_model(plan2, data)
    silo.receive_model(plan2, data)  # the same round again (a retry): not counted twice
    stored = load_ensemble(tmp_path, "r1", image_fingerprint(images), (6, 10))
    assert stored.count == 2 and stored.last_round == 2
    assert torch.allclose(stored.mean, (p1 + p2) / 2, atol=1e-6)
    # Sampled in round 3: its ensemble has all three models, though it trained in none before.
    plan3 = dataclasses.replace(plan1, round=3, class_thresholds=[1.0] * 10)
    silo.local_update(plan3, data)
    stored = load_ensemble(tmp_path, "r1", image_fingerprint(images), (6, 10))
    assert stored.count == 3 and torch.allclose(stored.mean, (2 * p1 + p2) / 3, atol=1e-6)
