"""The CUDA path (bfloat16 autocast, channels_last, pinned batches): a silo update and an evaluation on the GPU agree
with the CPU's within a loose tolerance. The GPU tests are marked `gpu` and skip cleanly without CUDA; the CPU tests
here pin that the CPU path never takes any of it."""

import contextlib
from pathlib import Path

import pydantic
import pytest
import torch

from silo_core.algorithms import ALGORITHMS
from silo_core.algorithms.base import HubData, RoundPlan, SiloData, model_tensors
from silo_core.algorithms.semifl import SemiFLOptions, SemiFLSilo
from silo_core.augment import strong_augment, weak_augment
from silo_core.data import load_labeled_folder, load_unlabeled_folder
from silo_core.models import ModelSpec
from silo_core.training import (
    AUGMENT_ON_CPU_MAX_VALUES,
    augmentation_batch,
    autocast,
    evaluate,
    on_device,
    pinned,
)
from tests.silo_core.test_lazy_data import write_folder

SIZE = 32
SPEC = ModelSpec(num_classes=3, in_channels=3, image_size=SIZE, mean=[0.5] * 3, std=[0.5] * 3, options={"width": 8})
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=[pytest.mark.gpu, needs_cuda], id="cuda")]


def test_the_cpu_path_takes_no_autocast_no_channels_last_and_no_pinning():
    assert isinstance(autocast(CPU), contextlib.nullcontext)
    assert not pinned(CPU)
    model = on_device(SPEC.build(), CPU)
    assert all(p.is_contiguous() for p in model.parameters())


def test_small_images_are_augmented_on_the_cpu_and_big_ones_on_the_training_device():
    # The meta device stands in for a GPU: a batch "moved" there has no data, only its device.
    meta = torch.device("meta")
    mnist, cifar = torch.zeros(32, 1, 28, 28, dtype=torch.uint8), torch.zeros(32, 3, 32, 32, dtype=torch.uint8)
    at_64 = torch.zeros(4, 3, 64, 64, dtype=torch.uint8)
    assert at_64[0].numel() == AUGMENT_ON_CPU_MAX_VALUES
    for small in (mnist, cifar, at_64, torch.zeros(0, 3, 224, 224, dtype=torch.uint8)):
        assert augmentation_batch(small, meta) is small
    for big in (torch.zeros(4, 3, 65, 64, dtype=torch.uint8), torch.zeros(2, 3, 224, 224, dtype=torch.uint8)):
        assert augmentation_batch(big, meta).device == meta
    assert augmentation_batch(at_64, CPU) is at_64


def semifl_update(images, device: torch.device, spec: ModelSpec = SPEC, **options) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    plan = RoundPlan(round=1, tensors=model_tensors(spec.build()), hyperparameters={"lr": 0.02, "seed": 1},
                     expected={})
    options = SemiFLOptions(**{"tau": 0.0, "local_epochs": 1, "silo_batch_size": 8, "randaugment_ops": 0,
                               "cutout": 0.0, **options})
    result = SemiFLSilo(options, spec, device).local_update(plan, SiloData(images=images, silo_id="s"))
    assert not result.skipped and result.metrics["pl_total"] == len(images)
    return result.tensors


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    x = torch.cat([a[k].flatten().double() for k in sorted(a)])
    y = torch.cat([b[k].flatten().double() for k in sorted(b)])
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.gpu
@needs_cuda
def test_a_semifl_update_on_cuda_agrees_with_the_cpu(tmp_path: Path):
    write_folder(tmp_path / "u", 48)
    memory = load_unlabeled_folder(tmp_path / "u", SIZE, 3)
    lazy = load_unlabeled_folder(tmp_path / "u", SIZE, 3, cache_mb=0, workers=2)  # pinned batches from workers
    cuda = torch.device("cuda")
    on_cpu = semifl_update(memory.images, CPU)
    on_gpu = semifl_update(memory.images, cuda)
    from_files = semifl_update(lazy.images, cuda)
    for tensors in (on_gpu, from_files):
        assert tensors.keys() == on_cpu.keys()
        assert all(t.device.type == "cpu" and t.is_contiguous() and torch.isfinite(t).all() for t in tensors.values())
        # bfloat16 and GPU kernels change the numbers a little, not the direction of the update.
        assert cosine(tensors, on_cpu) > 0.8


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(16, 1, 28, 28), (16, 3, 96, 96)])
def test_the_augmentations_give_the_same_pixels_on_cuda_as_on_the_cpu(shape):
    # Whichever side augments (training.augmentation_batch), a seed must give the same views.
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    views = {}
    for device in (CPU, torch.device("cuda")):
        gen = torch.Generator().manual_seed(1)
        views[device.type] = [strong_augment(x.to(device), generator=gen).cpu(),
                              weak_augment(x.to(device), generator=gen).cpu()]
    for on_cpu, on_gpu in zip(views["cpu"], views["cuda"], strict=True):
        # Nearest-neighbour warps may pick the other pixel where a coordinate lands on a pixel's edge.
        assert (on_cpu != on_gpu).float().mean() < 0.01


