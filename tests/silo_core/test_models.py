"""Model width options: defaults and state-dict names unchanged; compact (1/4 width) variants for HASSLE."""

import torch

from silo_core.models import ModelSpec, WideResNet, count_parameters

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
