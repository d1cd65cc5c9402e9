"""Attacks on a running federation over real mutual TLS on loopback: each is refused with the expected status,
and the run finishes with exactly the model and history of the same run without attacks.

Setup (twice: a baseline and an attacked run, same data and seed): a `silo-server` process, two `silo-client`
processes (silo-001, silo-002) and silo-003 driven from this test with the real SiloClient code. Silo-003 is
the round's last reporter every time (it uploads after the other two), so the order of the hub's sums is the
same in both runs and the results must match bit for bit. While silo-003 holds a round open the attacks run:

- handshake: no client certificate, a foreign CA's certificate, an expired certificate -> UNAVAILABLE
- silo-005 joins, is revoked while the hub runs, and is refused from its next call on -> UNAUTHENTICATED
- silo-004 (valid certificate, not on the allowlist) -> PERMISSION_DENIED
- silo-001 uploads again into round 2, "for" silo-003's still open slot -> ALREADY_EXISTS
- silo-003 replays its round-1 upload -> FAILED_PRECONDITION
- oversized streams -> RESOURCE_EXHAUSTED; NaN values, a wrong shape, a huge norm, a negative weight ->
  INVALID_ARGUMENT
- `openssl s_client` without a client certificate gets no application data; with one it completes a real call

The hub's certificate is also renewed mid-run and served to new connections without a restart.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import socket
import ssl
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from safetensors.torch import load_file

from security import pki, tls
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_client.client import SiloClient, SiloSettings
from silo_core.tensors import DTYPES, encode, iter_chunks, sha256_hex
from silo_sim.stage import StagedFederation, stage_federation
from tests.conftest import Processes, free_port, wait_for

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}
ROUNDS = 2
ALLOWED = ["silo-001", "silo-002", "silo-003", "silo-005"]
MAX_NORM = 50.0
TIMEOUT = 10.0


@dataclass
class Run:
    staged: StagedFederation
    history: list[dict]
    model: dict[str, torch.Tensor]
    hub_log: str
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)  # attack -> (status code, details)
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- the federation


def _stage(root: Path, port: int) -> StagedFederation:
    staged = stage_federation(
        root, num_silos=3, labels_per_class=2, unlabeled_limit=48, test_per_class=3, seed=3,
        hub_config={
            "run": {"threads": 1, "device": "cpu"},
            "server": {"port": port, "long_poll_s": 1.0, "linger_s": 2.0},
            "algorithm": {"name": "semifl", "options": TINY},
            "rounds": {"total": ROUNDS, "min_silos": 3, "quorum": 1.0, "deadline_s": 240},
            "security": {"allowed_silos": ALLOWED, "max_update_norm": MAX_NORM},
        },
    )
    return staged


def _client(staged: StagedFederation, port: int) -> SiloClient:
    spec = staged.silos[2]
    return SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=spec.certs, data=spec.data, device="cpu",
                                   state_dir=spec.state_dir, sim_labels=spec.labels, name=spec.name))


def _next_train(client: SiloClient, round_: int) -> silo_pb2.Task:
    def poll():
        task = client.stub.NextTask(silo_pb2.NextTaskRequest(run_id=client.run.run_id), timeout=30)
        return task if task.kind == silo_pb2.Task.TRAIN and task.round == round_ else None

    return wait_for(poll, 240, f"silo-003's task for round {round_}", poll=0.05)


def _run(root: Path, procs: Processes, attack: bool) -> Run:
    port = free_port()
    staged = _stage(root, port)
    hub = procs.start(f"hub-{root.name}", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    silos = [
        procs.start(f"{s.name}-{root.name}", "-m", "silo_client.cli", "--data", str(s.data), "--certs", str(s.certs),
                    "--hub", f"127.0.0.1:{port}", "--state-dir", str(s.state_dir), "--sim-labels", str(s.labels),
                    "--threads", "1", "--device", "cpu", "--connect-timeout", "120")
        for s in staged.silos[:2]
    ]
    # Dial only once the hub listens, or the channel's reconnect backoff would add seconds to the test.
    wait_for(lambda: "hub listening on" in procs.log(f"hub-{root.name}") or hub.poll() is not None, 120,
             "the hub to listen")
    client = _client(staged, port)
    outcomes: dict[str, tuple[str, str]] = {}
    extra: dict = {}
    recorded: list[list[silo_pb2.UploadMessage]] = []
    try:
        wait_for(lambda: _joined(client), 120, "the hub to accept silo-003")
        for r in range(1, ROUNDS + 1):
            task = _next_train(client, r)
            for s in staged.silos[:2]:
                wait_for(lambda s=s, r=r: f"round {r}: update sent" in procs.log(f"{s.name}-{root.name}"), 240,
                         f"{s.name} to report round {r}")
                assert hub.poll() is None, procs.log(f"hub-{root.name}")
            if attack and r == 1:
                _record_uploads(client, recorded)
            if attack and r == ROUNDS:
                outcomes, extra = _attack(staged, port, client, task, recorded[0])
            client._train(task)
        wait_for(lambda: client.stub.NextTask(silo_pb2.NextTaskRequest(run_id=client.run.run_id), timeout=30).kind
                 == silo_pb2.Task.DONE, 120, "the run to end")
        assert hub.wait(timeout=120) == 0, procs.log(f"hub-{root.name}")
        for s in silos:
            assert s.wait(timeout=60) == 0
    finally:
        client.close()
    history = json.loads((staged.hub_state_dir / "history.json").read_text())["rounds"]
    model = load_file(str(staged.hub_state_dir / "model.safetensors"))
    return Run(staged, history, model, procs.log(f"hub-{root.name}"), outcomes, extra)


def _joined(client: SiloClient) -> bool:
    try:
        client._join()
        return True
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False


def _record_uploads(client: SiloClient, recorded: list) -> None:
    real = client.stub.Upload

    def upload(messages, **kwargs):
        messages = list(messages)
        recorded.append(messages)
        return real(iter(messages), **kwargs)

    client.stub.Upload = upload


# ---------------------------------------------------------------------------------------------------- attacks


def _status(call) -> tuple[str, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
    return "OK", ""


def _creds(ca_pem: Path, bundle: Path | None) -> grpc.ChannelCredentials:
    """Hand-made credentials (security.tls would refuse to load an expired or mismatched bundle locally)."""
    if bundle is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem.read_bytes())
    return grpc.ssl_channel_credentials(root_certificates=ca_pem.read_bytes(),
                                        private_key=(bundle / "key.pem").read_bytes(),
                                        certificate_chain=(bundle / "cert.pem").read_bytes())


def _stub(port: int, creds: grpc.ChannelCredentials) -> tuple[grpc.Channel, silo_pb2_grpc.FederationStub]:
    channel = grpc.secure_channel(f"127.0.0.1:{port}", creds)
    return channel, silo_pb2_grpc.FederationStub(channel)


def _join(stub: silo_pb2_grpc.FederationStub):
    return stub.Join(silo_pb2.JoinRequest(client_version="x", num_unlabeled=10, device="cpu"), timeout=TIMEOUT)


def _messages(run_id: str, task: silo_pb2.Task, payload: bytes, **header) -> list[silo_pb2.UploadMessage]:
    fields = dict(run_id=run_id, task_id=task.task_id, round=task.round, total_bytes=len(payload),
                  sha256=sha256_hex(payload), metrics={"train_loss": 1.0})
    fields.update(header)
    out = [silo_pb2.UploadMessage(header=silo_pb2.UploadHeader(**fields))]
    out += [silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=o, data=d)) for o, d in iter_chunks(payload, 1 << 20)]
    return out


def _planned(task: silo_pb2.Task) -> dict[str, torch.Tensor]:
    """A well-formed (all zero) result with exactly the planned names, shapes and dtypes."""
    tensors = {s.name: torch.zeros(tuple(s.shape), dtype=DTYPES[s.dtype]) for s in task.expected}
    tensors["weight"] = torch.ones(1, dtype=DTYPES[next(s.dtype for s in task.expected if s.name == "weight")])
    return tensors


def _attack(staged: StagedFederation, port: int, client: SiloClient, task: silo_pb2.Task,
            replay: list[silo_pb2.UploadMessage]) -> tuple[dict[str, tuple[str, str]], dict]:
    ca, root = staged.ca_dir, staged.root / "attackers"
    ca_pem = ca / "ca.pem"
    run_id = client.run.run_id
    out: dict[str, tuple[str, str]] = {}
    extra: dict = {}

    # --- the handshake refuses these before any hub code runs
    foreign_ca = pki.init_ca(root / "foreign-ca", name="not the federation")
    foreign = pki.issue_silo(foreign_ca, "silo-002", root / "foreign")
    expired = pki.issue_silo(ca, "silo-002", root / "expired", days=30,
                             not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=40))
    for name, creds in (("no_certificate", _creds(ca_pem, None)), ("foreign_ca", _creds(ca_pem, foreign)),
                        ("expired", _creds(ca_pem, expired))):
        channel, stub = _stub(port, creds)
        with channel:
            out[name] = _status(lambda stub=stub: _join(stub))

    # --- revoked while the hub runs: accepted on one call, refused on the very next one (same connection)
    revoked = pki.issue_silo(ca, "silo-005", root / "silo-005")
    channel, stub = _stub(port, tls.channel_credentials(revoked))
    with channel:
        out["before_revocation"] = _status(lambda: _join(stub))
        pki.revoke(ca, "silo-005")
        shutil.copyfile(ca / "crl.pem", staged.root / "pki" / "hub" / "crl.pem")  # what the operator copies
        out["revoked_same_connection"] = _status(
            lambda: stub.NextTask(silo_pb2.NextTaskRequest(run_id=run_id), timeout=TIMEOUT))
    channel, stub = _stub(port, tls.channel_credentials(revoked))
    with channel:
        out["revoked_new_connection"] = _status(lambda: _join(stub))

    # --- a valid certificate that is not on the allowlist
    outsider = pki.issue_silo(ca, "silo-004", root / "silo-004")
    channel, stub = _stub(port, tls.channel_credentials(outsider))
    with channel:
        out["not_allowed"] = _status(lambda: _join(stub))

    # --- silo-001 (reported round 2 already) uploads into the round again, while silo-003's slot is open
    channel, stub = _stub(port, tls.channel_credentials(staged.silos[0].certs))
    with channel:
        out["a_for_b"] = _status(lambda: stub.Upload(iter(_messages(run_id, task, encode(_planned(task)))),
                                                     timeout=TIMEOUT))

    # --- silo-003 itself: replays, oversized streams, poisoned payloads; none may take its slot
    def upload(messages):
        return _status(lambda: client.stub.Upload(iter(messages), timeout=TIMEOUT))

    out["replay"] = upload(replay)
    good = encode(_planned(task))
    out["oversized_announced"] = upload(_messages(run_id, task, b"", total_bytes=600 << 20, sha256="0" * 64))
    longer = _messages(run_id, task, good) + [silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=len(good),
                                                                                          data=b"x" * 1024))]
    out["oversized_stream"] = upload(longer)
    out["larger_than_plan"] = upload(_messages(run_id, task, good, total_bytes=len(good) + (64 << 10)))
    head = _messages(run_id, task, b"", total_bytes=6 << 20, sha256="0" * 64)
    out["oversized_message"] = upload(head + [silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=0,
                                                                                         data=b"x" * (6 << 20)))])
    nan = _planned(task)
    first = next(iter(nan))
    nan[first].view(-1)[0] = float("nan")
    out["nan"] = upload(_messages(run_id, task, encode(nan)))
    shape = _planned(task)
    shape[first] = torch.zeros(shape[first].numel() + 1)
    out["wrong_shape"] = upload(_messages(run_id, task, encode(shape)))
    huge = _planned(task)
    huge[first].view(-1)[0] = 10 * MAX_NORM
    out["norm"] = upload(_messages(run_id, task, encode(huge)))
    negative = _planned(task)
    negative["weight"] = torch.tensor([-1.0])
    out["negative_weight"] = upload(_messages(run_id, task, encode(negative)))

    # --- the hub's certificate renewed while it runs: new connections get the new one, no restart
    hub_bundle = staged.root / "pki" / "hub"
    extra["hub_serial_before"] = _served_serial(port, staged.silos[0].certs)
    renewed = pki.renew(ca, "hub", out_dir=root / "hub-renewed")
    for name in ("key.pem", "cert.pem"):  # as the operator would: over the running hub's bundle
        shutil.copyfile(renewed / name, hub_bundle / name)
    extra["hub_serial_renewed"] = x509.load_pem_x509_certificate((renewed / "cert.pem").read_bytes()).serial_number
    extra["hub_serial_after"] = _served_serial(port, staged.silos[0].certs)

    # --- openssl s_client: without a client certificate no call completes; with one, a real Health/Check does
    extra["openssl_without"] = _openssl_call(port, ca_pem, None)
    extra["openssl_with"] = _openssl_call(port, ca_pem, staged.silos[0].certs)
    return out, extra


def _served_serial(port: int, bundle: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(bundle / "ca.pem"))
    ctx.load_cert_chain(bundle / "cert.pem", bundle / "key.pem")
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as conn:
        return x509.load_der_x509_certificate(conn.getpeercert(binary_form=True)).serial_number


def _h2_health_check() -> bytes:
    """The bytes of one gRPC call over HTTP/2 (grpc.health.v1.Health/Check, empty request), written by hand."""
    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload

    def literal(name: str, value: str) -> bytes:  # HPACK literal header field without indexing, no Huffman
        return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

    headers = b"".join(literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "https"), (":path", "/grpc.health.v1.Health/Check"),
        (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")))
    return (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, headers)
            + frame(0, 1, 1, b"\x00\x00\x00\x00\x00"))


def _openssl_call(port: int, ca_pem: Path, bundle: Path | None) -> tuple[bytes, str]:
    """(application bytes the hub sent back, stderr) for one raw call through `openssl s_client`."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command line tool is required for this test (apt-get install openssl)")
    # -quiet: print only what the hub sends; -no_ign_eof: hang up when our input ends (-quiet would wait on).
    args = ["openssl", "s_client", "-quiet", "-no_ign_eof", "-connect", f"127.0.0.1:{port}", "-CAfile",
            str(ca_pem), "-alpn", "h2", "-verify_return_error"]
    if bundle is not None:
        args += ["-cert", str(bundle / "cert.pem"), "-key", str(bundle / "key.pem")]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(_h2_health_check())
    proc.stdin.flush()
    time.sleep(1.5)  # keep stdin open while the hub answers; s_client quits at stdin EOF
    proc.stdin.close()
    proc.stdin = None  # so communicate() does not flush it again
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    return stdout, stderr.decode(errors="replace")


