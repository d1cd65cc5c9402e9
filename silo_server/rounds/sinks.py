"""Where a completed round's record goes: one small interface for every consumer of the typed RoundRecord.

    class RoundSink(Protocol):
        def round_done(self, record: RoundRecord) -> None   # once the round's checkpoint is written
        def attempt_failed(self, failed: FailedAttempt) -> None  # an attempt that will be retried (below quorum, ...)
        def close(self) -> None                              # the run is over (or the hub stops)

The round loop (silo_server/rounds/round_loop.py, RoundLoop.sinks) hands each record to its sinks in order:

    HistoryFile     history.json: what silo-sim's summary, the benchmarks and an operator read while the run goes on
    HubMetrics      Prometheus (silo_server/metrics.py), when hub.yaml metrics.enabled
    TensorBoardSink run.tensorboard: the curves where ML users look for them (torch's own SummaryWriter)
    CallbackSink    the caller's own function (Hub(on_round=...), the in-process benchmarks)

A new consumer is one class with these three methods, appended to RoundLoop.sinks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from silo_core.rounds import RoundRecord, Scores

log = logging.getLogger("silo_server")


@dataclass(frozen=True)
class FailedAttempt:
    """A round attempt that failed and will be retried: which, why, and the sampled silos that had not reported
    (or left the secure-aggregation protocol) when it closed."""

    round: int
    attempt: int
    reason: str
    left_out: tuple[str, ...]


class RoundSink(Protocol):
    def round_done(self, record: RoundRecord) -> None: ...

    def attempt_failed(self, failed: FailedAttempt) -> None: ...

    def close(self) -> None: ...


class HistoryFile:
    """history.json in the hub's state folder (RunRecords.write_history): the run's rounds as their flat JSON."""

    def __init__(self, records: Any):
        self.records = records  # silo_server/state/scoring.py RunRecords

    def round_done(self, record: RoundRecord) -> None:
        self.records.write_history()

    def attempt_failed(self, failed: FailedAttempt) -> None:
        pass  # a failed attempt changes no record

    def close(self) -> None:
        pass


class CallbackSink:
    """A plain function of the record (Hub(on_round=...)): tests, tools and the in-process benchmarks."""

    def __init__(self, callback: Callable[[RoundRecord], None]):
        self.callback = callback

    def round_done(self, record: RoundRecord) -> None:
        self.callback(record)

    def attempt_failed(self, failed: FailedAttempt) -> None:
        pass  # a failed attempt changes no record

    def close(self) -> None:
        pass


# The scalars a round writes, by TensorBoard tag: the record's typed fields (None: not measured this round).
TENSORBOARD_SCALARS: dict[str, Callable[[RoundRecord], float | None]] = {
    "accuracy/test": lambda r: r.scores.test_accuracy,
    "accuracy/validation": lambda r: r.scores.validation_accuracy,
    "loss/test": lambda r: r.scores.test_loss,
    "loss/silo_train": lambda r: r.silo_train_loss,
    "pseudo_labels/ratio": lambda r: r.pseudo_label_ratio,
    "pseudo_labels/accuracy": lambda r: r.pseudo_label_accuracy,
    "privacy/epsilon": lambda r: r.dp.epsilon if r.dp is not None else None,
    "wire/bytes_up": lambda r: r.bytes_up,
    "wire/bytes_down": lambda r: r.bytes_down,
    "silos/reported": lambda r: r.silos_reported,
    "time/round_seconds": lambda r: r.round_seconds,
}


class TensorBoardSink:
    """hub.yaml run.tensorboard: one event file per run in DIR/<run id>, written with torch's SummaryWriter (the
    `tensorboard` extra). Step 0 is the initial model (the hub's labels alone), then one step per round: the
    scalars above, and every metric the algorithm reports under algorithm/<name> (hub loss, thresholds, ...)."""

    def __init__(self, folder: Path, initial: Callable[[], Scores] | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise ValueError(f"run.tensorboard needs the tensorboard package ({err}): pip install "
                             "\"silokit[tensorboard]\", or remove run.tensorboard from hub.yaml") from None
        self.folder = Path(folder)
        self.writer = SummaryWriter(log_dir=str(self.folder))
        self.initial = initial
        self.wrote_initial = False
        log.info("TensorBoard: the run's curves in %s (tensorboard --logdir %s)", self.folder, self.folder.parent)

    def round_done(self, record: RoundRecord) -> None:
        if not self.wrote_initial and self.initial is not None:
            scores = self.initial()
            for tag, value in (("accuracy/test", scores.test_accuracy), ("loss/test", scores.test_loss),
                               ("accuracy/validation", scores.validation_accuracy)):
                if value is not None:
                    self.writer.add_scalar(tag, value, 0)
            self.wrote_initial = True
        for tag, read in TENSORBOARD_SCALARS.items():
            value = read(record)
            if value is not None:
                self.writer.add_scalar(tag, float(value), record.round)
        for name, value in sorted(record.algorithm.items()):
            self.writer.add_scalar(f"algorithm/{name}", float(value), record.round)
        self.writer.flush()

    def attempt_failed(self, failed: FailedAttempt) -> None:
        pass  # a failed attempt changes no record

    def close(self) -> None:
        self.writer.close()
