import torch
from torch import nn

from silo_core.models import ModelSpec, SmallCNN, WideResNet, count_parameters
from silo_core.sbn import apply_batchnorm_sums, batchnorm_layers, batchnorm_sums, compute_static_bn


def test_first_layer_statistics_equal_a_direct_computation():
    torch.manual_seed(0)
    model = SmallCNN(1, 10, width=8)
    data = torch.randn(50, 1, 28, 28)
    compute_static_bn(model, data.split(7))  # uneven batches on purpose: sums must not care
    with torch.no_grad():
        conv_out = model.features[0](data)  # input of the first BN layer over the whole set at once
    bn = model.features[1]
    assert torch.allclose(bn.running_mean, conv_out.mean(dim=(0, 2, 3)), atol=1e-5)
    assert torch.allclose(bn.running_var, conv_out.var(dim=(0, 2, 3), unbiased=False), atol=1e-5)


def test_every_layer_gets_stats_and_sums_add_across_sites():
    torch.manual_seed(1)
    model = SmallCNN(1, 10, width=8)
    a, b = torch.randn(20, 1, 28, 28), torch.randn(30, 1, 28, 28)
    sa, sb = batchnorm_sums(model, [a]), batchnorm_sums(model, [b])
    together = batchnorm_sums(model, [a, b])
    for key in together:
        assert torch.allclose(sa[key] + sb[key], together[key])
    apply_batchnorm_sums(model, together)
    for name, layer in batchnorm_layers(model).items():
        assert float(together[name + ".count"]) > 0
        assert layer.running_var.min() >= 0


def test_eval_mode_uses_the_static_statistics():
    torch.manual_seed(2)
    model = SmallCNN(1, 10, width=8)
    data = torch.randn(40, 1, 28, 28)
    compute_static_bn(model, [data])
    model.eval()
    with torch.no_grad():
        one = model(data[:1])
        batch = model(data)[:1]
    assert torch.allclose(one, batch, atol=1e-5)  # no batch dependence in eval mode


def test_wrn28_2_has_the_papers_size_and_static_bn():
    model = WideResNet(3, 10, depth=28, widen=2)
    assert 1.4e6 < count_parameters(model) < 1.6e6
    assert all(layer.momentum is None for layer in batchnorm_layers(model).values())
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_model_spec_builds_known_models_only():
    assert isinstance(ModelSpec(name="small_cnn").build(), nn.Module)
    try:
        ModelSpec(name="resnet9000").build()
    except ValueError as err:
        assert "unknown model" in str(err)
    else:
        raise AssertionError("unknown model accepted")