# ----------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    root = tmp_path_factory.mktemp("security-e2e")
    logs = root / "logs"
    logs.mkdir()
    procs = Processes(logs)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # silo-003 trains in this process: same arithmetic as the silo processes
    try:
        baseline = _run(root / "baseline", procs, attack=False)
        attacked = _run(root / "attacked", procs, attack=True)
    finally:
        torch.set_num_threads(torch_threads)
        procs.stop_all()
    return baseline, attacked


def test_the_attacked_run_ends_exactly_like_the_undisturbed_one(runs: tuple[Run, Run]) -> None:
    baseline, attacked = runs
    assert [h["round"] for h in attacked.history] == list(range(1, ROUNDS + 1))

    def stable(h: dict) -> dict:  # wall-clock times and process memory differ between any two runs
        return {k: v for k, v in h.items() if "seconds" not in k and "rss" not in k}

    assert [stable(h) for h in attacked.history] == [stable(h) for h in baseline.history]
    for h in attacked.history:
        assert h["silos_reported"] == 3 and h["attempt"] == 1 and h["aggregated_weight"] == 3.0
    assert attacked.model.keys() == baseline.model.keys()
    for name, tensor in baseline.model.items():
        assert torch.equal(attacked.model[name], tensor), name
    assert "refused" not in baseline.hub_log


