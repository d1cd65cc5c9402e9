"""The servicer under fire: hostile messages through a real gRPC server with mutual TLS on 127.0.0.1, built as the
hub app builds it (reloading credentials, the peer gate with a CRL, message caps). Every hostile call is refused
with a status, counted, and leaves the hub exactly as it was; afterwards honest silos finish the round."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from security import pki, tls
from security.crl import RevocationList
from security.gate import PeerGate
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_server.hub import Hub
from silo_server.wire.servicer import CallLimits, FederationServer, FederationServicer
from tests.silo_server import hostile
from tests.silo_server.test_hub import make_hub, start_round
from tests.silo_server.test_hub_security import same, snapshot

CHUNK_CAP = 1 << 16
RUN = {"algorithm": "mean", "model": "small_cnn", "num_classes": 10, "in_channels": 1, "image_size": 28,
       "algorithm_options": {}, "mean": [0.5], "std": [0.5], "max_upload_bytes": 1 << 20, "chunk_bytes": CHUNK_CAP}
_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@dataclass
class Wire:
    hub: Hub
    stubs: dict[str, silo_pb2_grpc.FederationStub]  # by silo id; "stranger" has a valid certificate, never joined
    sampled: list[str]
    outsider: str
    task: silo_pb2.Task


@pytest.fixture(scope="module")
def wire(tmp_path_factory) -> Iterator[Wire]:
    root = tmp_path_factory.mktemp("servicer-fuzz")
    ca = pki.init_ca(root / "ca")
    hub_bundle = pki.issue_hub(ca, root / "hub")
    hub = make_hub(root / "state", run_description=RUN, min_silos=3, deadline_s=600,
                   max_update_norm=hostile.MAX_NORM, max_upload_bytes=1 << 20)
    hub.rounds.sampling = dataclasses.replace(hub.rounds.sampling, count=2)
    gate = PeerGate(revocations=RevocationList(hub_bundle / "crl.pem", hub_bundle / "ca.pem"))
    # Hundreds of calls a second from one silo are the fuzzer's pace, not an attack to refuse here: no call rates
    # (tests/silo_server/test_servicer_limits.py tests them).
    server = FederationServer(FederationServicer(hub, 0.5, CHUNK_CAP, gate, limits=CallLimits(rates={})), options=[
        ("grpc.max_receive_message_length", CHUNK_CAP + (64 << 10))])
    port = server.add_port("127.0.0.1:0", tls.ReloadingServerCredentials(hub_bundle).credentials)
    server.start()
    channels, stubs = [], {}
    for name in ("a", "b", "c", "stranger"):
        channel = tls.secure_channel(f"127.0.0.1:{port}", pki.issue_silo(ca, name, root / name))
        channels.append(channel)
        stubs[name] = silo_pb2_grpc.FederationStub(channel)
    for name in ("a", "b", "c"):
        reply = stubs[name].Join(silo_pb2.JoinRequest(num_unlabeled=hostile.IMAGES, device="cpu"), timeout=5)
        assert reply.silo_id == name
    thread, out = start_round(hub)
    task = None
    while task is None or task.kind != silo_pb2.Task.TRAIN:
        task = stubs["a"].NextTask(silo_pb2.NextTaskRequest(run_id=hub.run_id), timeout=5)
        if task.kind != silo_pb2.Task.TRAIN:
            task = stubs["b"].NextTask(silo_pb2.NextTaskRequest(run_id=hub.run_id), timeout=5)
    sampled = sorted(hub.rounds.task.sampled)
    w = Wire(hub, stubs, sampled, ({"a", "b", "c"} - set(sampled)).pop(), task)
    yield w
    # The server survived everything and still does its job: honest uploads over the wire finish the round.
    for silo, value in zip(sampled, (1.0, 3.0), strict=True):
        header, payload = hostile.valid_upload(hub.run_id, task.task_id, task.round,
                                               {"delta/x": torch.full((3,), value), "weight": torch.ones(1)})
        assert stubs[silo].Upload(iter(_messages(header, hostile._chunks(payload))), timeout=5).accepted
    thread.join(10)
    assert torch.equal(out["state"].tensors["model/x"], torch.full((3,), 2.0))
    for channel in channels:
        channel.close()
    server.stop(0)


def _messages(header: dict, chunks: list) -> list[silo_pb2.UploadMessage]:
    h = silo_pb2.UploadHeader(run_id=header["run_id"], task_id=header["task_id"], round=header["round"],
                              total_bytes=header["total_bytes"], sha256=header["sha256"], skipped=header["skipped"],
                              metrics=header["metrics"])
    return [silo_pb2.UploadMessage(header=h)] + [
        silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=o, data=d)) for o, d in chunks]


def _refused(hub: Hub, call) -> tuple[str, str]:
    """Make the call; it must fail. Returns (status code, the refusal reason the hub counted)."""
    before = dict(hub.registry.refusals)
    with pytest.raises(grpc.RpcError) as info:
        call()
    counted = [r for r in hub.registry.refusals if hub.registry.refusals[r] != before.get(r, 0)]
    refusals = hub.registry.refusals
    assert len(counted) == 1 and refusals[counted[0]] == before.get(counted[0], 0) + 1, (before, refusals)
    return info.value.code().name, counted[0]


@_FUZZ
@given(data=st.data())
def test_fuzz_hostile_uploads_over_the_wire(wire: Wire, data) -> None:
    hub = wire.hub
    header, payload = hostile.valid_upload(hub.run_id, wire.task.task_id, wire.task.round)
    attack = data.draw(hostile.hostile_upload(header, payload, proto=True), label="attack")
    silo = data.draw(st.sampled_from(wire.sampled + [wire.outsider, "stranger"]), label="silo")
    before = snapshot(hub)
    code, reason = _refused(hub, lambda: wire.stubs[silo].Upload(iter(_messages(attack.header, attack.chunks)),
                                                                 timeout=5))
    expected = attack.reasons | {wire.outsider: {"not_sampled"}, "stranger": {"not_joined"}}.get(silo, set())
    assert reason in expected, (reason, hostile.describe(attack))
    assert code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "PERMISSION_DENIED")
    assert same(before, snapshot(hub))


_UPLOAD_MESSAGE = st.one_of(
    st.builds(lambda r, t, n, b, s, sk, m: silo_pb2.UploadMessage(header=silo_pb2.UploadHeader(
        run_id=r, task_id=t, round=n, total_bytes=b, sha256=s, skipped=sk, metrics=m)),
        st.text(max_size=40), st.text(max_size=40), st.integers(-2**63, 2**63 - 1), st.integers(-2**63, 2**63 - 1),
        st.text(max_size=70), st.booleans(), st.dictionaries(st.text(max_size=10), st.floats(), max_size=4)),
    st.builds(lambda o, d: silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=o, data=d)),
              st.integers(-2**63, 2**63 - 1), st.binary(max_size=64)),
    st.just(silo_pb2.UploadMessage()),  # neither header nor chunk
)


@_FUZZ
@given(messages=st.lists(_UPLOAD_MESSAGE, max_size=6), silo=st.sampled_from(["a", "b", "c"]))
def test_fuzz_random_message_streams(wire: Wire, messages, silo) -> None:
    """Streams of random messages: no header first, headers twice, bare chunks, empty messages, nothing."""
    before = snapshot(wire.hub)
    code, _ = _refused(wire.hub, lambda: wire.stubs[silo].Upload(iter(messages), timeout=5))
    assert code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "PERMISSION_DENIED")
    assert same(before, snapshot(wire.hub))


_BAD_TEXT = st.one_of(st.text(min_size=65, max_size=200), st.text(min_size=1, max_size=20).filter(
    lambda t: any(not ("\x20" <= c <= "\x7e") for c in t)))
_BAD_COUNT = st.one_of(st.integers(-2**63, -1), st.integers(10**9 + 1, 2**63 - 1))


@st.composite
def bad_join(draw) -> silo_pb2.JoinRequest:
    fields = {"num_unlabeled": 5, "num_labeled": 0, "skipped_images": 0, "device": "cpu", "client_version": "0.1",
              "capabilities": ["semifl"]}
    broken = draw(st.sampled_from(sorted(fields)))
    if broken in ("num_unlabeled", "num_labeled", "skipped_images"):
        fields[broken] = draw(_BAD_COUNT)
    elif broken == "capabilities":
        fields[broken] = draw(st.one_of(st.lists(st.just("x"), min_size=33, max_size=40),
                                        st.lists(_BAD_TEXT, min_size=1, max_size=3)))
    else:
        fields[broken] = draw(_BAD_TEXT)
    return silo_pb2.JoinRequest(**fields)


@_FUZZ
@given(data=st.data())
def test_fuzz_join_next_task_and_download(wire: Wire, data) -> None:
    hub = wire.hub
    silo = data.draw(st.sampled_from(["a", "b", "c", "stranger"]), label="silo")
    stub = wire.stubs[silo]
    call = data.draw(st.sampled_from(["join", "next", "download"]), label="call")
    ids = st.text(max_size=200)
    if call == "join":
        request = data.draw(bad_join(), label="join")
        rpc = lambda: stub.Join(request, timeout=5)  # noqa: E731
    elif call == "next":
        run_id = data.draw(ids.filter(lambda r: r != hub.run_id), label="run_id")
        rpc = lambda: stub.NextTask(silo_pb2.NextTaskRequest(run_id=run_id), timeout=5)  # noqa: E731
    else:
        run_id = data.draw(st.one_of(st.just(hub.run_id), ids), label="run_id")
        task_id = data.draw(ids.filter(lambda t: t != wire.task.task_id or run_id != hub.run_id), label="task_id")
        rpc = lambda: list(stub.Download(silo_pb2.DownloadRequest(run_id=run_id, task_id=task_id),  # noqa: E731
                                         timeout=5))
    before = snapshot(hub)
    code, reason = _refused(hub, rpc)
    assert code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED"), (code, reason)
    assert same(before, snapshot(hub))
