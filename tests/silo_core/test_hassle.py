"""HASSLE/SUMA pinned: residual loss terms and the proximity gradient against direct computations, count-weighted
sums of whole model groups equal the weighted mean, ensemble inference, pseudo-labels from S_{t-1} + r_US."""

import math

import pytest
import torch
from torch import nn

from silo_core.algorithms.base import HubData, SiloData, load_model
from silo_core.algorithms.hassle import (
    MODELS,
    DualEnsemble,
    HASSLEHub,
    HASSLEOptions,
    HASSLESilo,
    hassle_pseudo_labels,
    proximity_term,
    residual_losses,
)
from silo_core.models import ModelSpec, count_parameters
from silo_core.tensors import check_tensors
from silo_server.rounds.aggregate import RunningSum

SPEC = ModelSpec(options={"width": 8})
CPU = torch.device("cpu")
TINY = {"local_epochs": 1, "batch_size": 4, "lr": 0.05}


def images(n, seed):
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def make_hub(**options):
    data = HubData(images(10, 0), torch.arange(10) % 10)
    return HASSLEHub(HASSLEOptions(**{**TINY, **options}), SPEC, data, CPU, seed=0, total_rounds=3)


def test_residual_loss_terms_match_a_direct_computation():
    base = torch.tensor([[1.0, 0.0, -1.0], [0.2, 0.4, 0.1]])
    residual = torch.tensor([[0.5, -0.5, 0.0], [0.0, 1.0, -1.0]])
    target = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.5]])
    labels = torch.tensor([1, 2])
    T = 2.0
    ce_direct = kl_direct = 0.0
    for i in range(2):
        z = (base[i] + residual[i]).tolist()
        ce_direct += -(z[labels[i]] - math.log(sum(math.exp(v) for v in z))) / 2
        p = [math.exp(v / T) for v in residual[i].tolist()]
        q = [math.exp(v / T) for v in target[i].tolist()]
        p = [v / sum(p) for v in p]
        q = [v / sum(q) for v in q]
        kl_direct += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True)) / 2  # KL(residual || target)
    ce, kl = residual_losses(base, residual, target, labels, T)
    assert float(ce) == pytest.approx(ce_direct, rel=1e-6)
    assert float(kl) == pytest.approx(kl_direct, rel=1e-6)
    # The residual learns the difference exactly: no KL left.
    assert float(residual_losses(base, target, target, labels, T)[1]) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("kind", ["squared", "l2"])
def test_proximity_gradient(kind):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    anchor = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    gamma = 0.01
    proximity_term(model, anchor, gamma, kind).backward()
    diff = {n: p.detach() - anchor[n] for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float((d ** 2).sum()) for d in diff.values()))
    for n, p in model.named_parameters():
        expected = 2 * gamma * diff[n] if kind == "squared" else gamma * diff[n] / norm
        assert torch.allclose(p.grad, expected, atol=1e-7)
    # l2 at w == w' stays finite (the paper's form has no gradient there).
    model.zero_grad()
    proximity_term(model, {n: p.detach().clone() for n, p in model.named_parameters()}, gamma, "l2").backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def test_pseudo_labels_with_and_without_tau():
    logits = torch.tensor([[3.0, 0.0], [0.1, 0.0], [0.0, 5.0]])
    labels, keep = hassle_pseudo_labels(logits, None)
    assert labels.tolist() == [0, 0, 1] and keep.all()
    assert hassle_pseudo_labels(logits, 0.9)[1].tolist() == [True, False, True]


def test_residual_models_are_quarter_width_and_the_plan_declares_four_groups():
    hub = make_hub()
    plan = hub.begin_round(hub.init_state())
    assert set(plan.groups) == set(MODELS)
    assert plan.groups == HASSLESilo(hub.options, SPEC, CPU).result_groups(plan.expected)
    full = load_model(SPEC, plan.tensors, prefix="S/")
    res = load_model(SPEC.scaled(0.25), plan.tensors, prefix="rUS/")
    assert res.classifier.in_features == full.classifier.in_features // 4
    assert count_parameters(res) < count_parameters(full) / 8
    assert any(k.startswith("prevS/") for k in plan.tensors)  # Eq. 11 pairs r_US with S_{t-1}
    assert not any(k.startswith("prevS/") for k in make_hub(residual_pairing="current").begin_round(
        hub.init_state()).tensors)


