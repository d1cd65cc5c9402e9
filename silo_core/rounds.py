"""One round's record: the numbers a completed round leaves behind, typed, for everything that reads them.

The hub (`silo_server/hub.py`) and the in-process runner (`silo_sim/inprocess.py`) build a `RoundRecord` per round;
the hub's history and checkpoint, the Prometheus exporter (`silo_server/metrics.py`), silo-sim's table and
summary.json and the benchmarks read its fields. A value that crosses components is named once, here, so a producer
and a reader cannot drift apart on a key (the DP gauges once read `epsilon_spent` while the hub wrote `dp_epsilon`).

On disk a record is one flat JSON object (history.json, the checkpoint's state.json, summary.json, bench results):
`to_json` writes the layout these files had before the record existed and leaves out what is None, and `from_json`
reads every file written since, so old state folders and committed results still load. The nested parts keep their
prefixes there: `dp_*` (`DPRound`), `secagg_*` (`SecAggRound`), `aggregation_*` (`AggregationRound`); any other
key is one of the algorithm's own metrics.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

# Algorithm metrics that other components read (the exporter, silo-sim's table, the benchmark's plots). Algorithms
# name them through these constants, so that the names live in one place.
PSEUDO_LABEL_RATIO = "pseudo_label_ratio"  # share of the silos' images whose pseudo-label passed the threshold
PSEUDO_LABEL_ACCURACY = "pseudo_label_accuracy"  # share of those that were right (simulation only)
_THRESHOLD = re.compile(r"^threshold_class_(\d+)$")


@dataclass(frozen=True)
class Sampling:
    """Which silos take part in a round: rounds.silos_per_round (a fraction of those available) or
    rounds.silos_per_round_count (a number), drawn from the run's seed. The deployed hub and the in-process runner
    both draw through here, so the same seed, round and silo names sample the same silos in both (under client DP
    the hub passes a secret seed instead: silo_server/rounds/round_loop.py draw)."""

    fraction: float = 1.0
    count: int | None = None
    seed: int = 0

    def how_many(self, available: int) -> int:
        if self.count is not None:
            return min(available, self.count)
        # Rounded first, so that float error cannot cost a silo: 0.29 * 100 is 28.999999999999996.
        return max(1, int(round(self.fraction * available, 9)))

    def sample(self, available: Sequence[str], round_number: int, attempt: int = 1, at_least: int = 1) -> list[str]:
        """The silos of `round_number`'s `attempt` (a retried round draws again), at least `at_least` of them
        (secure aggregation's fewest) where that many are available, in sorted order. The draw depends on the
        names only, not on the order they are given in."""
        names = sorted(available)
        count = max(self.how_many(len(names)), min(len(names), at_least))
        rng = random.Random(self.seed * 1_000_003 + round_number * 101 + attempt)
        return sorted(rng.sample(names, count))


def threshold_metric(k: int) -> str:
    """The algorithm metric that carries class k's pseudo-label threshold (FedSEAL's per-class thresholds)."""
    return f"threshold_class_{k}"


# Keys that older files use for a field the record now names otherwise (bench/privacy's DP runs wrote `epsilon`).
LEGACY_KEYS = {"epsilon": "dp_epsilon"}


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"round record: {key} must be a number, got {value!r}")
    return float(value)


def _count(value: Any, key: str) -> int:
    number = _number(value, key)
    if not number.is_integer():
        raise ValueError(f"round record: {key} must be a whole number, got {value!r}")
    return int(number)


@dataclass(frozen=True)
class Scores:
    """A model's scores on the hub's test set and validation split (None where the hub has no such data or did not
    score that round). Also the initial model's scores, before round 1."""

    test_accuracy: float | None = None
    test_loss: float | None = None
    validation_accuracy: float | None = None
    validation_loss: float | None = None

    @classmethod
    def measured(cls, test: Mapping[str, float] | None = None,
                 validation: Mapping[str, float] | None = None) -> Scores:
        """From silo_core.training.evaluate's results ({"accuracy", "loss"}) on each split."""
        test, validation = test or {}, validation or {}
        return cls(test.get("accuracy"), test.get("loss"), validation.get("accuracy"), validation.get("loss"))

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Scores:
        return cls(**{f.name: _number(d[f.name], f.name) for f in fields(cls) if d.get(f.name) is not None})