@pytest.mark.gpu
@needs_cuda
def test_a_semifl_update_with_randaugment_on_cuda_agrees_with_the_cpu_for_images_augmented_on_the_gpu(tmp_path: Path):
    size = 72  # above training.AUGMENT_ON_CPU_MAX_VALUES: these batches are augmented on the GPU
    spec = ModelSpec(num_classes=3, in_channels=3, image_size=size, mean=[0.5] * 3, std=[0.5] * 3,
                     options={"width": 8})
    write_folder(tmp_path / "u", 32)
    images = load_unlabeled_folder(tmp_path / "u", size, 3).images
    on_cpu = semifl_update(images, CPU, spec, randaugment_ops=2, cutout=0.5)
    on_gpu = semifl_update(images, torch.device("cuda"), spec, randaugment_ops=2, cutout=0.5)
    assert all(torch.isfinite(t).all() for t in on_gpu.values())
    assert cosine(on_gpu, on_cpu) > 0.8


@pytest.mark.gpu
@needs_cuda
def test_evaluation_on_cuda_agrees_with_the_cpu(tmp_path: Path):
    write_folder(tmp_path / "l", 60, classes=3)
    test = load_labeled_folder(tmp_path / "l", SIZE, 3)
    torch.manual_seed(0)
    model = SPEC.build().eval()
    on_cpu = evaluate(model, test.images, test.labels, SPEC.mean, SPEC.std, CPU)
    on_gpu = evaluate(model, test.images, test.labels, SPEC.mean, SPEC.std, torch.device("cuda"))
    assert all(torch.isfinite(torch.tensor(v)) for v in on_gpu.values())
    assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=0.05)
    assert abs(on_gpu["accuracy"] - on_cpu["accuracy"]) <= 0.1


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: str(d))
@pytest.mark.parametrize("method", sorted(ALGORITHMS))
def test_every_hub_keeps_its_state_on_the_cpu_whatever_device_it_trains_on(method: str, device: torch.device):
    # The sums arrive on the CPU (decoded from the wire) and the state is checkpointed and sent from there: a hub
    # that trained on CUDA once left SemiFL's server momentum on the GPU, and round 1 failed on mixed devices.
    entry = ALGORITHMS[method]
    spec = ModelSpec(num_classes=3, in_channels=1, image_size=28, options={"width": 4})
    images, labels = torch.randint(0, 255, (12, 1, 28, 28), dtype=torch.uint8), torch.arange(12) % 3
    fields = entry.options.model_fields
    for epochs in (1, 0):  # 0: no hub training at all, so nothing moved the model to the device before static BN
        chosen = {k: epochs for k in ("hub_epochs", "init_epochs", "hub_warmup_epochs") if k in fields}
        try:
            options = entry.options.model_validate(chosen)
        except pydantic.ValidationError:
            assert epochs == 0 and method == "hassle"  # HASSLE's hub always trains (hub_epochs >= 1)
            continue
        hub = entry.hub(options, spec, HubData(images, labels, images, labels), device, 0, 2)
        state = hub.init_state()
        plan = hub.begin_round(state)
        sums = {n: torch.zeros(want.shape, dtype=getattr(torch, want.dtype)) for n, want in plan.expected.items()}
        sums.update({name: torch.ones(1) for name in sums if name.endswith("weight")})
        after, _ = hub.finish_round(state, sums, {})
        assert after.round == 1
        for tensors in (state.tensors, after.tensors):
            assert {t.device.type for t in tensors.values()} == {"cpu"}
            assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # torch.autocast("cuda") made on a machine without one
@pytest.mark.parametrize(("capability", "bf16"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_bfloat16_autocast_only_on_a_gpu_that_has_it_in_hardware(monkeypatch, capability, bf16):
    # torch.cuda.is_bf16_supported() counts emulation and says yes on a V100 or T4, where bfloat16 is slower than
    # float32; the device's own compute capability decides (Ampere is 8.x).
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    context = autocast(torch.device("cuda", 1))
    assert isinstance(context, torch.autocast) == bf16
    assert asked == [torch.device("cuda", 1)]  # the device given, not the current one
