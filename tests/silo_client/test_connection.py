"""The silo's connection as a state machine (silo_client/connection.py): every transition, without a hub."""

from __future__ import annotations

import random

import pytest

from silo_client.connection import MAX_BACKOFF_S, Connection, Outcome, Phase


def connection(**kw) -> Connection:
    return Connection(rng=random.Random(0), **kw)


def test_join_then_wait_then_tasks_then_done():
    c = connection()
    assert c.phase is Phase.JOINING
    assert c.after(Outcome("joined"), 0).phase is Phase.WAITING
    step = c.after(Outcome("task", task_kind="WAIT", retry_after=30.0), 1)
    assert (step.phase, step.wait_s) == (Phase.WAITING, 5.0)  # a WAIT answer's pause, capped
    assert c.after(Outcome("task", task_kind="TRAIN"), 2).phase is Phase.WAITING  # the task ran: ask again
    assert c.after(Outcome("done"), 3).phase is Phase.DONE


@pytest.mark.parametrize("code, rejoins", [("UNAVAILABLE", True), ("DEADLINE_EXCEEDED", False),
                                           ("CANCELLED", False), ("RESOURCE_EXHAUSTED", False)])
def test_a_transient_failure_backs_off_doubling_with_jitter_then_resumes(code, rejoins):
    c = connection()
    c.after(Outcome("joined"), 0)
    waits = []
    for now in range(5):
        step = c.after(Outcome("rpc_error", code=code, message="away"), now)
        assert step.phase is Phase.BACKING_OFF and step.log.startswith("away; retrying in")
        assert step.then is (Phase.JOINING if rejoins else Phase.WAITING)
        waits.append(step.wait_s)
    assert all(0.75 * b <= w <= 1.25 * b for w, b in zip(waits, (1, 2, 4, 8, 16), strict=True))
    assert c.backoff_s == MAX_BACKOFF_S
    assert c.after(Outcome("joined" if rejoins else "task", task_kind="TRAIN"), 6).phase is Phase.WAITING
    assert c.backoff_s == 1.0 and c.unreachable_since is None  # back: the next failure starts at 1 s again


def test_a_hub_away_longer_than_the_connect_timeout_ends_the_silo():
    c = connection(connect_timeout_s=60)
    assert c.after(Outcome("rpc_error", code="UNAVAILABLE", message="cannot reach"), 0).phase is Phase.BACKING_OFF
    step = c.after(Outcome("rpc_error", code="UNAVAILABLE", message="cannot reach"), 61)
    assert (step.phase, step.error) == (Phase.REFUSED, "cannot reach; gave up after 60s")
    never = connection(connect_timeout_s=0)
    assert never.after(Outcome("rpc_error", code="UNAVAILABLE"), 10**6).phase is Phase.BACKING_OFF


def test_a_stale_task_or_a_restarted_hub_joins_again_at_once():
    c = connection()
    c.after(Outcome("joined"), 0)
    step = c.after(Outcome("rpc_error", code="FAILED_PRECONDITION", message="run x is not this hub's run"), 1)
    assert (step.phase, step.wait_s) == (Phase.JOINING, 0.0) and "joining again" in step.log


def test_a_join_refused_for_another_live_session_backs_off_doubling_not_once_a_second():
    c = connection(connect_timeout_s=0)
    waits = [c.after(Outcome("rpc_error", code="ALREADY_EXISTS", message="silo a is connected with another "
                                                                           "certificate"), now).wait_s
             for now in range(4)]
    assert c.phase is Phase.JOINING and all(0.75 * b <= w <= 1.25 * b for w, b in zip(waits, (1, 2, 4, 8), strict=True))
    c.after(Outcome("joined"), 5)
    step = c.after(Outcome("rpc_error", code="ALREADY_EXISTS", message="duplicate upload"), 6)  # not at join
    assert (step.phase, step.wait_s) == (Phase.WAITING, 1.0)


def test_a_rate_refusal_waits_as_long_as_the_hub_says_then_resumes_what_it_was_doing():
    c = connection()
    c.after(Outcome("joined"), 0)
    step = c.after(Outcome("rpc_error", code="RESOURCE_EXHAUSTED", message="slow down", retry_after=0.25), 1)
    assert (step.phase, step.wait_s, step.then) == (Phase.BACKING_OFF, 0.25, Phase.WAITING)
    assert c.backoff_s == 1.0  # not a failure of the hub: no doubling
    long = c.after(Outcome("rpc_error", code="RESOURCE_EXHAUSTED", retry_after=3600.0), 2)
    assert long.wait_s == 60.0


def test_refused_for_good_by_certificate_or_protocol():
    assert connection().after(Outcome("rpc_error", code="UNAUTHENTICATED", message="revoked"), 0).error == (
        "the hub refused this silo: revoked; check --certs")
    step = connection().after(Outcome("rpc_error", code="PERMISSION_DENIED", message="install silokit 0.2.0"), 0)
    assert (step.phase, step.error) == (Phase.REFUSED, "the hub refused this silo: install silokit 0.2.0")


def test_tls_refused_is_retried_for_its_grace_then_ends_the_silo():
    c = connection(tls_refused_grace_s=30)
    first = c.after(Outcome("tls_refused", message="another CA"), 0)
    assert first.phase is Phase.BACKING_OFF
    assert c.after(Outcome("tls_refused", message="another CA"), 29).phase is Phase.BACKING_OFF
    last = c.after(Outcome("tls_refused", message="another CA"), 30)
    assert (last.phase, last.error) == (Phase.REFUSED, "another CA")
    # a hub merely away in between resets the grace
    c2 = connection(tls_refused_grace_s=30)
    c2.after(Outcome("tls_refused"), 0)
    c2.after(Outcome("hub_unchecked", message="cannot reach"), 20)
    assert c2.after(Outcome("tls_refused"), 40).phase is Phase.BACKING_OFF


def test_a_bad_bundle_is_asked_for_again_and_an_unknown_error_waits_a_second():
    c = connection()
    c.after(Outcome("joined"), 0)
    assert c.after(Outcome("bad_bundle", message="sha256"), 1).wait_s == 1.0
    step = c.after(Outcome("rpc_error", code="INVALID_ARGUMENT", message="bad header"), 2)
    assert (step.phase, step.wait_s) == (Phase.WAITING, 1.0) and step.log == ("hub refused a request: "
                                                                             "INVALID_ARGUMENT: bad header")


@pytest.mark.parametrize("phase_before", [Phase.JOINING, Phase.WAITING])
def test_the_branchs_policy_ends_the_silos_part_from_any_phase(phase_before):
    c = connection()
    if phase_before is Phase.WAITING:
        c.after(Outcome("joined"), 0)
    step = c.after(Outcome("left", message="policy requires secure aggregation"), 1)
    assert step.phase is Phase.LEFT and c.phase is Phase.LEFT and step.error is None


def test_an_unknown_outcome_is_a_bug_not_a_state():
    with pytest.raises(ValueError, match="unknown outcome"):
        connection().after(Outcome("teleported"), 0)
