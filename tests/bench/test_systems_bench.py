"""The systems benchmark's overhead comparison runs end to end on a tiny federation and splits each round's time
consistently (the real numbers come from `python bench/systems/run.py`, not from the suite)."""

import pytest

from silo_core.rounds import RoundRecord
from tests.bench import load_script


def test_overhead_splits_each_round_into_computation_and_the_rest_both_ways():
    bench = load_script("bench/systems/run.py", "systems_bench")
    o = bench.overhead_once(rounds=2, silos=2, unlabeled=200, repeats=1)
    # The wire changes nothing in the numbers.
    assert o["wire_final_accuracy"] == o["inprocess_final_accuracy"] > 0.1
    for side in ("wire", "inprocess"):
        (split,) = o[f"{side}_time_split"]
        assert split["silo_training"] > 0 and split["hub_work"] > 0
        assert split["total"] == sum(o[f"{side}_round_seconds"][0])
        # The timed parts happen inside the rounds: what is left is small but never negative.
        assert 0 <= split["other"] < split["total"]
        assert split["silo_training"] + split["hub_work"] + split["other"] == pytest.approx(split["total"])
    assert o["wire_own_fraction"] == pytest.approx(
        (o["wire_time_split"][0]["other"] - o["inprocess_time_split"][0]["other"]) / o["inprocess_total_s"])
    report = bench.report({"overhead": [o]})
    assert f"**{100 * o['wire_own_fraction']:+.1f}%**" in report and "| 2 | 200 | 2 x 1 |" in report


def test_time_split_counts_every_reporting_silo_and_the_hubs_two_phases():
    bench = load_script("bench/systems/run.py", "systems_bench")
    rounds = [RoundRecord(round=1, round_seconds=4.0, silo_train_seconds=0.5, silos_reported=4,
                          aggregation_seconds=1.0, evaluation_seconds=0.5),
              RoundRecord(round=2, round_seconds=5.0, silo_train_seconds=1.0, silos_reported=3,
                          aggregation_seconds=1.5)]
    assert bench.time_split(rounds) == {"total": 9.0, "silo_training": 5.0, "hub_work": 3.0, "other": 1.0,
                                        "after_round_1": 5.0}
