"""Model options: defaults and state-dict names unchanged; compact (1/4 width) variants for HASSLE; the flatten head;
bad options refused by name."""

import re

import pytest
import torch

from silo_core.models import ModelSpec, WideResNet, count_parameters
from silo_server.config import ConfigError, parse_config

WRN = ModelSpec("wrn28_2", in_channels=3, image_size=32, mean=[0.5] * 3, std=[0.5] * 3)


def test_defaults_keep_their_size_and_state_dict_names():
    assert count_parameters(ModelSpec().build()) == 33338
    wrn = WRN.build()
    assert count_parameters(wrn) == 1467610  # WRN-28-2, the SemiFL paper's model
    assert list(wrn.state_dict()) == list(WideResNet(3, 10, 28, 2).state_dict())
    assert "blocks.0.conv1.weight" in wrn.state_dict() and tuple(wrn.state_dict()["fc.weight"].shape) == (10, 128)


def test_quarter_width_scales_every_channel_count():
    small = ModelSpec().scaled(0.25)
    assert small.options["width"] == 4 and small.build().classifier.in_features == 16
    compact = WRN.scaled(0.25).build()
    assert compact.conv.out_channels == 4 and compact.fc.in_features == 32
    # Convolution parameters scale with the square of the width: about 1/16 of the full model.
    assert 0.05 < count_parameters(compact) / count_parameters(WRN.build()) < 0.08
    out = compact(torch.zeros(2, 3, 32, 32))
    assert tuple(out.shape) == (2, 10)
    assert WRN.options == {} and ModelSpec().options == {}  # scaling never mutates the original spec


def test_flatten_head_sees_every_position_of_the_last_feature_maps():
    pooled, flat = ModelSpec().build(), ModelSpec(options={"head": "flatten"}).build()
    # Same convolutions and the same state-dict names; only the classifier's input grows to 64 x 7 x 7.
    assert list(flat.state_dict()) == list(pooled.state_dict())
    assert tuple(flat.classifier.weight.shape) == (10, 64 * 7 * 7)
    assert count_parameters(flat) == 33338 - 650 + (64 * 49 * 10 + 10)
    assert tuple(flat(torch.zeros(3, 1, 28, 28)).shape) == (3, 10)
    wide32 = ModelSpec(in_channels=3, image_size=32, options={"head": "flatten", "width": 8}).build()
    assert wide32.classifier.in_features == 32 * 8 * 8 and tuple(wide32(torch.zeros(2, 3, 32, 32)).shape) == (2, 10)
    # HASSLE's quarter-width residual keeps the head.
    assert ModelSpec(options={"head": "flatten"}).scaled(0.25).build().classifier.in_features == 16 * 49


@pytest.mark.parametrize("spec, message", [
    (ModelSpec(options={"haed": "flatten"}), "unknown options.haed for model small_cnn; its options are width, norm, head"),
    (ModelSpec(options={"head": "max"}), "unknown options.head 'max'; choose one of pool, flatten"),
    (ModelSpec(options={"width": 0}), "options.width must be a positive whole number, got 0"),
    (ModelSpec(options={"width": "16"}), "options.width must be a positive whole number, got '16'"),
    (ModelSpec("wrn28_2", options={"head": "flatten"}), "unknown options.head for model wrn28_2"),
    (ModelSpec("wrn28_2", options={"scale": -1}), "options.scale must be a positive number, got -1"),
    (ModelSpec("resnet50"), "unknown model 'resnet50'; choose one of small_cnn, wrn28_2"),
])
def test_bad_model_options_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        spec.build()


def test_hub_config_refuses_a_bad_model_option_before_anything_runs():
    base = {"data": {"labeled": {"kind": "demo"}}}
    assert parse_config({**base, "model": {"options": {"head": "flatten"}}}).model.options == {"head": "flatten"}
    with pytest.raises(ConfigError, match=re.escape("unknown options.haed for model small_cnn")):
        parse_config({**base, "model": {"options": {"haed": "flatten"}}})
