"""Weak and strong image augmentation on uint8 batches (N x C x H x W), vectorized for CPU speed.

Weak a(x): random horizontal flip + reflect-pad then random crop (FixMatch / SemiFL).
Strong A(x): a(x), then RandAugment (Cubuk et al. 2020) with torchvision's op set and magnitude scale
(``num_magnitude_bins=31``, so ``magnitude`` is in 0..30; translations are relative to the image size, so the
ops are correct for 28 px and 32 px images), then Cutout of one gray square.

Training loops call these on small batches thousands of times, so every image draws its own ops, signs and
offsets but the work is done per op group (all images that drew the same op) with tensor math, not per image.
Each op mirrors torchvision.transforms.v2.functional on uint8 (the unit tests compare them).
All randomness comes from ``generator`` when one is given (CPU generator), so results are reproducible.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

FILL = 127  # gray used for pixels that geometric ops and Cutout leave empty (FixMatch-style)
NUM_MAGNITUDE_BINS = 31  # torchvision's RandAugment scale: magnitude 0..30

OPS: tuple[str, ...] = (
    "Identity",
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Rotate",
    "Brightness",
    "Color",
    "Contrast",
    "Sharpness",
    "Posterize",
    "Solarize",
    "AutoContrast",
    "Equalize",
)


def _check_batch(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.ndim != 4:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"augmentation expects a uint8 tensor N x C x H x W, got {got}")
    if x.shape[1] not in (1, 3):
        raise ValueError(f"augmentation expects 1 or 3 channels, got {x.shape[1]}")


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # Draw on the CPU so a CPU generator works for GPU batches and results match across devices.
    return torch.rand(shape, generator=generator).to(device)


def _randint(high: int, shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=generator).to(device)


def weak_augment(
    x: torch.Tensor, flip: bool = True, pad: int = 4, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random horizontal flip (p=0.5 per image, if ``flip``) and reflect-pad ``pad`` + random crop to H x W."""
    _check_batch(x)
    n, c, h, w = x.shape
    if pad < 0 or pad >= min(h, w):
        raise ValueError(f"pad must be in [0, {min(h, w) - 1}] for {h}x{w} images, got {pad}")
    dev = x.device
    out = x
    if flip and n:
        do_flip = _rand((n,), generator, dev) < 0.5
        out = torch.where(do_flip[:, None, None, None], out.flip(-1), out)
    if pad == 0 or n == 0:
        return out.clone() if out is x else out
    padded = F.pad(out, (pad, pad, pad, pad), mode="reflect")
    oy = _randint(2 * pad + 1, (n,), generator, dev)
    ox = _randint(2 * pad + 1, (n,), generator, dev)
    rows = oy[:, None] + torch.arange(h, device=dev)  # n x h
    cols = ox[:, None] + torch.arange(w, device=dev)  # n x w
    # One gather for the whole batch: every image gets its own crop offset.
    bi = torch.arange(n, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return padded[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


# --- RandAugment ops: each takes a uint8 group (k x C x H x W), per-image signs (+1/-1) and magnitude/30 ----


@functools.lru_cache(maxsize=16)
def _base_grid(h: int, w: int, device: torch.device) -> torch.Tensor:
    """Homogeneous pixel-centre coordinates (x, y, 1) measured from the image centre, (h * w) x 3."""
    u = torch.arange(w, device=device, dtype=torch.float32) + 0.5 - w / 2
    v = torch.arange(h, device=device, dtype=torch.float32) + 0.5 - h / 2
    yy, xx = torch.meshgrid(v, u, indexing="ij")
    return torch.stack([xx.reshape(-1), yy.reshape(-1), torch.ones(h * w, device=device)], dim=1)


def _affine(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour warp; theta (k x 2 x 3) maps output to input pixel coordinates measured from the
    image centre (torchvision's convention), out-of-image pixels become FILL."""
    k, _, h, w = x.shape
    # One 2-D matmul for all images: several times faster than F.affine_grid or bmm for small batches on CPU.
    grid = (_base_grid(h, w, x.device) @ theta.reshape(2 * k, 3).T).view(h * w, k, 2).transpose(0, 1)
    grid = (grid * torch.tensor([2.0 / w, 2.0 / h], device=x.device)).view(k, h, w, 2)
    # Sampling (x - FILL) with zero padding and adding FILL back fills the outside with gray exactly.
    out = F.grid_sample(x.float() - FILL, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    return (out + FILL).round_().clamp_(0, 255).to(torch.uint8)


def _geometric(x: torch.Tensor, ops: list[int], signs: list[float], frac: float) -> torch.Tensor:
    """All five geometric ops in one warp, each image with its own inverse matrix (torchvision's matrices).

    The few numbers per image are built in plain Python: on CPU one small torch op costs more than the loop.
    """
    _, _, h, w = x.shape
    shear = 0.3 * frac
    # Translations are whole pixels, up to 150/331 of the side at magnitude 30 (int() truncates like torchvision).
    tx, ty = float(int(150.0 / 331.0 * w * frac)), float(int(150.0 / 331.0 * h * frac))
    angle = math.radians(30.0 * frac)
    rows = []
    for op, sign in zip(ops, signs, strict=True):
        name = OPS[op]
        if name == "ShearX":  # about the top-left corner (torchvision's RandAugment passes center=[0, 0])
            s = sign * shear
            rows.append([1.0, s, s * h / 2, 0.0, 1.0, 0.0])
        elif name == "ShearY":
            s = sign * shear
            rows.append([1.0, 0.0, 0.0, s, 1.0, s * w / 2])
        elif name == "TranslateX":
            rows.append([1.0, 0.0, -sign * tx, 0.0, 1.0, 0.0])
        elif name == "TranslateY":
            rows.append([1.0, 0.0, 0.0, 0.0, 1.0, -sign * ty])
        elif name == "Rotate":  # about the image centre
            c, sn = math.cos(sign * angle), math.sin(sign * angle)
            rows.append([c, -sn, 0.0, sn, c, 0.0])
        else:
            raise ValueError(f"{name} is not a geometric op")
    theta = torch.tensor(rows, dtype=torch.float32, device=x.device).view(-1, 2, 3)
    return _affine(x, theta)


def _gray(xf: torch.Tensor) -> torch.Tensor:
    """Luma of a float RGB batch, floored like torchvision does for uint8 input (k x 1 x H x W)."""
    r, g, b = xf[:, 0:1], xf[:, 1:2], xf[:, 2:3]
    return (0.2989 * r + 0.587 * g + 0.114 * b).floor_()


def _blend(xf: torch.Tensor, degenerate: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    f = factor[:, None, None, None]
    # Truncating cast, as torchvision's _blend does for uint8.
    return (xf * f + degenerate * (1.0 - f)).clamp_(0, 255).to(torch.uint8)


def _factor(sign: torch.Tensor, frac: float) -> torch.Tensor:
    return 1.0 + sign * 0.9 * frac


def _brightness(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    xf = x.float()
    return _blend(xf, torch.zeros_like(xf), _factor(sign, frac))


def _color(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    if x.shape[1] == 1:  # saturation of a gray image is a no-op
        return x
    xf = x.float()
    return _blend(xf, _gray(xf), _factor(sign, frac))


def _contrast(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    xf = x.float()
    gray = _gray(xf) if x.shape[1] == 3 else xf
    mean = gray.mean(dim=(1, 2, 3), keepdim=True)
    return _blend(xf, mean, _factor(sign, frac))


def _sharpness(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    k, c, h, w = x.shape
    if h <= 2 or w <= 2:
        return x
    xf = x.float()
    # PIL's SMOOTH kernel [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13 as a 3x3 box sum plus 4 x centre (faster than conv2d).
    box = F.avg_pool2d(xf, 3, stride=1) * 9.0
    blurred = ((box + 4.0 * xf[:, :, 1:-1, 1:-1]) / 13.0).round_()
    # The smoothed image only covers the interior; border pixels keep their values (PIL/torchvision behaviour).
    degenerate = xf.clone()
    degenerate[:, :, 1:-1, 1:-1] = blurred
    return _blend(xf, degenerate, _factor(sign, frac))


def _posterize(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    bits = int(round(8 - frac * 4))  # 8 bits at magnitude 0 down to 4 bits at magnitude 30
    mask = (0xFF << (8 - bits)) & 0xFF
    return x & mask


def _solarize(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    threshold = 255.0 * (1.0 - frac)
    return torch.where(x.float() >= threshold, 255 - x, x)


def _autocontrast(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    xf = x.float()
    lo = xf.amin(dim=(2, 3), keepdim=True)
    hi = xf.amax(dim=(2, 3), keepdim=True)
    flat = hi == lo  # constant channels stay as they are
    scale = torch.where(flat, torch.ones_like(hi), (hi - lo) / 255.0)
    lo = torch.where(flat, torch.zeros_like(lo), lo)
    return ((xf - lo) / scale).clamp_(0, 255).to(torch.uint8)


def _equalize(x: torch.Tensor, sign: torch.Tensor, frac: float) -> torch.Tensor:
    # Imported on first use: torchvision's package import pulls in its models and torch._dynamo (1.7 s), which a
    # hub or silo that never draws this op need not pay at every start.
    from torchvision.transforms.v2 import functional as TF

    return TF.equalize(x)  # torchvision's kernel is already batched


_PIXEL_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "Brightness": _brightness,
    "Color": _color,
    "Contrast": _contrast,
    "Sharpness": _sharpness,
    "Posterize": _posterize,
    "Solarize": _solarize,
    "AutoContrast": _autocontrast,
    "Equalize": _equalize,
}
_GEOMETRIC = tuple(OPS.index(n) for n in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"))


def apply_ops(x: torch.Tensor, op: torch.Tensor, sign: torch.Tensor, magnitude: int) -> torch.Tensor:
    """Apply op ``OPS[op[i]]`` with sign ``sign[i]`` to image i, grouped so that each op runs once per batch."""
    if not 0 <= magnitude < NUM_MAGNITUDE_BINS:
        raise ValueError(f"magnitude must be in 0..{NUM_MAGNITUDE_BINS - 1}, got {magnitude}")
    frac = magnitude / (NUM_MAGNITUDE_BINS - 1)
    # Group image indices by op in Python (cheap for small batches) so every op runs once on its group.
    op_list, sign_list = op.tolist(), sign.tolist()
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(op_list):
        groups.setdefault(k, []).append(i)
    geo = [i for k in _GEOMETRIC for i in groups.get(k, [])]
    out = x.clone()
    if geo:
        gi = torch.tensor(geo, device=x.device)
        out[gi] = _geometric(x[gi], [op_list[i] for i in geo], [sign_list[i] for i in geo], frac)
    for name, fn in _PIXEL_OPS.items():
        idx = groups.get(OPS.index(name))
        if idx:
            ii = torch.tensor(idx, device=x.device)
            out[ii] = fn(x[ii], sign[ii], frac)
    return out


def cutout(x: torch.Tensor, size: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    """One gray square of side ``size`` * H (x ``size`` * W) per image, centred anywhere, clipped at the edges."""
    _check_batch(x)
    n, _, h, w = x.shape
    sh, sw = int(round(size * h)), int(round(size * w))
    if sh <= 0 or sw <= 0 or n == 0:
        return x.clone()
    dev = x.device
    cy = _randint(h, (n,), generator, dev)
    cx = _randint(w, (n,), generator, dev)
    y0, x0 = cy - sh // 2, cx - sw // 2
    ys = torch.arange(h, device=dev)[None, :]
    xs = torch.arange(w, device=dev)[None, :]
    in_y = (ys >= y0[:, None]) & (ys < (y0 + sh)[:, None])  # n x h
    in_x = (xs >= x0[:, None]) & (xs < (x0 + sw)[:, None])  # n x w
    mask = in_y[:, None, :, None] & in_x[:, None, None, :]
    return x.masked_fill(mask, FILL)


def strong_augment(
    x: torch.Tensor,
    num_ops: int = 2,
    magnitude: int = 10,
    cutout: float = 0.5,
    flip: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Weak augmentation, then RandAugment(num_ops, magnitude) with per-image ops and signs, then Cutout."""
    _check_batch(x)
    if num_ops < 0:
        raise ValueError(f"num_ops must be >= 0, got {num_ops}")
    if not 0 <= magnitude < NUM_MAGNITUDE_BINS:
        raise ValueError(f"magnitude must be in 0..{NUM_MAGNITUDE_BINS - 1}, got {magnitude}")
    n = x.shape[0]
    out = weak_augment(x, flip=flip, pad=4, generator=generator)
    ops = _randint(len(OPS), (num_ops, n), generator, x.device)
    signs = torch.where(_rand((num_ops, n), generator, x.device) < 0.5, -1.0, 1.0)
    for j in range(num_ops):
        out = apply_ops(out, ops[j], signs[j], magnitude)
    return _cutout(out, cutout, generator)


_cutout = cutout  # strong_augment's ``cutout`` argument shadows the function name


def to_float(x: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """uint8 (N x) C x H x W -> float32 ``(x / 255 - mean) / std`` per channel."""
    c = x.shape[-3]
    if len(mean) != c or len(std) != c:
        raise ValueError(f"mean and std need one value per channel ({c}), got {len(mean)} and {len(std)}")
    if any(s <= 0 for s in std):
        raise ValueError(f"std values must be positive, got {std}")
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(c, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(c, 1, 1)
    return (x.float() / 255.0 - m) / s


__all__ = ["OPS", "FILL", "weak_augment", "strong_augment", "cutout", "apply_ops", "to_float"]
