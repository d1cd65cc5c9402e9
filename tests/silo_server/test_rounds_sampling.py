"""The hub samples and waits by the rounds keys, each read one way: a fraction (rounds.silos_per_round,
rounds.quorum) or a count (rounds.silos_per_round_count, rounds.quorum_silos)."""

from __future__ import annotations

import time

import pytest

from tests.silo_server.test_hub import make_hub, result, start_round, upload, wait_task


def _sample_one_round(tmp_path, **kw):
    hub = make_hub(tmp_path, min_silos=3, **kw)
    for s in ("a", "b", "c"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    for _ in range(100):
        if hub.rounds.task is not None:
            break
        time.sleep(0.05)
    return hub, thread, out


def test_a_count_samples_exactly_that_many_silos_and_a_quorum_count_needs_that_many_reports(tmp_path):
    # Read the old way, `1` meant 100%: all three silos sampled and all three reports needed.
    hub, thread, out = _sample_one_round(tmp_path, silos_per_round_count=1, quorum_silos=1, deadline_s=30.0)
    task = hub.rounds.task
    assert len(task.sampled) == 1
    (only,) = task.sampled
    upload(hub, only, wait_task(hub, only), result(6.0))
    thread.join(10)
    last = hub.records.history[-1]
    assert not thread.is_alive() and last.silos_reported == 1 and last.attempt == 1
    assert out["state"].round == 1


def test_one_report_of_two_is_enough_with_quorum_silos_1_at_the_deadline(tmp_path):
    hub, thread, out = _sample_one_round(tmp_path, silos_per_round_count=2, quorum_silos=1, deadline_s=1.0)
    first = sorted(hub.rounds.task.sampled)[0]
    upload(hub, first, wait_task(hub, first), result(2.0))  # the other sampled silo never reports
    thread.join(10)
    record = hub.records.history[-1]
    assert (record.silos_reported, record.attempt) == (1, 1)  # applied at the deadline, not retried


@pytest.mark.parametrize("fraction, live, sampled", [(1.0, 3, 3), (0.5, 3, 1), (0.29, 100, 29), (0.01, 3, 1)])
def test_a_fraction_samples_its_share_of_the_live_silos(tmp_path, fraction, live, sampled):
    hub = make_hub(tmp_path, silos_per_round=fraction)
    assert hub.rounds.sample_count(live) == sampled


@pytest.mark.parametrize("quorum, sampled, need", [(0.5, 3, 2), (0.55, 100, 55), (1.0, 4, 4), (0.1, 3, 1)])
def test_a_quorum_fraction_rounds_up_and_never_by_float_error(tmp_path, quorum, sampled, need):
    assert make_hub(tmp_path, quorum=quorum).rounds.quorum_count(sampled) == need


def test_a_count_above_the_silos_live_takes_them_all(tmp_path):
    hub = make_hub(tmp_path, silos_per_round_count=10, quorum_silos=5)
    assert (hub.rounds.sample_count(3), hub.rounds.quorum_count(3)) == (3, 3)
