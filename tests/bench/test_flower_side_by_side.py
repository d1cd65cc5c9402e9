"""The Flower side-by-side benchmark's bookkeeping: when silokit's hub opened each round (from its log) and how a
round's time splits into the clients' training and the framework's overhead. The Flower half itself needs a
separate venv with flwr (bench/systems/flower_side_by_side.py's doc) and is not run by the suite."""

from datetime import datetime

import pytest

from tests.bench import load_script


def bench():
    return load_script("bench/systems/flower_side_by_side.py", "flower_side_by_side")


def test_round_open_times_come_from_the_hubs_first_attempt_lines_only():
    log = "\n".join([
        "2026-11-25 20:12:32,771 INFO silo_server: waiting for silos: 0 ready, 10 needed to start a round",
        "2026-11-25 20:12:42,211 INFO silo_server: round 1 attempt 1: sampled 10 of 10 silos, quorum 5",
        "2026-11-25 20:12:42,552 INFO silo_server: round 1: update from silo-009 (1/10 reported)",
        "2026-11-25 20:12:45,000 INFO silo_server: round 2 attempt 1: sampled 10 of 100 silos, quorum 5",
        "2026-11-25 20:13:45,500 INFO silo_server: round 2 attempt 2: sampled 10 of 100 silos, quorum 5",
    ])
    opened = bench().round_opened_times(log)
    assert sorted(opened) == [1, 2]
    assert opened[1] == datetime(2026, 11, 25, 20, 12, 42, 211000).timestamp()
    assert opened[2] - opened[1] == pytest.approx(2.789)  # the retry (attempt 2) does not move round 2's start


def test_overhead_is_the_round_minus_the_training_share_of_the_clients_training_at_once():
    b = bench()
    rows = b.per_round(round_seconds=[5.0, 3.0, 2.0], train_seconds=[[1.0] * 4, [0.5] * 4, [0.25, 0.75]],
                       starts=[100.0, 106.0, 109.5], slots=2)
    assert [r["overhead_seconds"] for r in rows] == [3.0, 2.0, 1.5]
    assert [r["overhead_vs_mean_seconds"] for r in rows] == [4.0, 2.5, 1.5]
    assert [r["clients"] for r in rows] == [4, 4, 2]
    assert [r.get("cycle_seconds") for r in rows] == [6.0, 3.5, None]
    steady = b.summarise(rows)  # round 1 (one-off start-up costs) is left out
    assert steady["round_seconds"] == 2.5 and steady["overhead_seconds"] == 1.75
    assert steady["train_sum_seconds"] == 1.5 and steady["cycle_seconds"] == 3.5
    assert b.summarise(rows[:1])["overhead_seconds"] == 3.0  # a one-round run has only round 1


def test_clients_training_at_once_is_their_summed_time_over_the_time_any_of_them_trained():
    at_once = bench().concurrency
    assert at_once([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 1.0  # one after the other
    assert at_once([(0.0, 2.0), (0.0, 2.0), (2.0, 4.0), (2.0, 4.0)]) == 2.0  # two side by side
    assert at_once([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(5.0 / 4.0)  # overlap, then a gap
    assert at_once([]) == 0.0


def test_repeated_runs_give_the_median_and_range_of_the_start_up_per_engine_and_size():
    runs = [{"engine": "silokit", "silos": 1000, "launch_to_round1_seconds": s, "launch_to_round1_end_seconds": s + 2}
            for s in (6.1, 5.4, 5.7)]
    runs += [{"engine": "flower", "silos": 1000, "launch_to_round1_seconds": 2.5, "launch_to_round1_end_seconds": 10.5},
             {"engine": "flower", "silos": 10, "launch_to_round1_seconds": 2.3, "launch_to_round1_end_seconds": 10.0},
             {"engine": "silokit", "silos": 10, "skipped": "load"}]
    spread = bench().start_up_spread(runs)
    assert set(spread) == {(1000, "silokit")}  # a single run has no spread; a skipped one no time
    assert spread[(1000, "silokit")] == pytest.approx({"median": 5.7, "low": 5.4, "high": 6.1, "median_end": 7.7,
                                                       "runs": 3})
