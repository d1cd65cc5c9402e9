"""model.init_weights / init_from_run: a file's weights into a freshly built model, with a report of what loaded,
the classifier re-initialised for another class count, a 3-channel stem summed for 1-channel images, and a refusal
naming the tensor for any other shape. Only the hub half reads the weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from silo_core.algorithms import ALGORITHMS
from silo_core.algorithms.base import HubData
from silo_core.models import ModelSpec, load_weights, read_run_weights, read_weights
from silo_server.state.checkpoint import write_model

RESNET = ModelSpec("torchvision/resnet18", num_classes=10, in_channels=3, image_size=32)


class Payload:  # anything but tensors and plain containers: weights_only must refuse to unpickle it
    pass


def _built(spec: ModelSpec, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return spec.build()


def _state(spec: ModelSpec, seed: int = 1) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _built(spec, seed).state_dict().items()}


def _assert_holds(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_a_safetensors_file_loads_every_tensor(tmp_path):
    weights = _state(RESNET)
    save_file(weights, str(tmp_path / "w.safetensors"))
    model = _built(RESNET, seed=2)
    report = load_weights(model, read_weights(tmp_path / "w.safetensors"), RESNET.num_classes)
    _assert_holds(model, weights)
    assert len(report.loaded) == len(weights) and not (report.missing or report.unexpected or report.head)
    assert f"{len(weights)} of {len(weights)} tensors loaded" in report.summary()


def test_a_training_checkpoint_with_a_nested_state_dict_and_dataparallel_prefixes_loads(tmp_path):
    weights = _state(RESNET)
    checkpoint = {"epoch": 90, "arch": "resnet18", "best_acc1": torch.tensor(69.8),
                  "state_dict": {f"module.{k}": v for k, v in weights.items()}, "optimizer": {"state": {}}}
    torch.save(checkpoint, tmp_path / "checkpoint.pth.tar")
    model = _built(RESNET, seed=2)
    report = load_weights(model, read_weights(tmp_path / "checkpoint.pth.tar"), RESNET.num_classes)
    _assert_holds(model, weights)
    assert not report.unexpected


def test_a_checkpoint_that_needs_unpickling_code_is_refused(tmp_path):
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}, "extra": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="weights_only=True"):
        read_weights(tmp_path / "evil.pt")
    (tmp_path / "junk.bin").write_bytes(b"not weights at all")
    with pytest.raises(ValueError, match="junk.bin is not a safetensors file"):
        read_weights(tmp_path / "junk.bin")


def test_a_three_channel_stem_is_summed_over_colour_for_one_channel_images():
    weights = _state(RESNET)
    gray = ModelSpec(RESNET.name, num_classes=10, in_channels=1, image_size=32)
    model = gray.build()
    report = load_weights(model, weights, gray.num_classes)
    assert torch.equal(model.conv1.weight, weights["conv1.weight"].sum(dim=1, keepdim=True))
    assert report.summed_stem == ["conv1.weight"]
    assert "conv1.weight summed over 3 colour channels" in report.summary()
    assert torch.equal(model.fc.weight, weights["fc.weight"])


def test_another_class_count_re_initialises_the_classifier_and_says_so():
    imagenet = _state(ModelSpec(RESNET.name, num_classes=1000, in_channels=3, image_size=32))
    seven = ModelSpec(RESNET.name, num_classes=7, in_channels=3, image_size=32)
    model = seven.build()
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = load_weights(model, imagenet, seven.num_classes)
    assert sorted(report.head) == ["fc.bias", "fc.weight"]
    assert torch.equal(model.fc.weight, fresh["fc.weight"]) and torch.equal(model.fc.bias, fresh["fc.bias"])
    assert torch.equal(model.layer4[1].conv2.weight, imagenet["layer4.1.conv2.weight"])
    assert "re-initialised (1000 classes in the file, 7 here)" in report.summary()


def test_another_shape_elsewhere_is_refused_naming_the_tensor():
    weights = _state(RESNET)
    weights["layer2.0.conv1.weight"] = torch.zeros(128, 64, 5, 5)
    with pytest.raises(ValueError, match=r"layer2\.0\.conv1\.weight has shape \(128, 64, 5, 5\) in the file but "
                                         r"\(128, 64, 3, 3\) in model"):
        load_weights(RESNET.build(), weights, RESNET.num_classes)


def test_missing_and_unexpected_tensors_are_listed_and_a_file_of_another_network_is_refused():
    weights = _state(RESNET)
    del weights["layer4.1.conv2.weight"], weights["bn1.running_mean"]
    weights["aux.weight"] = torch.zeros(3)
    report = load_weights(RESNET.build(), weights, RESNET.num_classes)
    assert report.missing == ["bn1.running_mean", "layer4.1.conv2.weight"]
    assert report.missing_weights == ["layer4.1.conv2.weight"] and report.unexpected == ["aux.weight"]
    assert report.worrying
    lines = report.lines()
    assert "2 missing (1 BN statistics, recomputed)" in lines[0]
    assert "layer4.1.conv2.weight" in lines[1] and "aux.weight" in lines[2]
    small = _state(ModelSpec(options={"width": 4}))
    with pytest.raises(ValueError, match="no tensor name matches"):
        load_weights(RESNET.build(), small, RESNET.num_classes)


def test_init_from_run_reads_an_earlier_runs_model_and_checks_its_card(tmp_path):
    spec = ModelSpec(options={"width": 4})
    trained = _built(spec, seed=3)
    write_model(tmp_path / "model.safetensors", trained)
    card = {"model": {"name": spec.name, "in_channels": 1, "num_classes": 10}}
    (tmp_path / "model_card.json").write_text(json.dumps(card))
    model = spec.build()
    load_weights(model, read_run_weights(tmp_path, spec), spec.num_classes)
    _assert_holds(model, trained.state_dict())
    other = ModelSpec(num_classes=7, options={"width": 4})
    with pytest.raises(ValueError, match="num_classes 10 there, 7 here.*model.init_weights"):
        read_run_weights(tmp_path, other)
    # Group norm's weights have batch norm's shapes: the card's options.norm tells them apart, both ways.
    with pytest.raises(ValueError, match="options.norm 'batch' there, 'group' here"):
        read_run_weights(tmp_path, ModelSpec(options={"width": 4, "norm": "group"}))
    card["model"]["options"] = {"width": 4, "norm": "group"}
    (tmp_path / "model_card.json").write_text(json.dumps(card))
    with pytest.raises(ValueError, match="options.norm 'group' there, 'batch' here"):
        read_run_weights(tmp_path, spec)
    # A HASSLE run serves four networks under their own prefixes: said as such, not as "no tensor name matches"
    card["model"]["options"] = {"width": 4}
    (tmp_path / "model_card.json").write_text(json.dumps({**card, "algorithm": "hassle"}))
    with pytest.raises(ValueError, match="is a HASSLE run.*dual ensemble of four networks"):
        read_run_weights(tmp_path, spec)


# Each algorithm with no hub training before round 1, so its starting model is exactly what it loaded.
NO_WARMUP = {"semifl": {"init_epochs": 0}, "server-only": {"init_epochs": 0}, "fedseal": {"init_epochs": 0},
             "hassle": {"hub_warmup_epochs": 0}, "fedavg-fixmatch": {"init_epochs": 0}, "supervised": {"init_epochs": 0}}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_the_hub_half_starts_from_the_initial_weights(algorithm):
    spec = ModelSpec(options={"width": 4})
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8, generator=g)
    data = HubData(images, torch.arange(20) % 10, images, torch.arange(20) % 10)  # FedSEAL needs a validation split
    entry = ALGORITHMS[algorithm]

    def hub():
        return entry.hub(entry.options(**NO_WARMUP[algorithm]), spec, data, torch.device("cpu"), seed=0,
                         total_rounds=2)

    weights = _state(spec, seed=7)
    started = hub()
    started.initial_weights = weights
    state, fresh = started.init_state(), hub().init_state()
    prefixes = ("S/", "U/") if algorithm == "hassle" else ("model/",)
    for prefix in prefixes:
        for name, _ in spec.build().named_parameters():  # BN statistics are recomputed from the hub's data
            assert torch.equal(state.tensors[prefix + name], weights[name]), prefix + name
        assert not torch.equal(fresh.tensors[prefix + "classifier.weight"], weights["classifier.weight"])


def test_every_head_of_a_two_headed_classifier_is_the_classifier():
    # A distilled DeiT has `head` and `head_dist`, both giving the classes: an ImageNet file into a 2-class model once
    # stopped the hub at `head` ("another architecture's") because only the last of the two was taken for the head.
    pytest.importorskip("timm")
    spec = ModelSpec("timm/deit_tiny_distilled_patch16_224", num_classes=2, in_channels=3, image_size=224)
    imagenet = ModelSpec(spec.name, num_classes=1000, in_channels=3, image_size=224).build().state_dict()
    report = load_weights(spec.build(), imagenet, 2, "imagenet.safetensors")
    assert {n.split(".")[0] for n in report.head} == {"head", "head_dist"} and report.head_classes == (1000, 2)


def test_hassles_residual_starts_at_zero_output_whatever_its_classifier():
    # squeezenet's classifier is a convolution: zeroing "the last Linear" found none and the hub crashed at start.
    from silo_core.algorithms.hassle import zero_output

    model = zero_output(ModelSpec("torchvision/squeezenet1_1", num_classes=3, in_channels=1, image_size=64).build(), 3)
    assert torch.count_nonzero(model.eval()(torch.randn(2, 1, 64, 64))) == 0
