"""Sample-level DP at a silo: group-norm models, DP-SGD through Opacus, the silo's own ledger and budget."""

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from security.dp import PrivacyAccountant
from silo_core.algorithms.base import HubData, SiloData
from silo_core.algorithms.semifl import SemiFLHub, SemiFLOptions, SemiFLSilo
from silo_core.dp_sgd import SampleDPLedger, dp_schedule, dp_sgd_train, ledger_for
from silo_core.models import ModelSpec
from silo_core.training import OptimizerSettings, make_sgd
from silo_server.config import ConfigError, parse_config

GROUP = ModelSpec(options={"width": 4, "norm": "group"})
CPU = torch.device("cpu")


def images(n, seed=0):
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def as_float(x):
    return x.float() / 255.0


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("name", ["small_cnn", "wrn28_2"])
def test_group_norm_models_have_no_batch_norm_and_keep_their_parameter_names(name):
    batch = ModelSpec(name=name, options={"scale": 0.25} if name == "wrn28_2" else {}).build()
    group = ModelSpec(name=name, options={"norm": "group", **({"scale": 0.25} if name == "wrn28_2" else {})}).build()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in group.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in group.modules()) == sum(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for m in batch.modules())
    assert [n for n, _ in group.named_parameters()] == [n for n, _ in batch.named_parameters()]
    with pytest.raises(ValueError, match="norm"):
        ModelSpec(options={"norm": "layer"}).build()


def test_dp_sgd_refuses_batch_norm_with_the_fix_named():
    model = ModelSpec(options={"width": 4}).build()
    opt = make_sgd(model, 0.1, OptimizerSettings())
    with pytest.raises(ValueError, match="norm: group"):
        dp_sgd_train(model, images(8), torch.zeros(8, dtype=torch.long), as_float, epochs=1, batch_size=4,
                     optimizer=opt, noise_multiplier=1.0, clip_norm=1.0, device=CPU)


def test_every_example_gradient_is_clipped():
    """q = 1 and one step with plain SGD at lr 1: the step is the mean of clipped per-example gradients plus noise,
    so its norm is at most C (+ the noise's). Without DP the same step is far larger, so the bound is not free."""
    x, y = images(16, seed=1), torch.arange(16) % 10
    plain = OptimizerSettings(momentum=0.0, weight_decay=0.0, nesterov=False, grad_clip=0.0)
    torch.manual_seed(0)
    model = GROUP.build()
    before = flat(model)
    clip = 1e-3
    dp_sgd_train(model, x, y, as_float, epochs=1, batch_size=16, optimizer=make_sgd(model, 1.0, plain),
                 noise_multiplier=1e-6, clip_norm=clip, device=CPU)
    dp_step = float((flat(model) - before).norm())

    torch.manual_seed(0)
    free = GROUP.build()
    opt = make_sgd(free, 1.0, plain)
    nn.functional.cross_entropy(free(as_float(x)), y).backward()
    opt.step()
    free_step = float((flat(free) - before).norm())
    assert 0 < dp_step <= clip * 1.0001
    assert free_step > 20 * clip


def test_noise_has_the_configured_scale():
    """With zero-gradient data (lr 1, a clip far below any gradient) the step is essentially the noise:
    std sigma * C / expected batch per coordinate."""
    x, y = images(32, seed=2), torch.arange(32) % 10
    plain = OptimizerSettings(momentum=0.0, weight_decay=0.0, nesterov=False, grad_clip=0.0)
    model = GROUP.build()
    before = flat(model)
    sigma, clip = 2.0, 1e-6
    dp_sgd_train(model, x, y, as_float, epochs=1, batch_size=32, optimizer=make_sgd(model, 1.0, plain),
                 noise_multiplier=sigma, clip_norm=clip, device=CPU)
    std = float((flat(model) - before).std())
    assert std == pytest.approx(sigma * clip / 32, rel=0.1)


def test_ledger_matches_opacus_persists_and_refuses_damage(tmp_path):
    q, steps = dp_schedule(1000, 32, 2)
    assert q == 1 / 32 and steps == 2 * 32  # 32 Poisson draws a pass, each image in one of them on average
    path = tmp_path / "ledger.json"
    ledger = SampleDPLedger(1e-5, path)
    first = ledger.charge(1.1, q, steps)
    second = ledger.charge(1.1, q, steps)
    reference = PrivacyAccountant("rdp", 1e-5)
    reference.step(1.1, q, 2 * steps)
    assert first < second == pytest.approx(reference.epsilon())
    assert SampleDPLedger(1e-5, path).epsilon() == pytest.approx(second)  # a restarted silo goes on counting
    assert ledger.allows(None, 1.1, q, steps) and not ledger.allows(second, 1.1, q, steps)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="ledger.json is damaged"):
        SampleDPLedger(1e-5, path)
    cache = {}
    assert ledger_for(cache, "s1", "run", tmp_path, 1e-5) is ledger_for(cache, "s1", "run", tmp_path, 1e-5)
    assert (tmp_path / "sample_dp_ledger-run.json").exists() is False  # nothing charged yet, nothing written