def test_sites_upload_only_what_they_trained_and_the_hub_takes_count_weighted_means():
    hub = make_hub(hub_participates=False)
    state = hub.init_state()
    plan = hub.begin_round(state)
    silo = HASSLESilo(hub.options, SPEC, CPU)
    sites = {
        "labeled": SiloData(images=images(0, 1), labeled_images=images(6, 2), labeled_labels=torch.arange(6), silo_id="a"),
        "partly": SiloData(images=images(8, 3), labeled_images=images(2, 4), labeled_labels=torch.tensor([3, 4]),
                           true_labels=torch.arange(8), silo_id="b"),
        "unlabeled": SiloData(images=images(5, 5), silo_id="c"),
    }
    results = {name: silo.local_update(plan, data) for name, data in sites.items()}
    groups_sent = {name: {k.split("/")[0] for k in r.tensors} for name, r in results.items()}
    assert groups_sent == {"labeled": {"S", "rUS"}, "partly": set(MODELS), "unlabeled": {"U", "rSU"}}
    for r in results.values():
        check_tensors(r.tensors, plan.expected, plan.groups)
    assert results["partly"].metrics["pl_total"] == 8 and 0 <= results["partly"].metrics["pl_correct"] <= 8
    sums = RunningSum()
    for r in results.values():
        sums.add(r.tensors, r.metrics)
    new, metrics = hub.finish_round(state, sums.result(), sums.metrics)
    assert [metrics[f"contributors_{k}"] for k in MODELS] == [2, 2, 2, 2]
    assert [metrics[f"samples_{k}"] for k in MODELS] == [8, 13, 8, 13]  # n_L = 6 + 2; n_U = 8 + 5
    for key in MODELS:
        before = dict(load_model(hub.specs[key], state.tensors, prefix=f"{key}/").named_parameters())
        after = dict(load_model(hub.specs[key], new.tensors, prefix=f"{key}/").named_parameters())
        local = [(float(r.tensors[f"{key}/weight"]), r) for r in results.values() if f"{key}/weight" in r.tensors]
        total = sum(n for n, _ in local)
        for name, w in before.items():
            # W_k = W + delta_k (a site sent n_k * delta_k); the hub must land on sum n_k W_k / sum n_k.
            mean = sum(n * (w + r.tensors[f"{key}/delta/{name}"] / n) for n, r in local) / total
            assert torch.allclose(after[name], mean, atol=1e-5), (key, name)
    # The models of round 1 are kept as the "previous" ones for round 2.
    for k, v in state.tensors.items():
        if k.startswith(("S/", "U/")):
            assert torch.equal(new.tensors["prev" + k], v)


def test_the_hub_is_a_labeled_site_that_trains_s_and_r_us_only():
    hub = make_hub(hub_participates=True)
    state = hub.init_state()
    new, metrics = hub.finish_round(state, {}, {})
    assert metrics["contributors_S"] == 0 and math.isfinite(metrics["hub_loss"])
    assert (hub._site.options.local_epochs, hub._site.options.batch_size) == (1, 4)  # the hub's own schedule...
    site = make_hub(hub_epochs=3, hub_batch_size=8)._site.options
    assert (site.local_epochs, site.batch_size) == (3, 8)  # ...when given
    moved = {key: not torch.allclose(new.tensors[f"{key}/classifier.weight"], state.tensors[f"{key}/classifier.weight"])
             for key in MODELS}
    assert moved == {"S": True, "rUS": True, "U": False, "rSU": False}


