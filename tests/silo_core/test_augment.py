import math

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from silo_core.augment import FILL, OPS, apply_ops, cutout, strong_augment, to_float, weak_augment


def images(n: int, c: int, size: int, seed: int = 0) -> torch.Tensor:
    """Smooth random images (upsampled noise), closer to photos than white noise."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand(n, c, size // 4, size // 4, generator=g) * 255
    return F.interpolate(small, size=(size, size), mode="bilinear", align_corners=False).round().to(torch.uint8)


SHAPES = [(16, 1, 28), (16, 3, 32)]


@pytest.mark.parametrize("n,c,size", SHAPES)
def test_shape_and_dtype_kept(n, c, size):
    x = images(n, c, size)
    for out in (weak_augment(x), strong_augment(x), weak_augment(x, flip=False, pad=0)):
        assert out.shape == x.shape and out.dtype == torch.uint8
    assert weak_augment(x[:0]).shape == (0, c, size, size)
    assert strong_augment(x[:0]).shape == (0, c, size, size)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8"):
        weak_augment(torch.zeros(2, 1, 28, 28))
    with pytest.raises(ValueError, match="channels"):
        strong_augment(torch.zeros(2, 2, 28, 28, dtype=torch.uint8))
    with pytest.raises(ValueError, match="magnitude"):
        strong_augment(torch.zeros(2, 1, 28, 28, dtype=torch.uint8), magnitude=31)


def test_weak_output_is_a_window_of_the_reflect_padded_image():
    x = images(24, 3, 32, seed=1)
    g = torch.Generator().manual_seed(0)
    out = weak_augment(x, flip=True, pad=4, generator=g)
    padded = F.pad(x, (4, 4, 4, 4), mode="reflect")
    for i in range(len(x)):
        candidates = [padded[i], padded[i].flip(-1)]  # a flip of the padded image = pad of the flipped image
        found = any(torch.equal(out[i], p[:, dy : dy + 32, dx : dx + 32])
                    for p in candidates for dy in range(9) for dx in range(9))
        assert found, f"image {i} is not a shifted (and maybe mirrored) crop"
    # a constant image stays exactly constant: reflect padding introduces no border colour
    const = torch.full((8, 1, 28, 28), 77, dtype=torch.uint8)
    assert bool((weak_augment(const, generator=g) == 77).all())
    assert torch.equal(weak_augment(x, flip=False, pad=0), x)


def test_weak_flips_about_half_and_no_flip_flag():
    x = images(400, 1, 28, seed=2)
    out = weak_augment(x, flip=True, pad=0, generator=torch.Generator().manual_seed(0))
    flipped = (out != x).flatten(1).any(1).float().mean().item()
    assert 0.4 < flipped < 0.6
    assert torch.equal(weak_augment(x, flip=False, pad=0), x)


@pytest.mark.parametrize("fn", [weak_augment, strong_augment])
def test_reproducible_with_generator_and_random_per_image(fn):
    x = images(1, 1, 28).expand(32, 1, 28, 28).contiguous()  # 32 copies of one image
    a = fn(x, generator=torch.Generator().manual_seed(5))
    b = fn(x, generator=torch.Generator().manual_seed(5))
    c = fn(x, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    distinct = len({bytes(img.numpy().tobytes()) for img in a})
    assert distinct >= 25, "each image draws its own augmentation"


def test_strong_ops_are_chosen_per_image():
    # with cutout off, num_ops=1 and no weak step, the images that changed must show several different ops
    x = images(1, 3, 32).expand(200, 3, 32, 32).contiguous()
    out = strong_augment(x, num_ops=1, magnitude=10, cutout=0.0, flip=False,
                         generator=torch.Generator().manual_seed(1))
    changed = (out.int() - out[:1].int()).abs().flatten(1).sum(1) > 0
    assert 0.5 < changed.float().mean().item() < 1.0  # some images drew another op than the first one


def test_cutout_is_one_gray_square_of_the_right_size():
    x = torch.full((64, 3, 28, 28), 200, dtype=torch.uint8)
    out = cutout(x, 0.5, generator=torch.Generator().manual_seed(0))
    gray = out[:, 0] == FILL
    assert bool((out[:, 0] == out[:, 1]).all() and (out[:, 1] == out[:, 2]).all())
    area = gray.flatten(1).sum(1)
    # side 14, centred anywhere: between a 7x7 corner piece and the full 14x14 square
    assert int(area.min()) >= 49 and int(area.max()) == 196
    rows, cols = gray.any(2).sum(1), gray.any(1).sum(1)
    assert torch.equal(area, rows * cols), "the gray region is a rectangle"
    assert torch.equal(cutout(x, 0.0), x)


def reference(name: str, x: torch.Tensor, sign: float, m: int) -> torch.Tensor:
    """torchvision's RandAugment op with our fill, for comparison."""
    frac = m / 30
    h, w = x.shape[-2:]
    if name == "ShearX":
        return TF.affine(x, angle=0.0, translate=[0, 0], scale=1.0, shear=[math.degrees(math.atan(sign * 0.3 * frac)), 0.0],
                         fill=FILL, center=[0, 0])
    if name == "ShearY":
        return TF.affine(x, angle=0.0, translate=[0, 0], scale=1.0, shear=[0.0, math.degrees(math.atan(sign * 0.3 * frac))],
                         fill=FILL, center=[0, 0])
    if name == "TranslateX":
        return TF.affine(x, angle=0.0, translate=[int(sign * 150 / 331 * w * frac), 0], scale=1.0, shear=[0.0, 0.0],
                         fill=FILL)
    if name == "TranslateY":
        return TF.affine(x, angle=0.0, translate=[0, int(sign * 150 / 331 * h * frac)], scale=1.0, shear=[0.0, 0.0],
                         fill=FILL)
    if name == "Rotate":
        return TF.rotate(x, sign * 30 * frac, fill=FILL)
    factor = 1 + sign * 0.9 * frac
    return {
        "Identity": lambda: x,
        "Brightness": lambda: TF.adjust_brightness(x, factor),
        "Color": lambda: TF.adjust_saturation(x, factor),
        "Contrast": lambda: TF.adjust_contrast(x, factor),
        "Sharpness": lambda: TF.adjust_sharpness(x, factor),
        "Posterize": lambda: TF.posterize(x, int(round(8 - 4 * frac))),
        "Solarize": lambda: TF.solarize(x, 255 * (1 - frac)),
        "AutoContrast": lambda: TF.autocontrast(x),
        "Equalize": lambda: TF.equalize(x),
    }[name]()


