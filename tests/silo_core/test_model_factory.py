"""model.factory: the user's own network through the same registry door as the built-ins and the libraries, and
the architecture fingerprint a silo checks its build against."""

from __future__ import annotations

import pytest
import torch

import tests.model_factories as factories
from silo_core.models import ModelSpec, TensorShape, architecture, architecture_difference, load_factory
from silo_server.config import ConfigError, parse_config

TINY = "tests.model_factories:tiny_net"


def test_a_factory_gets_the_runs_shape_and_options_and_the_kits_static_bn() -> None:
    spec = ModelSpec(TINY, num_classes=4, in_channels=3, image_size=16, options={"width": 5}, factory=TINY)
    spec.check_options()
    model = spec.build()
    assert model[0].weight.shape == (5, 3, 3, 3)  # width from model.options, channels from the run
    assert model[-1].out_features == 4
    assert model[1].momentum is None  # static BN, as for every network the registry builds
    assert model(torch.zeros(2, 3, 16, 16)).shape == (2, 4)
    grouped = ModelSpec(TINY, options={"norm": "group"}, factory=TINY).build()
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in grouped.modules())
    assert ModelSpec(TINY, factory=TINY).scaled(1.0).factory == TINY
    with pytest.raises(ValueError, match="cannot be narrowed"):
        ModelSpec(TINY, factory=TINY).scaled(0.5)


def test_a_factory_that_computes_with_tensors_passes_the_config_time_check() -> None:
    # On the meta device .item() has no value: the check builds such a network on the CPU instead of refusing it.
    factory = "tests.model_factories:widths_from_tensors"
    ModelSpec(factory, num_classes=3, in_channels=1, image_size=8, factory=factory).check_options()


@pytest.mark.parametrize(("factory", "says"), [
    ("tests.model_factories.tiny_net", "must be written package.module:callable"),
    ("no_such_package_xyz.models:build", "cannot import no_such_package_xyz"),
    ("tests.model_factories:nothing_here", "tests.model_factories has no nothing_here"),
    ("tests.model_factories:NOT_CALLABLE", "is a int, not a callable"),
    ("tests.model_factories:not_a_model", "returned a str, not a torch.nn.Module"),
    ("tests.model_factories:wrong_output", "returns (2, 11) while training, not (batch, 10) logits"),
])
def test_a_bad_factory_is_refused_in_one_line_naming_it(factory, says) -> None:
    with pytest.raises(ValueError) as info:
        ModelSpec(factory, factory=factory).check_options()
    assert says in str(info.value) and "\n" not in str(info.value)


def test_an_option_the_factory_does_not_take_names_the_factory() -> None:
    with pytest.raises(ValueError, match=r"model factory tests.model_factories:tiny_net failed .*depth"):
        ModelSpec(TINY, options={"depth": 3}, factory=TINY).build()


def test_load_factory_returns_the_callable_itself() -> None:
    assert load_factory(TINY) is factories.tiny_net


def test_the_hub_config_takes_a_factory_or_a_name_not_both(tmp_path) -> None:
    base = {"data": {"labeled": {"kind": "demo", "labels_per_class": 1}}}
    config = parse_config({**base, "model": {"factory": TINY, "options": {"width": 4}}}, base=tmp_path)
    assert config.model.factory == TINY
    with pytest.raises(ConfigError, match="model.name .* or model.factory .*, not both"):
        parse_config({**base, "model": {"name": "small_cnn", "factory": TINY}}, base=tmp_path)
    with pytest.raises(ConfigError, match="cannot import no_such_package_xyz"):
        parse_config({**base, "model": {"factory": "no_such_package_xyz:build"}}, base=tmp_path)


def test_the_fingerprint_names_the_first_tensor_that_differs(monkeypatch) -> None:
    spec = ModelSpec(TINY, factory=TINY)
    hub = architecture(spec.build())
    assert architecture_difference(hub, architecture(spec.build())) is None
    assert all(isinstance(t, TensorShape) for t in hub) and hub[0] == TensorShape("0.weight", (8, 1, 3, 3), "float32")
    monkeypatch.setattr(factories, "HIDDEN_WIDTH", 6)  # this site's copy of the package differs
    assert architecture_difference(hub, architecture(spec.build())) == (
        "5.weight is [6, 8] float32 here but [8, 8] float32 at the hub")
    assert architecture_difference(hub[:-1], hub) == (
        "this build has 7.bias [10] float32, which the hub's model lacks")
    assert architecture_difference(hub, hub[:-1]) == (
        "the hub's model has 7.bias [10] float32, which this build lacks")
    half = [TensorShape(t.name, t.shape, "float16") for t in hub]
    assert architecture_difference(half, hub).startswith("0.weight is [8, 1, 3, 3] float32 here but")