@dataclass(frozen=True)
class DPRound:
    """Client-level differential privacy after a round (security/dp.py, DPController.finish_round). Fields other than
    epsilon are None only in results written before they were recorded."""

    epsilon: float  # spent so far in the run, at delta
    delta: float | None = None
    epsilon_budget: float | None = None  # privacy.dp.epsilon_budget; None: no budget
    noise_multiplier: float | None = None  # z, what the accountant was charged
    sample_rate: float | None = None  # q, silos sampled / enrolled
    clip_norm: float | None = None  # C this round (it moves with adaptive clipping)
    unclipped_fraction: float | None = None  # adaptive clipping's noisy estimate

    def to_json(self) -> dict[str, float]:
        return {f"dp_{f.name}": getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DPRound:
        return cls(**{f.name: _number(d[f"dp_{f.name}"], f"dp_{f.name}") for f in fields(cls)
                      if d.get(f"dp_{f.name}") is not None})


@dataclass(frozen=True)
class SecAggRound:
    """A securely aggregated round (security/secagg: the session's sets and costs; silo_server/rounds/privacy.py: timings).
    U1..U4 are the silos left after each stage (Bonawitz et al. 2017): U3 sent masked inputs and is summed."""

    sampled: int
    advertised: int
    u1: int
    u2: int
    u3: int
    u4: int
    degree: int  # k, neighbours each silo masks with
    threshold: int  # t, shares needed to recover a secret
    bytes_in: int
    bytes_out: int
    consistency: int = 0  # silos that signed the survivor set (the consistency round; 0 in older records)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # advertise_keys, share_keys, masked_input, unmasking

    @property
    def contributors(self) -> int:
        return self.u3

    @property
    def recoveries(self) -> int:
        """Silos that dropped after sharing their keys: the hub rebuilt their pair masks from the others' shares."""
        return self.u2 - self.u3

    _COUNTS = ("sampled", "advertised", "u1", "u2", "u3", "u4", "degree", "threshold", "bytes_in", "bytes_out")

    def to_json(self) -> dict[str, float]:
        out: dict[str, float] = {f"secagg_{name}": getattr(self, name) for name in self._COUNTS}
        out["secagg_consistency"] = self.consistency
        out["secagg_contributors"] = self.contributors  # kept for readers of older history.json files
        out.update({f"secagg_{stage}_seconds": s for stage, s in self.stage_seconds.items()})
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SecAggRound:
        stages = {m.group(1): _number(v, k) for k, v in d.items() if (m := _SECAGG_STAGE.match(k))}
        return cls(**{name: _count(d[f"secagg_{name}"], f"secagg_{name}") for name in cls._COUNTS},
                   consistency=_count(d.get("secagg_consistency", 0), "secagg_consistency"),  # 0: an older record
                   stage_seconds=stages)


_SECAGG_STAGE = re.compile(r"^secagg_([a-z][a-z0-9_]*)_seconds$")


@dataclass(frozen=True)
class AggregationRound:
    """A robust aggregation rule's decision (silo_server/rounds/robust.py, hub.yaml aggregation.rule): of the round's
    individual updates, how many the rule left out (excluded) or gave under half their part in the mean
    (down-weighted), and which silos."""

    rule: str
    updates: int
    down_weighted: int = 0
    excluded: int = 0
    down_weighted_silos: tuple[str, ...] = ()
    excluded_silos: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"aggregation_rule": self.rule, "aggregation_updates": self.updates,
                "aggregation_down_weighted": self.down_weighted, "aggregation_excluded": self.excluded,
                "aggregation_down_weighted_silos": list(self.down_weighted_silos),
                "aggregation_excluded_silos": list(self.excluded_silos)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AggregationRound:
        return cls(rule=str(d["aggregation_rule"]), updates=_count(d["aggregation_updates"], "aggregation_updates"),
                   down_weighted=_count(d.get("aggregation_down_weighted", 0), "aggregation_down_weighted"),
                   excluded=_count(d.get("aggregation_excluded", 0), "aggregation_excluded"),
                   down_weighted_silos=tuple(str(s) for s in d.get("aggregation_down_weighted_silos", ())),
                   excluded_silos=tuple(str(s) for s in d.get("aggregation_excluded_silos", ())))


@dataclass(frozen=True)
class RoundRecord:
    """Everything a completed round reports. None: not measured in this round or by this runner (the in-process
    runner has no bytes on the wire; a hub-only algorithm samples no silos; DP and secure aggregation may be off)."""

    round: int
    scores: Scores = field(default_factory=Scores)
    # participation
    silos_sampled: int | None = None
    silos_reported: int | None = None  # reported a result or a skip (and did not abort afterwards)
    silos_skipped: int | None = None  # reported that nothing passed their threshold
    silos_dropped: int | None = None  # sampled but did not report
    # Sampled silos that had not reported when the round closed, by name (the deadline, or quorum_wait_seconds
    # after the quorum reported: rounds.wait_after_quorum_s)
    silos_left_out: tuple[str, ...] = ()
    quorum_wait_seconds: float | None = None  # how long the round waited past its quorum for the rest
    # the applied sum holds its update (reported, not a skip, stayed, not left out by a robust aggregation rule)
    silos_contributed: int | None = None
    attempt: int | None = None  # >1 after below-quorum retries
    bytes_up: int | None = None
    bytes_down: int | None = None  # every bundle sent, to the sampled silos and to the silos below
    # Silos left out of the sample that received the round's model anyway (an algorithm that broadcasts it:
    # FedSEAL's ensemble_every_round), and the bytes sent to them, over the round's attempts.
    silos_received: int | None = None
    bytes_down_received: int | None = None
    # timing
    round_seconds: float | None = None
    aggregation_seconds: float | None = None  # sums to next model (unmask, average, hub fine-tune, sBN)
    evaluation_seconds: float | None = None  # scoring on the validation split and test set
    silo_train_seconds: float | None = None  # mean local training time of the reporting silos
    # writing the round's checkpoint (after round_seconds ends); history.json has it, the checkpoint's own copy
    # of its round cannot (it is written before the time is known): a resumed hub takes it from history.json
    checkpoint_seconds: float | None = None
    silo_train_loss: float | None = None  # mean local training loss of the contributing silos
    # memory
    hub_peak_rss_bytes: int | None = None
    collecting_rss_growth_bytes: int | None = None  # the hub's RSS growth while silos downloaded and uploaded
    # privacy
    dp: DPRound | None = None
    secagg: SecAggRound | None = None
    aggregation: AggregationRound | None = None  # a robust rule's decision (None under the plain mean)
    # the algorithm's own metrics (hub_loss, aggregated_weight, pseudo-label ratio, per-class thresholds, ...)
    algorithm: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clash = sorted(k for k in self.algorithm if _reserved(k))
        if clash:
            raise ValueError(f"round {self.round}: algorithm metrics {clash} reuse names the round record types")

    # -- algorithm metrics other components read
    @property
    def pseudo_label_ratio(self) -> float | None:
        return self.algorithm.get(PSEUDO_LABEL_RATIO)

    @property
    def pseudo_label_accuracy(self) -> float | None:
        return self.algorithm.get(PSEUDO_LABEL_ACCURACY)

    @property
    def class_thresholds(self) -> dict[int, float]:
        """Per-class thresholds the algorithm reported for this round (FedSEAL), by class index."""
        return dict(sorted((int(m.group(1)), v) for k, v in self.algorithm.items() if (m := _THRESHOLD.match(k))))

    # -- the flat JSON layout
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"round": self.round, **self.algorithm, **self.scores.to_json()}
        out.update({name: getattr(self, name) for name in _PLAIN if getattr(self, name) is not None})
        if self.dp is not None:
            out.update(self.dp.to_json())
        if self.secagg is not None:
            out.update(self.secagg.to_json())
        if self.aggregation is not None:
            out.update(self.aggregation.to_json())
        if self.silos_left_out:
            out["silos_left_out"] = list(self.silos_left_out)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RoundRecord:
        d = {LEGACY_KEYS.get(k, k): v for k, v in d.items()}
        plain: dict[str, Any] = {}
        for name, kind in _PLAIN.items():
            if d.get(name) is not None:
                plain[name] = _count(d[name], name) if kind is int else _number(d[name], name)
        algorithm = {k: _number(v, k) for k, v in d.items() if not _reserved(k) and v is not None}
        return cls(
            round=_count(d["round"], "round"), scores=Scores.from_json(d),
            dp=DPRound.from_json(d) if d.get("dp_epsilon") is not None else None,
            secagg=SecAggRound.from_json(d) if d.get("secagg_u3") is not None else None,
            aggregation=AggregationRound.from_json(d) if d.get("aggregation_rule") is not None else None,
            silos_left_out=tuple(str(s) for s in d.get("silos_left_out", ())), algorithm=algorithm, **plain)


# The record's top-level numbers and their types, as they appear in the flat JSON.
_PLAIN: dict[str, type] = {name: kind for name, hint in get_type_hints(RoundRecord).items()
                           for kind in (int, float) if hint == kind | None}
_SCORES = frozenset(f.name for f in fields(Scores))


def _reserved(key: str) -> bool:
    """Whether a flat JSON key belongs to the record itself rather than to the algorithm's metrics."""
    return (key in ("round", "silos_left_out") or key in _PLAIN or key in _SCORES
            or key.startswith(("dp_", "secagg_", "aggregation_")))


def records_from_json(rows: Iterable[Mapping[str, Any]]) -> list[RoundRecord]:
    """A history as stored (history.json's "rounds", summary.json's "rounds", a bench cell's "history")."""
    return [RoundRecord.from_json(row) for row in rows]


def nan_if_none(value: float | None) -> float:
    """For gauges and tables: an unknown value shows as a gap (NaN), never as a false zero."""
    return math.nan if value is None else value
