"""The one shape every loader returns: ``ImageSet``, N images at the model's size and channel count (in memory
or as ``ImageFiles``), their labels and class names, and the files skipped on the way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from silo_core.data.lazy import ImageFiles


@dataclass
class ImageSet:
    images: torch.Tensor | ImageFiles  # uint8 N x C x H x W in memory, or files decoded batch by batch
    labels: torch.Tensor | None  # int64 [N], None for unlabeled data
    classes: list[str]  # class names, index = label; [] for unlabeled data
    # (path, reason) of files skipped when the folder was loaded; files found unreadable later, while training on
    # an ImageFiles, are in images.skipped
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.images, ImageFiles):
            pass  # its shape and dtype are right by construction
        elif self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise ValueError(f"ImageSet.images must be uint8 N x C x H x W, got {self.images.dtype} "
                             f"{tuple(self.images.shape)}")
        if self.labels is not None and tuple(self.labels.shape) != (len(self.images),):
            raise ValueError(f"ImageSet.labels must have shape [{len(self.images)}], got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def subset(self, idx: Sequence[int] | np.ndarray | torch.Tensor) -> ImageSet:
        """The images at ``idx`` (integer indices in the given order, or a boolean mask)."""
        if isinstance(idx, torch.Tensor):
            index = idx if idx.dtype == torch.bool else idx.long()
        else:
            arr = np.asarray(idx)
            index = torch.from_numpy(arr) if arr.dtype == np.bool_ else torch.as_tensor(arr.astype(np.int64))
        labels = self.labels[index] if self.labels is not None else None
        return ImageSet(self.images[index], labels, list(self.classes), list(self.skipped))
