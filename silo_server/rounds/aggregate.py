"""Streaming aggregation: each accepted result is added into running sums and dropped at once, and at most a fixed
number of bytes of uploads are held at any moment, so the hub's memory does not grow with the number of reporting
silos."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping

import torch


class RunningSum:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.metrics: dict[str, float] = {}
        self.metric_counts: dict[str, int] = {}  # how many results carried each metric (a branch may send none)
        self.contributors = 0

    def add(self, tensors: Mapping[str, torch.Tensor], metrics: Mapping[str, float]) -> None:
        for name, t in tensors.items():
            # float64 accumulation: a sum over hundreds of silos must not lose the small deltas.
            value = t.to(torch.float64) if t.is_floating_point() else t
            if name in self.tensors:
                self.tensors[name] += value
            else:
                self.tensors[name] = value.clone()
        self.add_metrics(metrics, contributed=bool(tensors))

    def add_metrics(self, metrics: Mapping[str, float], contributed: bool) -> None:
        """A result whose tensors are kept elsewhere (a robust rule's update file): only its metrics are summed."""
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + float(value)
            self.metric_counts[key] = self.metric_counts.get(key, 0) + 1
        if contributed:
            self.contributors += 1

    def mean(self, key: str) -> float | None:
        """A metric's mean over the results that carried it; None when none did (a branch whose policy keeps its
        clear metrics sends none, and must not pull the mean towards zero)."""
        count = self.metric_counts.get(key, 0)
        return self.metrics[key] / count if count else None

    def result(self) -> dict[str, torch.Tensor]:
        """The sums, still in float64: the algorithm divides them by the summed weight, and a float32 sum would let
        one large term swallow the others' contributions before that."""
        return dict(self.tensors)


class UploadBudget:
    """Admits uploads while the bytes held (received, decoded, checked, not yet summed) stay within ``limit``.

    Without it a hundred silos finishing together are a hundred payloads in memory at once. An upload larger than
    the whole budget is admitted when nothing else is held, so no valid upload waits forever.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"the upload budget must be positive, got {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, size: int, still_wanted: Callable[[], bool] = lambda: True) -> Iterator[None]:
        """Wait for room for ``size`` bytes, hold them for the block. Stops waiting once ``still_wanted()`` is
        false (the round closed): the caller then refuses the upload on its first chunk."""
        with self._cond:
            while self.held and self.held + size > self.limit and still_wanted():
                self._cond.wait(timeout=0.5)
            self.held += size
            self.peak = max(self.peak, self.held)
        try:
            yield
        finally:
            with self._cond:
                self.held -= size
                self._cond.notify_all()