def test_ensemble_inference_is_the_mean_of_the_two_complemented_models():
    torch.manual_seed(0)
    nets = [nn.Linear(4, 3) for _ in range(4)]
    x = torch.randn(5, 4)
    s, r_us, u, r_su = (n(x) for n in nets)
    ens = DualEnsemble(*nets)
    assert torch.allclose(ens(x), ((s + r_us) + (u + r_su)) / 2)
    assert torch.allclose(DualEnsemble(*nets, mode="supervised")(x), s + r_us)
    assert torch.allclose(DualEnsemble(*nets, mode="unsupervised")(x), u + r_su)
    # The hub serves S_{t-1} + r_US_t and U_{t-1} + r_SU_t (paper's pairing) after a round.
    hub = make_hub(hub_participates=True)
    state, _ = hub.finish_round(hub.init_state(), {}, {})
    served = hub.served_model(state)
    assert torch.equal(served.supervised.classifier.weight, state.tensors["prevS/classifier.weight"])
    assert torch.equal(served.residual_us.classifier.weight, state.tensors["rUS/classifier.weight"])
    assert not served.training


def test_residual_models_start_by_adding_nothing():
    state = make_hub().init_state()
    for key in ("rUS", "rSU"):
        residual = load_model(SPEC.scaled(0.25), state.tensors, prefix=f"{key}/").eval()
        with torch.no_grad():
            assert float(residual(torch.randn(3, 1, 28, 28)).abs().max()) == 0.0


def test_the_unsupervised_groups_are_weighted_by_every_unlabeled_image_even_where_tau_kept_fewer():
    """Eq. 2 weights U and r_SU by n_U,k, the silo's unlabeled count: a threshold (tau) that keeps fewer images to
    train on must not shrink the silo's share of the mean."""
    hub = make_hub(hub_participates=False)
    plan = hub.begin_round(hub.init_state())
    data = SiloData(images=images(10, 7), silo_id="c")
    for tau in (0.5, 0.3, 0.2, 0.15, 0.13, 0.12, 0.11, 0.105):
        result = HASSLESilo(hub.options.model_copy(update={"tau": tau}), SPEC, CPU).local_update(plan, data)
        if 2 <= result.metrics["pl_selected"] < 10:
            break
    else:
        pytest.fail("no threshold kept between 2 and 9 of the 10 images")
    assert float(result.tensors["U/weight"]) == float(result.tensors["rSU/weight"]) == 10.0


def test_the_residuals_teachers_run_in_float32_under_bfloat16_autocast(monkeypatch):
    # On a GPU the silo trains under bfloat16 autocast; the residual's target, partner + partner_res - base, is a
    # difference of near-equal logits that bfloat16 (one step is 0.0625 at 8-16) rounds away, so the fixed teachers'
    # logits must be float32. The CPU takes the same code path when autocast is forced on.
    import silo_core.algorithms.hassle as hassle

    monkeypatch.setattr(hassle, "autocast", lambda device: torch.autocast("cpu", dtype=torch.bfloat16))
    forwards: list[tuple[bool, torch.dtype]] = []  # (a teacher's: run without gradients, its logits' dtype)
    built = hassle.load_model

    def load_and_watch(spec, tensors, prefix="model/"):
        model = built(spec, tensors, prefix=prefix)
        model.register_forward_hook(lambda m, i, out: forwards.append((not torch.is_grad_enabled(), out.dtype)))
        return model

    monkeypatch.setattr(hassle, "load_model", load_and_watch)
    hub = make_hub(hub_participates=False)
    plan = hub.begin_round(hub.init_state())
    data = SiloData(images=images(0, 1), labeled_images=images(6, 2), labeled_labels=torch.arange(6), silo_id="a")
    HASSLESilo(hub.options, SPEC, CPU).local_update(plan, data)
    assert {dtype for teacher, dtype in forwards if teacher} == {torch.float32}
    assert {dtype for teacher, dtype in forwards if not teacher} == {torch.bfloat16}  # the students do use it
