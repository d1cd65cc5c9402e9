"""The model registry's doors: it lists its built-ins and providers; MONAI's networks come in as one provider module
(`monai/<name>`) with the kit's conventions and train under an algorithm unchanged; a new built-in is one decorated
function in this file; and the hub (from hub.yaml) and a silo (from the wire) make the same spec."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from torch import nn

from silo_core.algorithms.base import HubData, SiloData
from silo_core.algorithms.semifl import SemiFLHub, SemiFLOptions, SemiFLSilo
from silo_core.models import BUILT_INS, PROVIDERS, ModelSpec, model_names, register_model
from silo_server.config import ConfigError, parse_config
from silo_server.wire.servicer import run_description_message

DEMO = {"data": {"labeled": {"kind": "demo"}}}


def densenet(in_channels: int = 1, **options) -> ModelSpec:
    return ModelSpec("monai/DenseNet121", num_classes=10, in_channels=in_channels, image_size=32,
                     mean=[0.5] * in_channels, std=[0.5] * in_channels, options={"spatial_dims": 2, **options})


def batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_the_registry_lists_its_built_ins_and_providers():
    assert model_names()[:2] == ["small_cnn", "wrn28_2"]
    assert {"torchvision/<name>", "timm/<name>", "monai/<name>"} <= set(model_names())
    assert {"torchvision", "timm", "monai", "factory"} <= set(PROVIDERS)
    assert "factory/<name>" not in model_names()  # the factory provider answers model.factory only
    with pytest.raises(ValueError, match=re.escape("choose one of small_cnn, wrn28_2, torchvision/<name>, "
                                                   "timm/<name>, monai/<name>")):
        ModelSpec("factory/x").check_options()


# ------------------------------------------------------------------------------ MONAI through its provider

@pytest.mark.parametrize("in_channels", [1, 3])
def test_a_monai_densenet_takes_our_classes_channels_and_static_bn(in_channels):
    pytest.importorskip("monai")
    torch.manual_seed(0)
    spec = densenet(in_channels)
    spec.check_options()  # the config-time probe on the meta device
    model = spec.build()
    assert model.features.conv0.in_channels == in_channels  # MONAI takes the channels itself: no new stem
    layers = batchnorms(model)
    assert layers and all(bn.momentum is None and bn.track_running_stats for bn in layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.class_layers.out.weight.detach().clone()
    loss = nn.functional.cross_entropy(model.train()(torch.randn(4, in_channels, 32, 32)), torch.arange(4))
    loss.backward()
    optimizer.step()
    assert model.class_layers.out.weight.shape == (10, 1024) and torch.isfinite(loss)
    assert not torch.equal(before, model.class_layers.out.weight)


def test_a_semifl_silo_update_runs_on_a_monai_densenet():
    pytest.importorskip("monai")
    spec = densenet()
    g = torch.Generator().manual_seed(0)
    labeled = torch.randint(0, 256, (8, 1, 32, 32), dtype=torch.uint8, generator=g)
    hub = SemiFLHub(SemiFLOptions(hub_epochs=0), spec, HubData(labeled, torch.arange(8) % 10),
                    torch.device("cpu"), seed=0, total_rounds=2)
    plan = hub.begin_round(hub.init_state())
    silo = SemiFLSilo(SemiFLOptions(tau=0.0, local_epochs=1, silo_batch_size=4), spec, torch.device("cpu"))
    images = torch.randint(0, 256, (8, 1, 32, 32), dtype=torch.uint8, generator=g)
    result = silo.local_update(plan, SiloData(images=images, silo_id="s1"))
    assert not result.skipped and result.metrics["train_steps"] == 2
    assert set(result.tensors) == set(plan.expected)
    assert all(torch.isfinite(t).all() for t in result.tensors.values())


def test_group_norm_replaces_monais_batch_norms():
    pytest.importorskip("monai")
    model = densenet(norm="group").build()
    assert batchnorms(model) == [] and any(isinstance(m, nn.GroupNorm) for m in model.modules())


@pytest.mark.parametrize("spec, message", [
    (ModelSpec("monai/DenseNet12"), "unknown monai model 'DenseNet12'; did you mean DenseNet121"),
    (ModelSpec("monai/drop_connect"), "unknown monai model 'drop_connect'"),  # a function, not a network
    (ModelSpec("monai/"), "model 'monai/' names no monai model, e.g. monai/DenseNet121"),
    (densenet(pretrained=True), "options.pretrained is not allowed for model monai/DenseNet121: nothing is "
                                "downloaded"),
    (densenet(out_channels=3), "options.out_channels is not allowed for model monai/DenseNet121: the class count "
                               "comes from the hub's labeled data"),
    (densenet(spatial_dims=3), "options.spatial_dims must be 2 for model monai/DenseNet121, got 3"),
    (densenet(growth_rat=16), "unknown options.growth_rat for model monai/DenseNet121"),
    (ModelSpec("monai/DenseNet121", image_size=28), "model monai/DenseNet121 cannot take 1x28x28 images"),
    (ModelSpec("monai/UNet", image_size=32, options={"channels": [4, 8], "strides": [2]}),
     "model monai/UNet returns (2, 10, 32, 32) while training, not (batch, 10) logits"),
])
def test_bad_monai_models_are_refused_in_one_line(spec, message):
    pytest.importorskip("monai")
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        spec.check_options()
    assert "\n" not in str(caught.value)


def test_monai_without_monai_says_how_to_install_it(monkeypatch):
    for name in ("monai", "monai.networks", "monai.networks.nets"):
        monkeypatch.setitem(sys.modules, name, None)  # `import monai` fails as if it were not installed
    with pytest.raises(ValueError) as caught:
        densenet().build()
    assert str(caught.value) == 'monai/<name> models need MONAI: pip install "silokit[monai]"'
    with pytest.raises(ConfigError, match=re.escape('pip install "silokit[monai]"')):
        parse_config({**DEMO, "model": {"name": "monai/DenseNet121", "image_size": 32,
                                        "options": {"spatial_dims": 2}}})


# ------------------------------------------------------------------------------ a new built-in, in a few dozen lines

@pytest.fixture
def keep_built_ins():
    """Whatever a test registers is gone afterwards."""
    before = dict(BUILT_INS)
    yield
    BUILT_INS.clear()
    BUILT_INS.update(before)


def test_a_new_built_in_model_is_one_decorated_function(keep_built_ins):
    def check(spec: ModelSpec) -> None:
        hidden = spec.options.get("hidden", 32)
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"options.hidden must be a positive whole number, got {hidden!r}")

    def scale(options: dict, factor: float) -> dict:
        return {**options, "hidden": max(1, round(options.get("hidden", 32) * factor))}

    @register_model("tiny_mlp", options=("hidden",), check=check, scale=scale)
    def tiny_mlp(spec: ModelSpec) -> nn.Module:
        hidden = spec.options.get("hidden", 32)
        return nn.Sequential(nn.Flatten(), nn.Linear(spec.in_channels * spec.image_size ** 2, hidden),
                             nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, spec.num_classes))

    assert "tiny_mlp" in model_names()
    spec = ModelSpec("tiny_mlp", num_classes=4, in_channels=3, image_size=8, options={"hidden": 16})
    spec.check_options()
    model = spec.build()
    assert tuple(model(torch.zeros(2, 3, 8, 8)).shape) == (2, 4)
    assert model[2].momentum is None  # the registry made its BatchNorm static, as for every model
    assert spec.scaled(0.5).build()[1].out_features == 8  # HASSLE's compact model
    assert not batchnorms(ModelSpec("tiny_mlp", options={"norm": "group"}).build())
    assert parse_config({**DEMO, "model": {"name": "tiny_mlp", "options": {"hidden": 8}}}).model.name == "tiny_mlp"
    with pytest.raises(ValueError, match=re.escape("unknown options.hiden for model tiny_mlp; its options are "
                                                   "hidden, norm")):
        ModelSpec("tiny_mlp", options={"hiden": 8}).build()
    with pytest.raises(ValueError, match=re.escape("options.hidden must be a positive whole number, got 0")):
        ModelSpec("tiny_mlp", options={"hidden": 0}).check_options()
    with pytest.raises(ValueError, match="already registered"):
        register_model("tiny_mlp")(tiny_mlp)


# ------------------------------------------------------------------------------ one spec from hub.yaml and the wire

@pytest.mark.parametrize("model", [
    {"name": "small_cnn", "options": {"width": 8, "head": "flatten"}},
    {"name": "torchvision/resnet18", "in_channels": 3, "image_size": 32, "mean": [0.485, 0.456, 0.406],
     "std": [0.229, 0.224, 0.225], "options": {"zero_init_residual": True}},
    {"factory": "tests.model_factories:tiny_net", "options": {"width": 4}},
])
def test_the_hub_and_a_silo_make_the_same_spec(model, tmp_path):
    hub = ModelSpec.from_config(parse_config({**DEMO, "model": model}, base=tmp_path).model, num_classes=7)
    # What the hub sends (silo_server/app.py run_description, silo_server/wire/servicer.py) and a silo reads back.
    wire = run_description_message({
        "run_id": "r", "algorithm": "semifl", "algorithm_options": {}, "total_rounds": 1, "max_upload_bytes": 1,
        "chunk_bytes": 1, "model": hub.name, "model_options": hub.options, "model_factory": hub.factory or "",
        "num_classes": hub.num_classes, "in_channels": hub.in_channels, "image_size": hub.image_size,
        "mean": hub.mean, "std": hub.std})
    silo = ModelSpec.from_run(wire)
    assert silo == hub
    assert silo.mean == model.get("mean", [0.5] * hub.in_channels)  # float32 on the wire, the config's numbers back
    assert json.loads(wire.model_options_json) == model["options"]
