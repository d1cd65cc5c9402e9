"""Library models by name (`torchvision/<name>`, `timm/<name>`): the registry applies the kit's conventions (class
count, input channels, static BN or group norm), refuses pretrained weights and unknown names or options in one line,
and the algorithms run on the result unchanged."""

import math
import re
import sys

import pytest
import torch
from torch import nn

from silo_core.algorithms.base import HubData, SiloData
from silo_core.algorithms.semifl import SemiFLHub, SemiFLOptions, SemiFLSilo
from silo_core.models import ModelSpec, adapt_stem
from silo_core.sbn import batchnorm_layers, compute_static_bn
from silo_server.config import ConfigError, parse_config


def spec(name: str, in_channels: int = 1, **options) -> ModelSpec:
    return ModelSpec(f"torchvision/{name}", num_classes=7, in_channels=in_channels, image_size=32,
                     mean=[0.5] * in_channels, std=[0.5] * in_channels, options=options)


def batchnorms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("name, in_channels", [
    ("resnet18", 1), ("resnet18", 3), ("mobilenet_v3_small", 1), ("efficientnet_b0", 3), ("densenet121", 1),
])
def test_a_torchvision_network_takes_our_classes_channels_and_static_bn(name, in_channels):
    torch.manual_seed(0)
    model = spec(name, in_channels).build()
    out = model.train()(torch.randn(2, in_channels, 32, 32))
    assert tuple(out.shape) == (2, 7) and torch.isfinite(out).all()
    layers = batchnorms(model)
    assert layers and all(bn.momentum is None and bn.track_running_stats for bn in layers)  # all static BN


@pytest.mark.parametrize("name, stem", [
    ("resnet18", "conv1"), ("densenet121", "features.conv0"), ("efficientnet_b0", "features.0.0"),
    ("mobilenet_v3_small", "features.0.0"), ("convnext_tiny", "features.0.0"), ("vit_b_16", "conv_proj"),
])
def test_the_stem_is_the_first_convolution_and_keeps_its_geometry(name, stem):
    from torchvision import models

    with torch.device("meta"):  # shapes only: fast even for convnext and vit
        original = models.get_model(name, weights=None).get_submodule(stem)
        adapted = adapt_stem(models.get_model(name, weights=None), 1).get_submodule(stem)
    assert original.in_channels == 3 and adapted.in_channels == 1
    for key in ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
        assert getattr(adapted, key) == getattr(original, key)
    assert (adapted.bias is None) == (original.bias is None)


def test_a_transformer_is_built_for_the_model_image_size():
    vit = ModelSpec("torchvision/vit_b_32", num_classes=7, in_channels=1, image_size=64).build()
    assert vit.image_size == 64 and vit.conv_proj.in_channels == 1
    assert tuple(vit(torch.zeros(2, 1, 64, 64)).shape) == (2, 7)
    ModelSpec("torchvision/vit_b_16", in_channels=1, image_size=32).check_options()  # 2x2 patches: accepted


def test_norm_group_leaves_no_batch_norm_and_passes_opacus():
    from opacus.validators import ModuleValidator

    model = spec("resnet18", norm="group").build()
    assert batchnorms(model) == [] and any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert model.bn1.num_groups == 8 and model.bn1.num_channels == 64
    assert ModuleValidator.validate(model, strict=False) == []  # DP-SGD ready
    assert tuple(model(torch.randn(2, 1, 32, 32)).shape) == (2, 7)


def test_static_bn_statistics_are_the_exact_moments_of_each_layer_input():
    torch.manual_seed(0)
    model = spec("resnet18").build()
    images = torch.randn(8, 1, 32, 32)
    compute_static_bn(model, [images[:4], images[4:]])
    for name, bn in batchnorm_layers(model).items():
        assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all(), name
        assert bn.running_var.abs().sum() > 0, name
    # bn1 normalises conv1's output: its statistics are that output's per-channel mean and population variance.
    with torch.no_grad():
        x = model.conv1(images).transpose(0, 1).reshape(64, -1)
    assert torch.allclose(model.bn1.running_mean, x.mean(1), atol=1e-5)
    assert torch.allclose(model.bn1.running_var, x.var(1, unbiased=False), atol=1e-4)
    model.eval()
    assert torch.isfinite(model(images)).all()