def test_handshake_refuses_missing_foreign_and_expired_certificates(runs: tuple[Run, Run]) -> None:
    outcomes = runs[1].outcomes
    for attack in ("no_certificate", "foreign_ca", "expired"):
        assert outcomes[attack][0] == "UNAVAILABLE", (attack, outcomes[attack])
    # gRPC core's own lines about them (a foreign format, a misleading cause, no peer) stay out of the hub's log
    assert "ssl_transport_security" not in runs[1].hub_log and "Handshake failed" not in runs[1].hub_log


def test_a_certificate_revoked_while_the_hub_runs_is_refused_from_its_next_call(runs: tuple[Run, Run]) -> None:
    outcomes, log = runs[1].outcomes, runs[1].hub_log
    assert outcomes["before_revocation"] == ("OK", "")
    for attack in ("revoked_same_connection", "revoked_new_connection"):
        code, details = outcomes[attack]
        assert code == "UNAUTHENTICATED" and "silo-005" in details and "revoked" in details
    assert "revocation list" in log and "reloaded: 1 revoked certificates (was 0)" in log
    assert "refused revoked from silo-005" in log


def test_allowlist_and_acting_for_another_silo(runs: tuple[Run, Run]) -> None:
    outcomes = runs[1].outcomes
    code, details = outcomes["not_allowed"]
    assert code == "PERMISSION_DENIED" and "silo-004" in details and "security.allowed_silos" in details
    code, details = outcomes["a_for_b"]
    assert code == "ALREADY_EXISTS" and "silo-001 already reported round 2" in details


