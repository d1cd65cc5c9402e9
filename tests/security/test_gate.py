"""security.gate and the hub's TLS behaviour over real gRPC servers on 127.0.0.1: who is let in on each call,
what the handshake refuses, TLS versions, certificate reload, and the --insecure-dev-only channel."""

from __future__ import annotations

import datetime as dt
import shutil
import socket
import ssl
import time
import warnings
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from security import pki, tls
from security.crl import RevocationList
from security.gate import AccessDenied, PeerGate

_WHOAMI = "/silokit.test.Gate/WhoAmI"
_TIMEOUT = 5.0


def _serve(gate: PeerGate, credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, int]:
    """A server whose one method answers the caller's identity as the gate sees it, or the gate's refusal."""

    def whoami(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return gate.admit(context).silo_id.encode()
        except AccessDenied as e:
            context.abort(getattr(grpc.StatusCode, e.code), f"{e.reason}: {e.message}")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "silokit.test.Gate", {"WhoAmI": grpc.unary_unary_rpc_method_handler(whoami)})])
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def _call(channel: grpc.Channel, metadata=()) -> tuple[str, str]:
    try:
        return "OK", channel.unary_unary(_WHOAMI)(b"", timeout=_TIMEOUT, metadata=metadata).decode()
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


@pytest.fixture
def pki_dir(tmp_path: Path) -> dict[str, Path]:
    ca = pki.init_ca(tmp_path / "ca")
    return {"ca": ca, "hub": pki.issue_hub(ca, tmp_path / "hub"), "s1": pki.issue_silo(ca, "s1", tmp_path / "s1"),
            "s2": pki.issue_silo(ca, "s2", tmp_path / "s2"), "root": tmp_path}


@pytest.fixture
def hub(pki_dir) -> Iterator[tuple[int, tls.ReloadingServerCredentials, list[bytes]]]:
    loaded: list[bytes] = []
    creds = tls.ReloadingServerCredentials(pki_dir["hub"], on_load=loaded.append)
    gate = PeerGate(revocations=RevocationList(pki_dir["hub"] / "crl.pem", pki_dir["hub"] / "ca.pem"),
                    allowed_silos=["s1", "s-short"])
    server, port = _serve(gate, creds.credentials)
    yield port, creds, loaded
    server.stop(0)


def _channel(port: int, bundle: Path) -> grpc.Channel:
    return tls.secure_channel(f"127.0.0.1:{port}", bundle)


def test_identity_is_the_certificate_and_metadata_cannot_claim_another(pki_dir, hub) -> None:
    port, _, _ = hub
    with _channel(port, pki_dir["s1"]) as channel:
        assert _call(channel) == ("OK", "s1")
        assert _call(channel, metadata=[(tls.DEV_IDENTITY_KEY, "s2")]) == ("OK", "s1")  # ignored with TLS


def test_allowlist_refuses_a_valid_certificate_it_does_not_name(pki_dir, hub) -> None:
    port, _, _ = hub
    with _channel(port, pki_dir["s2"]) as channel:
        code, details = _call(channel)
    assert code == "PERMISSION_DENIED" and details.startswith("not_allowed: silo s2 is not on this hub's allowlist")


def test_revocation_applies_to_the_next_call_of_an_open_connection(pki_dir, hub) -> None:
    port, _, _ = hub
    with _channel(port, pki_dir["s1"]) as channel:
        assert _call(channel) == ("OK", "s1")
        pki.revoke(pki_dir["ca"], "s1")
        shutil.copyfile(pki_dir["ca"] / "crl.pem", pki_dir["hub"] / "crl.pem")
        code, details = _call(channel)
        assert code == "UNAUTHENTICATED" and details.startswith("revoked: the certificate of silo s1 (serial")


def test_a_certificate_that_expires_during_its_connection_is_refused_from_then_on(pki_dir, hub) -> None:
    port, _, _ = hub
    # Valid for one more second or so: the handshake accepts it, the gate refuses it once it has expired.
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=1) + dt.timedelta(seconds=2)
    short = pki.issue_silo(pki_dir["ca"], "s-short", pki_dir["root"] / "short", days=1, not_before=start)
    with _channel(port, short) as channel:
        assert _call(channel) == ("OK", "s-short")
        expiry = x509.load_pem_x509_certificate((short / "cert.pem").read_bytes()).not_valid_after_utc
        time.sleep(max(0.0, (expiry - dt.datetime.now(dt.UTC)).total_seconds()) + 0.2)
        code, details = _call(channel)
    assert code == "UNAUTHENTICATED" and details.startswith("expired: the certificate of silo s-short expired")


