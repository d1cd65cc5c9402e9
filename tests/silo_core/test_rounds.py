"""The round record: its flat JSON is the layout history.json, checkpoints, summary.json and the committed benchmark
results already have, so every file written so far still loads, and writes back unchanged."""

import json
import math
from pathlib import Path

import pytest

from silo_core.rounds import (
    LEGACY_KEYS,
    DPRound,
    RoundRecord,
    Scores,
    SecAggRound,
    records_from_json,
    threshold_metric,
)

ROOT = Path(__file__).resolve().parents[2]


def stored_rounds(node):
    """Round entries anywhere in a results file: lists under "history" or "rounds" whose items carry a round."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("history", "rounds") and isinstance(value, list) and value and "round" in value[0]:
                yield from value
            else:
                yield from stored_rounds(value)
    elif isinstance(node, list):
        for value in node:
            yield from stored_rounds(value)


def same(a, b):
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


def test_every_committed_benchmark_round_loads_and_writes_back_unchanged():
    files = sorted((ROOT / "bench").rglob("*.json"))
    checked = 0
    for path in files:
        for stored in stored_rounds(json.loads(path.read_text())):
            written = RoundRecord.from_json(stored).to_json()
            expected = {LEGACY_KEYS.get(k, k): v for k, v in stored.items() if v is not None}
            assert written.keys() == expected.keys(), path
            assert all(same(written[k], expected[k]) for k in expected), path
            checked += 1
    assert checked > 1000  # the quality, systems and privacy results all hold rounds


def test_a_hub_round_with_privacy_round_trips_through_its_flat_json():
    record = RoundRecord(
        round=3, scores=Scores(test_accuracy=0.8, test_loss=0.6, validation_accuracy=0.75), silos_sampled=5,
        silos_reported=4, silos_skipped=1, silos_dropped=1, attempt=2, bytes_up=10, bytes_down=20, round_seconds=3.5,
        aggregation_seconds=0.5, evaluation_seconds=0.25, silo_train_seconds=2.0, silo_train_loss=0.9,
        hub_peak_rss_bytes=1 << 30, collecting_rss_growth_bytes=1 << 20,
        dp=DPRound(epsilon=4.7, delta=1e-5, epsilon_budget=8.0, noise_multiplier=1.0, sample_rate=0.5,
                   clip_norm=0.05, unclipped_fraction=0.4),
        secagg=SecAggRound(sampled=5, advertised=5, u1=5, u2=5, u3=4, u4=4, degree=4, threshold=3, bytes_in=100,
                           bytes_out=200, stage_seconds={"share_keys": 0.1, "unmasking": 0.2}),
        algorithm={"hub_loss": 0.3, "pseudo_label_ratio": 0.6, threshold_metric(2): 0.9})
    flat = record.to_json()
    assert flat["dp_epsilon"] == 4.7 and flat["dp_epsilon_budget"] == 8.0 and flat["secagg_contributors"] == 4
    assert flat["secagg_share_keys_seconds"] == 0.1 and flat["threshold_class_2"] == 0.9
    assert RoundRecord.from_json(json.loads(json.dumps(flat))) == record
    assert record.pseudo_label_ratio == 0.6 and record.pseudo_label_accuracy is None
    assert record.class_thresholds == {2: 0.9} and record.secagg.recoveries == 1


def test_what_a_round_did_not_measure_is_none_and_absent_from_the_file():
    record = RoundRecord.from_json({"round": 1, "hub_loss": 0.5})
    assert record == RoundRecord(round=1, algorithm={"hub_loss": 0.5})
    assert record.scores.test_accuracy is None and record.dp is None and record.silos_sampled is None
    assert record.to_json() == {"round": 1, "hub_loss": 0.5}
    assert records_from_json([{"round": 2, "epsilon": 1.5}])[0].dp == DPRound(epsilon=1.5)  # bench/privacy's old key


def test_an_algorithm_metric_cannot_shadow_a_field_of_the_record():
    for name in ("validation_accuracy", "round_seconds", "dp_epsilon", "secagg_u3", "round"):
        with pytest.raises(ValueError, match="reuse names the round record types"):
            RoundRecord(round=1, algorithm={name: 0.5})


@pytest.mark.parametrize("stored, message", [
    ({"round": 1, "silos_sampled": 2.5}, "silos_sampled must be a whole number"),
    ({"round": 1, "test_accuracy": "0.5"}, "test_accuracy must be a number"),
    ({"round": True}, "round must be a number"),
    ({"round": 1, "hub_loss": [1]}, "hub_loss must be a number"),
])
def test_a_malformed_entry_names_its_key(stored, message):
    with pytest.raises(ValueError, match=message):
        RoundRecord.from_json(stored)