def test_replays_oversized_streams_and_poisoned_updates(runs: tuple[Run, Run]) -> None:
    outcomes = runs[1].outcomes
    expected = {
        "replay": ("FAILED_PRECONDITION", "not the current open task"),
        "oversized_announced": ("RESOURCE_EXHAUSTED", "exceeds this hub's cap"),
        "oversized_stream": ("RESOURCE_EXHAUSTED", "longer than the"),
        # Announced within the hub's cap, but more than the planned tensors take: refused before any buffering.
        "larger_than_plan": ("RESOURCE_EXHAUSTED", "the round's planned tensors can take"),
        "oversized_message": ("RESOURCE_EXHAUSTED", ""),  # its 6 MB header announcement, or gRPC's message cap
        "nan": ("INVALID_ARGUMENT", "NaN"),
        "wrong_shape": ("INVALID_ARGUMENT", "has shape"),
        "norm": ("INVALID_ARGUMENT", "update norm 500 exceeds this hub's bound of 50"),
        "negative_weight": ("INVALID_ARGUMENT", "weight must be exactly 1 in this run (uniform averaging)"),
    }
    for attack, (code, words) in expected.items():
        assert outcomes[attack][0] == code and words in outcomes[attack][1], (attack, outcomes[attack])


def test_every_refusal_is_logged_with_the_peer_and_counted_by_reason(runs: tuple[Run, Run]) -> None:
    log = runs[1].hub_log
    counts = [json.loads(line.split("refusals so far: ", 1)[1]) for line in log.splitlines()
              if "refusals so far: " in line]
    # The 6 MB message's header announces more than the planned tensors take, so the hub refuses it as oversized
    # before gRPC's own message cap comes into play.
    assert counts[-1].pop("bad_stream", 0) == 0
    assert counts[-1] == {
        "revoked": 2, "not_allowed": 1, "duplicate": 1, "stale_task": 1, "oversized": 4, "non_finite": 1,
        "bad_tensors": 1, "update_norm": 1, "bad_weight": 1,
    }
    for reason, peer in (("not_allowed", "silo-004"), ("duplicate", "silo-001"), ("stale_task", "silo-003"),
                         ("non_finite", "silo-003"), ("update_norm", "silo-003")):
        assert f"refused {reason} from {peer}: " in log


def test_renewed_hub_certificate_is_served_to_new_connections_without_restart(runs: tuple[Run, Run]) -> None:
    extra, log = runs[1].extra, runs[1].hub_log
    assert extra["hub_serial_after"] == extra["hub_serial_renewed"] != extra["hub_serial_before"]
    assert f"hub certificate serial {extra['hub_serial_renewed']:x}: expires in 90.0 days" in log
    assert f"hub certificate serial {extra['hub_serial_before']:x}: expires in 90.0 days" in log
    assert "certificate days left: hub 90.0; 4 silos, soonest" in log  # 3 silos + silo-005 (joined, then revoked)


def test_openssl_s_client_without_a_client_certificate_cannot_complete_a_call(runs: tuple[Run, Run]) -> None:
    without, stderr = runs[1].extra["openssl_without"]
    assert without == b"", without  # not a single byte of HTTP/2 from the hub
    assert "error" in stderr or "alert" in stderr
    with_cert, _ = runs[1].extra["openssl_with"]
    # The same hand-written call with a silo certificate gets the gRPC answer: message SERVING (field 1 = 1) and
    # trailers with grpc-status 0.
    assert b"\x00\x00\x00\x00\x02\x08\x01" in with_cert and b"grpc-status" in with_cert