@pytest.mark.parametrize("model, message", [
    (spec("resnet18", weights="IMAGENET1K_V1"), "options.weights is not allowed for model torchvision/resnet18: "
                                                "nothing is downloaded"),
    (spec("resnet18", num_classes=3), "options.num_classes is not allowed for model torchvision/resnet18: the class "
                                      "count comes from the hub's labeled data"),
    (spec("resnet19"), "unknown torchvision model 'resnet19'; did you mean resnet18"),
    (spec("no_such_net"), "unknown torchvision model 'no_such_net'; e.g. resnet18, resnet50, densenet121"),
    (spec("fasterrcnn_resnet50_fpn"), "torchvision/fasterrcnn_resnet50_fpn is not a classification model"),
    (spec("resnet18", zero_init_residal=True), "unknown options.zero_init_residal for model torchvision/resnet18"),
    (spec("resnet18", groups=2), "model torchvision/resnet18 cannot be built for 1x32x32 images with options "
                                 "{'groups': 2}: ValueError: BasicBlock only supports groups=1"),
    (spec("resnet18", norm="layer"), "unknown options.norm 'layer'; choose one of batch, group"),
    (spec("alexnet"), "model torchvision/alexnet cannot take 1x32x32 images"),
    (ModelSpec("torchvision/vit_b_16", in_channels=1, image_size=40),  # not a multiple of its 16 px patches
     "model torchvision/vit_b_16 cannot be built for 1x40x40 images"),
    (ModelSpec("torchvision/"), "model 'torchvision/' names no torchvision model, e.g. torchvision/resnet18"),
])
def test_bad_library_models_are_refused_in_one_line(model, message):
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        model.check_options()
    assert "\n" not in str(caught.value)


def test_options_reach_the_builder():
    narrow = spec("mobilenet_v3_small", width_mult=0.5, dropout=0.1).build()
    assert narrow.features[0][0].out_channels == 8 and narrow.classifier[2].p == 0.1  # 16 channels at width 1
    # zero_init_residual zeroes the last BN's gamma of each block; static BN is applied in place and keeps it.
    zero = spec("resnet18", zero_init_residual=True).build()
    assert not zero.layer1[0].bn2.weight.detach().any() and zero.layer1[0].bn2.momentum is None


def test_hassle_cannot_narrow_a_library_network_and_says_what_to_set():
    resnet = spec("resnet18")
    assert resnet.scaled(1.0) == resnet and resnet.scaled(1.0) is not resnet
    with pytest.raises(ValueError, match=re.escape("set algorithm.options.residual_width: 1.0")):
        resnet.scaled(0.25)


def test_hub_config_accepts_a_torchvision_model_and_refuses_a_detector():
    base = {"data": {"labeled": {"kind": "demo"}}}
    model = {"name": "torchvision/resnet18", "in_channels": 1, "image_size": 32}
    assert parse_config({**base, "model": model}).model.name == "torchvision/resnet18"
    with pytest.raises(ConfigError, match="is not a classification model"):
        parse_config({**base, "model": {**model, "name": "torchvision/fasterrcnn_resnet50_fpn"}})
    with pytest.raises(ConfigError, match=re.escape("options.weights is not allowed")):
        parse_config({**base, "model": {**model, "options": {"weights": "DEFAULT"}}})


def test_a_semifl_silo_update_runs_on_a_torchvision_resnet():
    resnet = spec("resnet18")
    g = torch.Generator().manual_seed(0)
    labeled = torch.randint(0, 256, (8, 1, 32, 32), dtype=torch.uint8, generator=g)
    hub = SemiFLHub(SemiFLOptions(hub_epochs=0), resnet, HubData(labeled, torch.arange(8) % 7),
                    torch.device("cpu"), seed=0, total_rounds=2)
    plan = hub.begin_round(hub.init_state())
    silo = SemiFLSilo(SemiFLOptions(tau=0.0, local_epochs=1, silo_batch_size=4), resnet, torch.device("cpu"))
    images = torch.randint(0, 256, (8, 1, 32, 32), dtype=torch.uint8, generator=g)
    result = silo.local_update(plan, SiloData(images=images, silo_id="s1"))
    assert not result.skipped and result.metrics["train_steps"] == 2
    names = {f"delta/{n}" for n, _ in resnet.build().named_parameters()}
    assert set(result.tensors) == names | {"weight"} == set(plan.expected)
    assert all(torch.isfinite(t).all() for t in result.tensors.values())
    assert sum(float(result.tensors[n].abs().sum()) for n in names) > 0 and math.isfinite(result.metrics["train_loss"])


def test_timm_without_timm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # makes `import timm` fail as if it were not installed
    with pytest.raises(ValueError, match=re.escape('pip install "silokit[timm]"')):
        ModelSpec("timm/resnet18").build()


def test_a_timm_network_takes_our_classes_channels_and_static_bn():
    pytest.importorskip("timm")
    torch.manual_seed(0)
    model = ModelSpec("timm/resnet18", num_classes=7, in_channels=1, image_size=32).build()
    assert tuple(model.train()(torch.randn(2, 1, 32, 32)).shape) == (2, 7)
    assert all(bn.momentum is None for bn in batchnorms(model)) and batchnorms(model)
    vit = ModelSpec("timm/vit_tiny_patch16_224", num_classes=7, in_channels=1, image_size=32)
    vit.check_options()  # built for 32 px images through img_size
    # timm fuses the activation into its BatchNormAct2d: swapping in a plain GroupNorm would drop it silently.
    with pytest.raises(ValueError, match=re.escape("options.norm: group cannot replace BatchNormAct2d")):
        ModelSpec("timm/efficientnet_b0", image_size=32, options={"norm": "group"}).check_options()
    with pytest.raises(ValueError, match=re.escape("options.pretrained is not allowed")):
        ModelSpec("timm/resnet18", options={"pretrained": True}).check_options()
