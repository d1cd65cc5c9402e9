"""One silo certificate against the hub's gRPC server (mutual TLS on 127.0.0.1, the server the hub app runs): it
cannot take the capacity other silos need, a stream that sends nothing is cut, an idle silo's long-poll is held
until there is work, and the health service answers only certificates the gate admits."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from security import pki, tls
from security.crl import RevocationList
from security.gate import PeerGate
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_client.hub_link import retry_after_s, upload_refused
from silo_core.tensors import encode, sha256_hex
from silo_server.hub import Hub
from silo_server.wire.servicer import (
    OPEN_CALL_RETRY_S,
    CallLimits,
    FederationServer,
    FederationServicer,
    Rate,
)
from tests.conftest import wait_for
from tests.silo_server.test_hub import make_hub

RUN = {"algorithm": "mean", "model": "small_cnn", "num_classes": 10, "in_channels": 1, "image_size": 28,
       "algorithm_options": {}, "mean": [0.5], "std": [0.5], "max_upload_bytes": 1 << 20, "chunk_bytes": 1 << 16}
LONG_POLL_S = 30.0


@dataclass
class Federation:
    hub: Hub
    server: FederationServer
    servicer: FederationServicer
    stubs: dict[str, silo_pb2_grpc.FederationStub]
    channels: dict[str, grpc.Channel]
    ca: Path
    hub_bundle: Path
    port: int


@pytest.fixture
def federation(tmp_path) -> Iterator[Federation]:
    ca = pki.init_ca(tmp_path / "ca")
    hub_bundle = pki.issue_hub(ca, tmp_path / "hub")
    hub = make_hub(tmp_path / "state", run_description=RUN, min_silos=2, deadline_s=600)
    gate = PeerGate(revocations=RevocationList(hub_bundle / "crl.pem", hub_bundle / "ca.pem"))
    servicer = FederationServicer(hub, LONG_POLL_S, 1 << 16, gate, header_timeout_s=1.0, stream_idle_s=1.0,
                                  limits=CallLimits(warn_every_s=60.0))
    server = FederationServer(servicer)
    port = server.add_port("127.0.0.1:0", tls.ReloadingServerCredentials(hub_bundle).credentials)
    server.start()
    stubs, channels = {}, {}
    for name in ("attacker", "honest"):
        channels[name] = tls.secure_channel(f"127.0.0.1:{port}", pki.issue_silo(ca, name, tmp_path / name))
        stubs[name] = silo_pb2_grpc.FederationStub(channels[name])
        stubs[name].Join(silo_pb2.JoinRequest(num_unlabeled=10, device="cpu"), timeout=5)
    yield Federation(hub, server, servicer, stubs, channels, ca, hub_bundle, port)
    hub.stop()
    for channel in channels.values():
        channel.close()
    server.stop(0)


def start_round(hub: Hub) -> threading.Thread:
    """Run round 1 in the background until it completes or the fixture stops the hub."""
    state = hub.rounds.resume_or_init()

    def run():
        try:
            hub.rounds.run_round(state)
        except InterruptedError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _poll(stub, hub, timeout=60.0):
    return stub.NextTask.future(silo_pb2.NextTaskRequest(run_id=hub.run_id), timeout=timeout)


def _code(future) -> grpc.StatusCode | None:
    try:
        future.result()
        return None
    except grpc.RpcError as err:
        return err.code()


def stalled_upload(f: Federation):
    """Round 1 opened and the attacker's task taken: (an upload stream that sends its header and 8 bytes, then waits
    until the event is set; the payload it announced; that event)."""
    start_round(f.hub)
    task = _poll(f.stubs["attacker"], f.hub, timeout=10).result()
    payload = encode({"delta/x": torch.ones(3), "weight": torch.ones(1)})
    header = silo_pb2.UploadHeader(run_id=f.hub.run_id, task_id=task.task_id, round=task.round,
                                   total_bytes=len(payload), sha256=sha256_hex(payload))
    gap = threading.Event()

    def stalls() -> Iterator[silo_pb2.UploadMessage]:
        yield silo_pb2.UploadMessage(header=header)
        yield silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=0, data=payload[:8]))
        gap.wait(60)

    return stalls, payload, gap


def test_one_silo_flooding_long_polls_gets_one_and_everyone_else_is_still_served(federation, caplog):
    f = federation
    flood = [_poll(f.stubs["attacker"], f.hub) for _ in range(200)]
    # Refused at once; one long-poll stays held. Waited for by count, not by a sleep, so a loaded machine that
    # answers the refusals slowly cannot fail it.
    wait_for(lambda: sum(x.done() for x in flood) >= 199, 60, "199 refusals")
    time.sleep(0.2)  # nothing more is answered: the held one waits for work
    refused = [x for x in flood if x.done()]
    assert len(refused) == 199
    assert {_code(x) for x in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert "too many calls open from silo attacker" in refused[0].exception().details()
    # ... saying when to try again, so a silo never takes it for "received and refused" (a dropped upload)
    assert {retry_after_s(x.exception()) for x in refused} == {OPEN_CALL_RETRY_S}
    assert not upload_refused(refused[0].exception())
    # the other silo and the health service are served as if nothing happened
    honest = _poll(f.stubs["honest"], f.hub, timeout=5)
    assert honest.result().kind == silo_pb2.Task.WAIT
    health = health_pb2_grpc.HealthStub(f.channels["honest"])
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert f.servicer.limits.refused == {"attacker": 199} and f.hub.registry.refusals["too_many_calls"] == 199
    burst = [r for r in caplog.records if "more calls open than allowed" in r.getMessage()]
    assert len(burst) == 1 and burst[0].levelno == logging.WARNING  # one line for the burst, not 199
    # the held one is answered (the hub opens a round: both silos are sampled) and its slot is freed. Picked out
    # before the round opens: the answer can arrive before the next line runs.
    (held,) = [x for x in flood if not x.done()]
    start_round(f.hub)
    assert held.result(timeout=10).kind == silo_pb2.Task.TRAIN
    assert _poll(f.stubs["attacker"], f.hub, timeout=5).result().kind == silo_pb2.Task.TRAIN


def test_an_upload_that_sends_no_header_or_stops_sending_is_cut(federation):
    f = federation
    stop = threading.Event()

    def silent() -> Iterator[silo_pb2.UploadMessage]:
        stop.wait(30)  # opens the stream, sends nothing
        return
        yield

    started = time.time()
    flood = [f.stubs["attacker"].Upload.future(silent(), timeout=30) for _ in range(50)]
    # 49 refused at once, the one let in cut by the hub's header timeout (1 s), not the client's 30 s: waited for
    # by outcome, so a loaded machine that answers the refusals slowly cannot fail it.
    wait_for(lambda: all(x.done() for x in flood), 20, "every upload answered")
    codes = [_code(x) for x in flood]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 49
    (held,) = [x for x, code in zip(flood, codes, strict=True) if code != grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert _code(held) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no upload header within 1 s" in held.exception().details() and time.time() - started < 25
    stop.set()

    # A stream that sends its header and then goes quiet is cut at the idle limit.
    stalls, _, gap = stalled_upload(f)
    with pytest.raises(grpc.RpcError) as info:
        f.stubs["attacker"].Upload(stalls(), timeout=30)
    gap.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no chunk for 1 s" in info.value.details()
    assert f.hub.registry.refusals["stream_idle"] == 2 and f.hub.rounds.task.reported == set()


def test_an_upload_stalled_between_chunks_lets_go_of_its_budget_when_its_round_closes(federation):
    # The stream was checked for the round's close only when a chunk came: a silo pausing just under the idle limit
    # held its room in the upload budget into the next round, where honest uploads queued behind it.
    f = federation
    f.servicer.stream_idle_s = 60.0  # far longer than the test
    stalls, payload, gap = stalled_upload(f)
    call = f.stubs["attacker"].Upload.future(stalls(), timeout=60)
    budget = f.hub.intake.upload_budget
    wait_for(lambda: budget.held == len(payload), 10, "the stream's room held")
    with f.hub.rounds.cond:  # the round closes (its deadline, or its quorum wait)
        f.hub.rounds.task.open = False
    closed = time.time()
    wait_for(lambda: budget.held == 0, 10, "the room given back")
    assert time.time() - closed < 5
    assert _code(call) == grpc.StatusCode.FAILED_PRECONDITION and "round closed" in call.exception().details()
    gap.set()


def test_an_idle_silo_is_held_until_there_is_work(federation):
    f = federation
    polls = []
    started = time.time()
    polls.append(_poll(f.stubs["honest"], f.hub))
    other = _poll(f.stubs["attacker"], f.hub)
    time.sleep(2.0)
    assert not polls[0].done()  # held, not answered WAIT at once
    assert f.hub.registry.live_silos() == ["attacker", "honest"]  # a silo in a long-poll is live
    start_round(f.hub)
    assert polls[0].result(timeout=10).kind == silo_pb2.Task.TRAIN  # answered when the round opened
    assert other.result(timeout=10).kind == silo_pb2.Task.TRAIN
    assert time.time() - started < LONG_POLL_S


def test_health_answers_only_admitted_certificates(federation, tmp_path):
    f = federation
    health = health_pb2_grpc.HealthStub(f.channels["attacker"])
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    pki.revoke(f.ca, "attacker")
    shutil.copy(f.ca / "crl.pem", f.hub_bundle / "crl.pem")
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert health_pb2_grpc.HealthStub(f.channels["honest"]).Check(
        health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_a_revoked_silo_that_keeps_calling_is_counted_each_time_and_logged_once(federation, caplog):
    f = federation
    pki.revoke(f.ca, "attacker")
    shutil.copy(f.ca / "crl.pem", f.hub_bundle / "crl.pem")
    wakes = []  # each wake re-runs every waiting silo's long-poll
    f.hub.cond.listeners.append(lambda: wakes.append(1))
    try:
        codes = [_code(_poll(f.stubs["attacker"], f.hub, timeout=5)) for _ in range(30)]
    finally:
        f.hub.cond.listeners.pop()
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
    assert f.hub.registry.refusals["revoked"] == 30
    assert len(wakes) <= 2  # its eviction, once: not one wake-all per refused call
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused revoked from attacker")]
    assert len(lines) == 1  # not 30


def test_a_call_with_a_revoked_old_certificate_leaves_the_silos_new_session_alone(federation, tmp_path):
    # The gate refused by name: one call with an old, revoked certificate (the thief's, or a forgotten process)
    # evicted the silo that had since joined with its new one, out of its round and its session serial cleared.
    f = federation
    old_stub = f.stubs["honest"]
    pki.revoke(f.ca, "honest")  # the key was stolen: every certificate of that name so far
    shutil.copy(f.ca / "crl.pem", f.hub_bundle / "crl.pem")
    assert _code(_poll(old_stub, f.hub, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert f.hub.registry.silos["honest"].serial is None  # the session it held was that certificate's: evicted
    new_channel = tls.secure_channel(f"127.0.0.1:{f.port}", pki.issue_silo(f.ca, "honest", tmp_path / "honest-new"))
    try:
        new_stub = silo_pb2_grpc.FederationStub(new_channel)
        new_stub.Join(silo_pb2.JoinRequest(num_unlabeled=10, device="cpu"), timeout=5)
        live = f.hub.registry.silos["honest"].serial
        assert live is not None and f.hub.registry.silos["honest"].last_seen > 0
        assert _code(_poll(old_stub, f.hub, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        assert f.hub.registry.silos["honest"].serial == live and f.hub.registry.silos["honest"].last_seen > 0
        assert "honest" in f.hub.registry.live_silos()
    finally:
        new_channel.close()


def test_a_token_bucket_per_silo_and_call_refuses_past_its_rate_and_says_when_to_retry():
    now = [100.0]
    limits = CallLimits(rates={"NextTask": Rate(5.0, 20.0)}, clock=lambda: now[0])
    granted = 0
    for _ in range(25):  # back to back: the burst of 20 passes, the rest is refused
        refused = limits.acquire("a", "NextTask")
        if refused is None:
            granted += 1
            limits.release("a", "NextTask")
    assert granted == 20 and limits.refused == {"a": 5}
    refused = limits.acquire("a", "NextTask")
    # the hub holds the refusal until a token is free (0.2 s at 5 a second), so nothing is left to wait
    assert refused.reason == "call_rate" and refused.pause_s == pytest.approx(0.2) and refused.retry_after_s == 0
    assert limits.acquire("b", "NextTask") is None  # another silo has a bucket of its own
    now[0] += 0.2  # one token refilled
    assert limits.acquire("a", "NextTask") is None


def test_a_flood_of_calls_is_refused_at_its_rate_paused_logged_once_and_counted_per_silo(federation, caplog):

    f = federation
    f.servicer.limits.rates = {**f.servicer.limits.rates, "Join": Rate(1.0, 5.0)}
    f.servicer.limits.tokens.clear()
    stop = threading.Event()
    codes: list[grpc.StatusCode] = []
    waits: list[float | None] = []

    def flood():  # one certificate, unary calls back to back on 4 threads
        while not stop.is_set():
            try:
                f.stubs["attacker"].Join(silo_pb2.JoinRequest(num_unlabeled=10, device="cpu"), timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
                if "calls faster than allowed" in err.details():
                    waits.append(retry_after_s(err))

    with caplog.at_level(logging.INFO, logger="silo_server"):
        threads = [threading.Thread(target=flood) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(4.0)
        started = time.time()  # the honest silo is served at once while the flood goes on
        honest = f.stubs["honest"].Join(silo_pb2.JoinRequest(num_unlabeled=10, device="cpu"), timeout=5)
        honest_s = time.time() - started
        stop.set()
        for t in threads:
            t.join(10)
    assert honest.silo_id == "honest" and honest_s < 1.0
    refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    # Paused refusals: 4 threads back to back make a few calls a second, not thousands (the burst of 5, then
    # about one a second granted; each refusal held until a token would be free, at most 1 s).
    assert refused >= 4 and len(codes) < 100 and codes.count(grpc.StatusCode.OK) <= 5 + 6
    assert waits and all(w is not None and w <= 1.0 for w in waits)  # each rate refusal says how long is left
    by_silo = f.hub.registry.refusals_by_silo
    assert by_silo[("attacker", "call_rate")] == len(waits) == f.hub.registry.refusals["call_rate"]
    assert by_silo[("attacker", "call_rate")] + by_silo.get(("attacker", "too_many_calls"), 0) == refused
    lines = [r for r in caplog.records if "attacker" in r.getMessage()]
    assert len(lines) <= 3, [r.getMessage() for r in lines]  # one WARNING per reason for the burst, no join lines
    assert sum("calls faster than allowed" in r.getMessage() for r in lines) == 1
