"""The hub core under hostile input (no network): a silo acts only as itself, every field is bounded, the update
norm and weight are checked, and a property-based fuzzer finds no message that is accepted, crashes, or moves
any state."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from silo_core.tensors import iter_chunks
from silo_server.hub import Hub, Refusal
from tests.silo_server import hostile
from tests.silo_server.test_hub import make_hub, start_round, wait_task


def _upload(hub: Hub, silo: str, header: dict, chunks) -> None:
    hub.upload(silo, header, iter(chunks))


def _refused(call) -> Refusal:
    with pytest.raises(Refusal) as info:
        call()
    return info.value


def snapshot(hub: Hub) -> tuple:
    """Everything an upload could change (except the silos' last_seen, which any call refreshes)."""
    t = hub.rounds.task
    silos = {s: (r.num_unlabeled, r.num_labeled, r.device, r.skipped_images, hub.records.contributed.get(s, 0))
             for s, r in hub.registry.silos.items()}
    task = None if t is None else (
        t.task_id, t.round, t.open, frozenset(t.reported), frozenset(t.skipped), frozenset(t.downloaded), t.bytes_up,
        t.bytes_down, {k: v.clone() for k, v in t.sums.tensors.items()}, dict(t.sums.metrics), t.sums.contributors)
    return hub.rounds.round, hub.rounds.phase, len(hub.records.history), silos, task


def same(a: tuple, b: tuple) -> bool:
    if a[:4] != b[:4] or (a[4] is None) != (b[4] is None):
        return False
    if a[4] is None:
        return True
    ta, tb = a[4], b[4]
    return ta[:8] == tb[:8] and ta[9:] == tb[9:] and ta[8].keys() == tb[8].keys() and all(
        torch.equal(ta[8][k], tb[8][k]) for k in ta[8])


class OpenRound:
    """A hub with round 1 open: three silos joined with IMAGES images, two sampled, nothing reported yet."""

    def __init__(self, tmp_path, **kw):
        self.hub = make_hub(tmp_path, min_silos=3, deadline_s=600, max_update_norm=hostile.MAX_NORM, **kw)
        for s in ("a", "b", "c"):
            self.hub.join(s, hostile.IMAGES, 0, "cpu")
        self.hub.rounds.sampling = dataclasses.replace(self.hub.rounds.sampling, count=2)
        self.thread, self.out = start_round(self.hub)
        for _ in range(100):
            if self.hub.rounds.task is not None:
                break
            time.sleep(0.05)
        self.task = self.hub.rounds.task
        self.sampled = sorted(self.task.sampled)
        self.outsider = ({"a", "b", "c"} - set(self.sampled)).pop()
        self.view = wait_task(self.hub, self.sampled[0])

    def finish(self, values=(1.0, 3.0)) -> torch.Tensor:
        for silo, v in zip(self.sampled, values, strict=True):
            header, payload = hostile.valid_upload(self.hub.run_id, self.view.task_id, 1,
                                                   {"delta/x": torch.full((3,), v), "weight": torch.ones(1)})
            _upload(self.hub, silo, header, iter_chunks(payload, 16))
        self.thread.join(10)
        return self.out["state"].tensors["model/x"]


# ------------------------------------------------------------------------------------------ a silo is itself only


def test_a_silo_cannot_download_or_upload_for_a_round_it_was_not_sampled_for(tmp_path) -> None:
    r = OpenRound(tmp_path)
    hub, task_id = r.hub, r.view.task_id
    before = snapshot(hub)
    assert _refused(lambda: hub.download(r.outsider, hub.run_id, task_id)).code == "PERMISSION_DENIED"
    header, payload = hostile.valid_upload(hub.run_id, task_id, 1)
    refusal = _refused(lambda: _upload(hub, r.outsider, header, iter_chunks(payload, 16)))
    assert (refusal.code, refusal.reason) == ("PERMISSION_DENIED", "not_sampled")
    assert _refused(lambda: hub.download("stranger", hub.run_id, task_id)).code == "FAILED_PRECONDITION"
    assert same(before, snapshot(hub))
    # A sampled silo fills only its own slot: its second upload is a duplicate, not someone else's report.
    _upload(hub, r.sampled[0], header, iter_chunks(payload, 16))
    second = _refused(lambda: _upload(hub, r.sampled[0], header, iter_chunks(payload, 16)))
    assert (second.code, second.reason) == ("ALREADY_EXISTS", "duplicate")
    assert hub.rounds.task.reported == {r.sampled[0]}
    assert hub.registry.refusals == {"not_sampled": 2, "not_joined": 1, "duplicate": 1}


def test_update_norm_is_measured_per_unit_weight_against_the_bound(tmp_path) -> None:
    r = OpenRound(tmp_path)
    hub, view = r.hub, r.view
    # norm([6, 8, 0]) = 10: on the bound (accepted); with weight 2 the same tensors are a change of norm 5.
    over = {"delta/x": torch.tensor([6.0, 8.0, 0.1]), "weight": torch.ones(1)}
    header, payload = hostile.valid_upload(hub.run_id, view.task_id, 1, over)
    refusal = _refused(lambda: _upload(hub, r.sampled[0], header, iter_chunks(payload, 16)))
    assert (refusal.reason, refusal.code) == ("update_norm", "INVALID_ARGUMENT")
    assert "10 exceeds this hub's bound of 10 (security.max_update_norm)" in refusal.message
    weighted = {"delta/x": torch.tensor([6.0, 8.0, 0.1]), "weight": torch.tensor([2.0])}
    header, payload = hostile.valid_upload(hub.run_id, view.task_id, 1, weighted)
    _upload(hub, r.sampled[0], header, iter_chunks(payload, 16))
    assert hub.rounds.task.reported == {r.sampled[0]}


def test_weight_must_be_positive_and_at_most_the_declared_images(tmp_path) -> None:
    r = OpenRound(tmp_path)
    hub, view = r.hub, r.view
    for w, words in ((0.0, "must be positive"), (-3.0, "must be positive"),
                     (hostile.IMAGES + 1.0, f"exceeds the {hostile.IMAGES} images this silo declared")):
        t = {"delta/x": torch.zeros(3), "weight": torch.tensor([w])}
        header, payload = hostile.valid_upload(hub.run_id, view.task_id, 1, t)
        refusal = _refused(lambda header=header, payload=payload: _upload(hub, r.sampled[0], header,
                                                                        iter_chunks(payload, 16)))
        assert refusal.reason == "bad_weight" and words in refusal.message
    assert hub.registry.refusals == {"bad_weight": 3}


def test_join_and_ids_are_bounded(tmp_path) -> None:
    hub = make_hub(tmp_path)
    for args, field in (((-1, 0, "cpu"), "num_unlabeled"), ((1, 10**10, "cpu"), "num_labeled"),
                        ((1, 0, "x" * 65), "device"), ((1, 0, "cpu\nFAKE LOG LINE"), "device")):
        refusal = _refused(lambda args=args: hub.join("a", *args))
        assert refusal.code == "INVALID_ARGUMENT" and field in refusal.message
    assert hub.registry.silos == {}
    hub.join("a", 5, 0, "cuda:0")
    for call in (lambda: hub.next_task("a", "r" * 129, 0), lambda: hub.download("a", hub.run_id, "t\n")):
        assert _refused(call).reason == "bad_request"
    assert hub.registry.refusals == {"bad_request": 6}


def test_a_stream_still_running_when_the_round_closes_is_refused(tmp_path) -> None:
    r = OpenRound(tmp_path)
    hub = r.hub
    header, payload = hostile.valid_upload(hub.run_id, r.view.task_id, 1)
    chunks = list(iter_chunks(payload, 16))

    def slow():
        yield chunks[0]
        r.task.open = False  # what the round loop does at the deadline
        yield from chunks[1:]

    refusal = _refused(lambda: _upload(hub, r.sampled[0], header, slow()))
    assert (refusal.code, refusal.reason) == ("FAILED_PRECONDITION", "stale_task")
    r.task.open = True
    assert r.task.reported == set()
    assert torch.equal(r.finish(), torch.full((3,), 2.0))


def test_certificate_expiry_is_kept_as_days_left_and_revoked_silos_are_not_sampled(tmp_path) -> None:
    hub = make_hub(tmp_path)
    now = dt.datetime.now(dt.UTC)
    hub.registry.cert_not_after.update({"hub": now + dt.timedelta(days=30), "a": now + dt.timedelta(hours=12)})
    days = hub.registry.cert_days_left
    assert days["hub"] == pytest.approx(30, abs=1e-3) and days["a"] == pytest.approx(0.5, abs=1e-3)
    hub.join("a", 1, 0, "cpu")
    hub.join("b", 1, 0, "cpu")
    hub.rounds.evict("a")
    assert hub.registry.live_silos() == ["b"] and "a" in hub.registry.silos


# ------------------------------------------------------------------------------------------------------ fuzzing


@pytest.fixture(scope="module")
def open_round(tmp_path_factory) -> OpenRound:
    r = OpenRound(tmp_path_factory.mktemp("fuzz-hub"))
    yield r
    # After everything the fuzzer threw, the round still completes with exactly the honest mean.
    assert torch.equal(r.finish(), torch.full((3,), 2.0))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_hostile_uploads_are_always_refused_and_change_nothing(open_round: OpenRound, data) -> None:
    hub, view = open_round.hub, open_round.view
    header, payload = hostile.valid_upload(hub.run_id, view.task_id, 1)
    attack = data.draw(hostile.hostile_upload(header, payload), label="attack")
    silo = data.draw(st.sampled_from(open_round.sampled + [open_round.outsider]), label="silo")
    before, refusals = snapshot(hub), sum(hub.registry.refusals.values())
    refusal = _refused(lambda: _upload(hub, silo, attack.header, attack.chunks))
    assert refusal.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "PERMISSION_DENIED")
    expected = attack.reasons | ({"not_sampled"} if silo == open_round.outsider else set())
    assert refusal.reason in expected, (refusal.reason, refusal.message, hostile.describe(attack))
    assert refusal.message and len(refusal.message) < 300  # names the problem without echoing the input
    assert same(before, snapshot(hub)), hostile.describe(attack)
    assert sum(hub.registry.refusals.values()) == refusals + 1


@pytest.fixture(scope="module")
def idle_hub(tmp_path_factory) -> Hub:
    """A hub with a joined silo and no round open: every upload must be refused before anything else happens."""
    hub = make_hub(tmp_path_factory.mktemp("fuzz-idle"))
    hub.join("a", 10, 0, "cpu")
    return hub


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=12), st.one_of(st.none(), st.integers(), st.text(max_size=20),
                                                                st.floats(), st.booleans(), st.binary(max_size=8)),
                              max_size=8),
       chunks=st.lists(st.tuples(st.one_of(st.integers(), st.none()), st.binary(max_size=32)), max_size=6))
def test_fuzz_random_headers_and_chunks_never_crash_the_hub(idle_hub: Hub, header, chunks) -> None:
    before = snapshot(idle_hub)
    with pytest.raises(Refusal):
        idle_hub.upload("a", header, iter(chunks))
    assert same(before, snapshot(idle_hub))