def test_semifl_silo_under_sample_dp_reports_growing_epsilon_and_stops_at_its_budget(tmp_path):
    g = torch.Generator().manual_seed(0)
    hub_images = torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8, generator=g)
    options = SemiFLOptions(tau=0.0, hub_epochs=1, local_epochs=1, silo_batch_size=4, aggregation="samples")
    hub = SemiFLHub(options, GROUP, HubData(hub_images, torch.arange(20) % 10), CPU, seed=0, total_rounds=3)
    plan = hub.begin_round(hub.init_state())
    silo = SemiFLSilo(options, GROUP, CPU)
    data = SiloData(images=images(12, seed=5), true_labels=torch.arange(12) % 10, silo_id="s1", state_dir=tmp_path,
                    run_id="run-1")
    q, steps = dp_schedule(12, 4, 1)
    one_round, two_rounds = PrivacyAccountant("rdp", 1e-5), PrivacyAccountant("rdp", 1e-5)
    one_round.step(1.0, q, steps)
    two_rounds.step(1.0, q, 2 * steps)
    budget = (one_round.epsilon() + two_rounds.epsilon()) / 2  # room for one round, not two
    plan.hyperparameters["sample_dp"] = {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5,
                                         "epsilon_budget": budget}

    first = silo.local_update(plan, data)
    assert not first.skipped and set(first.tensors) == set(plan.expected)
    assert float(first.tensors["weight"]) == 1.0  # never a count of the silo's images under sample-level DP
    assert first.metrics["sample_dp_epsilon"] == pytest.approx(one_round.epsilon())
    saved = json.loads((tmp_path / "sample_dp_ledger-run-1.json").read_text())
    assert sum(s for _, _, s in saved["history"]) == steps

    second = SemiFLSilo(options, GROUP, CPU).local_update(plan, data)  # a restarted silo: ledger from disk
    assert second.skipped and second.tensors == {} and second.metrics["sample_dp_budget_spent"] == 1.0
    assert second.metrics["sample_dp_epsilon"] == pytest.approx(one_round.epsilon())


BASE = {"data": {"labeled": {"kind": "demo"}}}


@pytest.mark.parametrize("raw, message", [
    ({**BASE, "privacy": {"sample_dp": {"enabled": True}}}, "model.options.norm: group"),
    ({**BASE, "model": {"options": {"norm": "group"}}, "algorithm": {"name": "fedseal"},
      "privacy": {"sample_dp": {"enabled": True}}}, "not available for algorithm 'fedseal'"),
    ({**BASE, "model": {"options": {"norm": "batchy"}}}, "options.norm"),
    # FlexMatch/FreeMatch thresholds depend on every image of the silo: one image would change many others' labels.
    ({**BASE, "model": {"options": {"norm": "group"}}, "algorithm": {"options": {"threshold_rule": "flexmatch"}},
      "privacy": {"sample_dp": {"enabled": True}}}, "threshold_rule: fixed"),
    ({**BASE, "model": {"options": {"norm": "group"}}, "privacy": {"sample_dp": {"enabled": True, "sigma": 1}}},
     "privacy.sample_dp.sigma"),
])
def test_sample_dp_config_errors_say_what_to_change(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_sample_dp_config_accepted_with_group_norm_and_semifl():
    config = parse_config({**BASE, "model": {"options": {"norm": "group"}},
                           "privacy": {"sample_dp": {"enabled": True, "noise_multiplier": 0.8,
                                                     "epsilon_budget": 10}}})
    assert config.privacy.sample_dp.hyperparameters()["noise_multiplier"] == 0.8
    assert not config.privacy.enabled  # the hub's aggregation itself stays plain


@pytest.mark.parametrize(("n", "batch"), [(150, 100), (1000, 32), (12, 4), (5, 8)])
def test_the_ledgers_rate_and_steps_are_the_ones_opacus_samples_at(n, batch):
    from opacus.data_loader import DPDataLoader

    loader = DPDataLoader.from_data_loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=batch))
    q, steps = dp_schedule(n, batch, 3)
    assert q == pytest.approx(loader.sample_rate) and steps == 3 * len(loader)