@pytest.mark.parametrize("c,size", [(1, 28), (3, 32)])
@pytest.mark.parametrize("m", [10, 30])
def test_each_op_matches_torchvision(c, size, m):
    x = images(6, c, size, seed=3)
    for name in OPS:
        for sign in (1.0, -1.0):
            ours = apply_ops(x, torch.full((6,), OPS.index(name)), torch.full((6,), sign), m)
            diff = (ours.int() - reference(name, x, sign, m).int()).abs()
            assert int(diff.max()) <= 1, f"{name} sign {sign}: max difference {int(diff.max())}"
            if name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Posterize", "Solarize"):
                assert int(diff.max()) == 0, f"{name} should match exactly"


def test_translate_is_scaled_to_the_image_not_imagenet():
    # magnitude 10 of 30 -> int(150/331 * 28 / 3) = 4 pixels on a 28 px image (ImageNet constants would blank it)
    x = images(2, 1, 28, seed=4)
    out = apply_ops(x, torch.full((2,), OPS.index("TranslateX")), torch.tensor([1.0, -1.0]), 10)
    assert torch.equal(out[0, :, :, 4:], x[0, :, :, :-4]) and bool((out[0, :, :, :4] == FILL).all())
    assert torch.equal(out[1, :, :, :-4], x[1, :, :, 4:]) and bool((out[1, :, :, -4:] == FILL).all())


def test_to_float_normalizes_per_channel():
    x = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).expand(2, 3, 1, 2)
    out = to_float(x, [0.5, 0.0, 0.5], [0.5, 1.0, 0.25])
    assert out.dtype == torch.float32 and out.shape == (2, 3, 1, 2)
    assert out[0, 0].flatten().tolist() == [-1.0, 1.0]
    assert out[0, 1].flatten().tolist() == [0.0, 1.0]
    assert out[0, 2].flatten().tolist() == [-2.0, 2.0]
    with pytest.raises(ValueError, match="one value per channel"):
        to_float(x, [0.5], [0.5])
