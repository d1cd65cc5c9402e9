import math

import pytest
import torch
from torch.nn import functional as F

from silo_core.algorithms.base import HubData, SiloData, load_model
from silo_core.algorithms.semifl import (
    SemiFLHub,
    SemiFLOptions,
    SemiFLSilo,
    class_thresholds,
    mix_loss,
    pseudo_label_metrics,
    select_confident,
)
from silo_core.models import ModelSpec
from silo_core.training import cosine_lr

SPEC = ModelSpec(options={"width": 4})


def tiny_hub(options=None, rounds=4):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.arange(20) % 10
    opts = SemiFLOptions(**{"hub_epochs": 1, **(options or {})})
    return SemiFLHub(opts, SPEC, HubData(images, labels), torch.device("cpu"), seed=0, total_rounds=rounds)


def test_threshold_filter_keeps_exactly_those_at_or_above_tau():
    probs = torch.tensor([[0.96, 0.04], [0.5, 0.5], [0.05, 0.95], [0.2, 0.8]])
    labels, keep = select_confident(probs, 0.95)
    assert labels.tolist() == [0, 0, 1, 1]
    assert keep.tolist() == [True, False, True, False]


def test_per_class_thresholds_filter_each_image_by_its_own_class():
    probs = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.35, 0.65]])
    labels, keep = select_confident(probs, torch.tensor([0.8, 0.62]))
    assert labels.tolist() == [0, 1, 1]
    assert keep.tolist() == [False, False, True]


def test_flexmatch_lowers_the_threshold_of_classes_whose_images_rarely_pass_tau():
    # Predicted class 0 four times (3 pass 0.9), class 1 twice (1 passes), class 2 once (none passes).
    probs = torch.tensor([[0.95, 0.03, 0.02]] * 3 + [[0.5, 0.3, 0.2]]
                         + [[0.05, 0.92, 0.03], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4]])
    thresholds = class_thresholds(probs, 0.9, "flexmatch")
    beta = torch.tensor([1.0, 1 / 3, 0.0])  # passed per class / the most passed (3)
    assert torch.allclose(thresholds, 0.9 * beta / (2 - beta))
    assert class_thresholds(probs, 0.9, "fixed").tolist() == pytest.approx([0.9] * 3)


def test_freematch_scales_the_mean_confidence_by_each_class_mean_probability():
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.2, 0.8]])
    thresholds = class_thresholds(probs, 0.95, "freematch")  # tau plays no part
    mean_confidence = (0.9 + 0.7 + 0.8) / 3
    class_mean = torch.tensor([1.8, 1.2]) / 3
    assert torch.allclose(thresholds, mean_confidence * class_mean / class_mean.max())
    assert thresholds[0] == pytest.approx(0.8) and thresholds[1] == pytest.approx(0.8 * 1.2 / 1.8)
    with pytest.raises(ValueError, match="threshold_rule"):
        SemiFLOptions(threshold_rule="median")


def test_mix_loss_is_the_lambda_weighted_sum_of_two_cross_entropies():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]])
    y_fix, y_partner, lam = torch.tensor([0, 1]), torch.tensor([2, 2]), 0.3
    expected = 0.0
    for i in range(2):
        logp = F.log_softmax(logits[i], dim=0)
        expected += -(lam * logp[y_fix[i]] + (1 - lam) * logp[y_partner[i]]) / 2
    assert math.isclose(float(mix_loss(logits, y_fix, y_partner, lam)), float(expected), rel_tol=1e-6)


def test_global_momentum_step_matches_sgd_with_momentum():
    hub = tiny_hub({"global_momentum": 0.5, "hub_epochs": 0})
    state = hub.init_state()
    model = load_model(SPEC, state.tensors)
    names = [n for n, _ in model.named_parameters()]
    w0 = {n: state.tensors[f"model/{n}"].clone() for n in names}
    # Two silos, uniform weights: mean delta = (d1 + d2) / 2.
    d1 = {n: torch.full_like(w0[n], 0.2) for n in names}
    d2 = {n: torch.full_like(w0[n], -0.1) for n in names}
    summed = {f"delta/{n}": d1[n] + d2[n] for n in names}
    summed["weight"] = torch.tensor([2.0])
    state1, metrics = hub.finish_round(state, summed, {})
    assert metrics["aggregated_weight"] == 2.0
    # g = -mean delta = -0.05; buf = g; w1 = w0 - buf = w0 + 0.05 (hub_epochs=0: no fine-tune moves weights)
    for n in names:
        assert torch.allclose(state1.tensors[f"model/{n}"], w0[n] + 0.05, atol=1e-6)
        assert torch.allclose(state1.tensors[f"momentum/{n}"], torch.full_like(w0[n], -0.05))
    # Second step with the same pseudo-gradient: buf = 0.5 * (-0.05) + (-0.05) = -0.075.
    state2, _ = hub.finish_round(state1, summed, {})
    for n in names:
        assert torch.allclose(state2.tensors[f"model/{n}"], w0[n] + 0.05 + 0.075, atol=1e-6)
    assert state2.round == 2