def test_handshake_refuses_an_expired_certificate_and_the_hubs_own(pki_dir, hub) -> None:
    port, _, _ = hub
    expired = pki.issue_silo(pki_dir["ca"], "s1", pki_dir["root"] / "expired", days=1,
                             not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    ca = (pki_dir["ca"] / "ca.pem").read_bytes()
    for bundle in (expired, pki_dir["hub"]):
        creds = grpc.ssl_channel_credentials(ca, (bundle / "key.pem").read_bytes(), (bundle / "cert.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            code, details = _call(channel)
        # The hub's certificate lacks clientAuth: refused in the handshake, or by the gate if a TLS stack let it by.
        assert code == "UNAVAILABLE" or details.startswith("not_silo_certificate"), (bundle, code, details)


def _handshake(port: int, bundle: Path, version: ssl.TLSVersion | None = None, ciphers: str = "DEFAULT"
               ) -> tuple[str, int]:
    """(TLS version, served certificate serial) of a raw handshake presenting ``bundle``'s silo certificate."""
    ctx = ssl.create_default_context(cafile=str(bundle / "ca.pem"))
    ctx.load_cert_chain(bundle / "cert.pem", bundle / "key.pem")
    ctx.set_alpn_protocols(["h2"])
    if version is not None:
        ctx.set_ciphers(f"{ciphers}:@SECLEVEL=0")  # let this client really offer old things; the hub must say no
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.minimum_version = ctx.maximum_version = version
    with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as conn:
        return conn.version(), x509.load_der_x509_certificate(conn.getpeercert(binary_form=True)).serial_number


def test_tls_versions_the_hub_accepts(pki_dir, hub) -> None:
    """What docs/security.md states: TLS 1.3 by default, 1.2 (ECDHE + AES-GCM only) still accepted, nothing
    older."""
    port, _, _ = hub
    assert _handshake(port, pki_dir["s1"])[0] == "TLSv1.3"
    assert _handshake(port, pki_dir["s1"], ssl.TLSVersion.TLSv1_2)[0] == "TLSv1.2"
    with pytest.raises(ssl.SSLError):  # TLS 1.2 only with ECDHE and AES-GCM: a CBC suite is refused
        _handshake(port, pki_dir["s1"], ssl.TLSVersion.TLSv1_2, ciphers="ECDHE-ECDSA-AES128-SHA")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = ssl.TLSVersion.TLSv1_1
    with pytest.raises(ssl.SSLError) as refused:
        _handshake(port, pki_dir["s1"], old)
    assert "NO_CIPHERS" not in str(refused.value)  # the hub hung up, not our own client


def test_a_renewed_hub_certificate_reaches_new_connections_and_a_half_copy_is_skipped(pki_dir, hub, caplog) -> None:
    port, creds, loaded = hub
    bundle = pki_dir["hub"]
    old_serial = x509.load_pem_x509_certificate((bundle / "cert.pem").read_bytes()).serial_number
    with _channel(port, pki_dir["s1"]) as established:
        assert _call(established) == ("OK", "s1")
        assert _handshake(port, pki_dir["s1"])[1] == old_serial
        renewed = pki.renew(pki_dir["ca"], "hub", out_dir=pki_dir["root"] / "hub-2")
        new_serial = x509.load_pem_x509_certificate((renewed / "cert.pem").read_bytes()).serial_number

        shutil.copyfile(renewed / "cert.pem", bundle / "cert.pem")  # key.pem not copied yet: inconsistent
        assert _handshake(port, pki_dir["s1"])[1] == old_serial
        assert any("not usable yet" in r.message for r in caplog.records)
        shutil.copyfile(renewed / "key.pem", bundle / "key.pem")
        assert _handshake(port, pki_dir["s1"])[1] == new_serial
        assert creds.reloads == 1 and len(loaded) == 2 and loaded[-1] == (renewed / "cert.pem").read_bytes()
        assert _call(established) == ("OK", "s1")  # the open connection carries on
    with _channel(port, pki_dir["s1"]) as fresh:
        assert _call(fresh) == ("OK", "s1")


# ---------------------------------------------------------------------------------------- --insecure-dev-only


def test_insecure_dev_mode_takes_the_declared_id_and_refuses_a_caller_without_one() -> None:
    server, port = _serve(PeerGate(insecure_dev=True, allowed_silos=["dev-1"]), None)
    try:
        with tls.insecure_dev_channel(f"127.0.0.1:{port}", "dev-1") as channel:
            assert _call(channel) == ("OK", "dev-1")
        with tls.insecure_dev_channel(f"localhost:{port}", "dev-2") as channel:
            assert _call(channel)[0] == "PERMISSION_DENIED"  # the allowlist still applies
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            code, details = _call(channel)
            assert code == "UNAUTHENTICATED" and "--insecure-dev-only --silo-id" in details
            assert _call(channel, metadata=[(tls.DEV_IDENTITY_KEY, "../etc")])[0] == "UNAUTHENTICATED"
    finally:
        server.stop(0)


def test_insecure_dev_channel_only_dials_this_machine_with_a_valid_id() -> None:
    for target in ("127.0.0.1:1", "127.3.4.5:1", "localhost:1", "[::1]:1"):
        assert tls.is_loopback_target(target), target
    for target in ("10.0.0.5:50051", "hub.example.org:50051", "0.0.0.0:1", "[2001:db8::1]:1"):
        assert not tls.is_loopback_target(target), target
        with pytest.raises(tls.TlsError, match="this machine only"):
            tls.insecure_dev_channel(target, "dev-1")
    with pytest.raises(tls.TlsError, match=r"invalid silo name.*--silo-id"):
        tls.insecure_dev_channel("127.0.0.1:1", "a b")