def test_no_contribution_leaves_the_model_to_the_hub_fine_tune_only():
    hub = tiny_hub({"hub_epochs": 0})
    state = hub.init_state()
    state1, metrics = hub.finish_round(state, {}, {"pl_total": 100.0, "pl_selected": 0.0})
    assert metrics["aggregated_weight"] == 0.0
    assert metrics["pseudo_label_ratio"] == 0.0
    for k, v in state.tensors.items():
        if k.startswith("model/") and v.is_floating_point() and "running" not in k:
            assert torch.equal(v, state1.tensors[k])


def test_init_epochs_set_the_warm_up_before_round_1_and_hub_epochs_every_round_after(monkeypatch):
    hub = tiny_hub({"hub_epochs": 2, "init_epochs": 5})
    epochs_run = []
    real = hub._server_update
    monkeypatch.setattr(hub, "_server_update", lambda model, r, epochs: epochs_run.append(epochs) or real(model, r, epochs))
    state = hub.init_state()
    hub.finish_round(state, {}, {})
    assert epochs_run == [5, 2]
    epochs_run.clear()
    default = tiny_hub({"hub_epochs": 3})  # no init_epochs: the warm-up is hub_epochs long, as in the paper
    real = default._server_update
    monkeypatch.setattr(default, "_server_update", lambda model, r, epochs: epochs_run.append(epochs) or real(model, r, epochs))
    default.finish_round(default.init_state(), {}, {})
    assert epochs_run == [3, 3]


@pytest.mark.parametrize("algorithm", ["semifl", "fedseal"])
def test_every_hub_fine_tune_draws_its_own_batches_the_last_two_share_only_the_learning_rate(monkeypatch, algorithm):
    # The fine-tune after round r runs at round r + 1's learning rate, capped at the last round's: rounds T-1 and T
    # share it, and their batches came from the same generator stream too.
    import importlib

    module = importlib.import_module(f"silo_core.algorithms.{algorithm}")
    calls = []
    real = module.hub_update

    def recording(model, *args, generator, lr, **kw):
        calls.append((generator.initial_seed(), lr))
        return real(model, *args, generator=generator, lr=lr, **kw)

    monkeypatch.setattr(module, "hub_update", recording)
    if algorithm == "semifl":
        hub = tiny_hub({"hub_epochs": 1}, rounds=3)
    else:
        from tests.silo_core.test_fedseal import tiny_hub as fedseal_hub
        hub = fedseal_hub({"hub_epochs": 1}, rounds=3)
    state = hub.init_state()
    for _ in range(3):
        state, _ = hub.finish_round(state, {}, {})
    seeds, rates = [c[0] for c in calls], [c[1] for c in calls]
    assert len(calls) == 4 and len(set(seeds)) == 4  # the warm-up and three rounds: four batch orders
    assert rates[2] == rates[3]  # rounds 2 and 3 fine-tune at round 3's rate


def test_pseudo_label_metrics_from_summed_counts():
    m = pseudo_label_metrics({"pl_total": 200.0, "pl_selected": 50.0, "pl_correct": 40.0})
    assert m == {"pseudo_label_ratio": 0.25, "pseudo_label_accuracy": 0.8}


def test_cosine_lr_starts_at_base_and_decays_per_round():
    lrs = [cosine_lr(0.03, r, 10) for r in range(1, 11)]
    assert lrs[0] == pytest.approx(0.03)
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[-1] == pytest.approx(0.03 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert cosine_lr(0.03, 5, 10, "constant") == 0.03


def test_silo_skips_when_nothing_passes_tau_and_sends_nothing():
    hub = tiny_hub({"tau": 1.0})
    plan = hub.begin_round(hub.init_state())
    silo = SemiFLSilo(SemiFLOptions(tau=1.0), SPEC, torch.device("cpu"))
    images = torch.randint(0, 256, (16, 1, 28, 28), dtype=torch.uint8)
    result = silo.local_update(plan, SiloData(images=images, silo_id="s1"))
    assert result.skipped and result.tensors == {}
    assert result.metrics["pl_total"] == 16 and result.metrics["pl_selected"] == 0


def test_silo_update_matches_the_plan_and_moves_the_model():
    hub = tiny_hub({"tau": 0.0})
    plan = hub.begin_round(hub.init_state())
    opts = SemiFLOptions(tau=0.0, local_epochs=1, silo_batch_size=4)
    silo = SemiFLSilo(opts, SPEC, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (12, 1, 28, 28), dtype=torch.uint8, generator=g)
    truth = torch.arange(12) % 10
    result = silo.local_update(plan, SiloData(images=images, true_labels=truth, silo_id="s1"))
    assert not result.skipped
    assert set(result.tensors) == set(plan.expected)
    for name, spec in plan.expected.items():
        assert tuple(result.tensors[name].shape) == spec.shape
    assert float(result.tensors["weight"]) == 1.0
    assert sum(float(t.abs().sum()) for k, t in result.tensors.items() if k.startswith("delta/")) > 0
    assert result.metrics["pl_selected"] == 12 and 0 <= result.metrics["pl_correct"] <= 12
    assert result.metrics["train_steps"] == 3
    # Same plan, same silo id: the same update (a resumed round reproduces it).
    again = silo.local_update(plan, SiloData(images=images, true_labels=truth, silo_id="s1"))
    assert all(torch.allclose(again.tensors[k], result.tensors[k]) for k in result.tensors)
