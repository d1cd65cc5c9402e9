"""security.tls over a real gRPC server on 127.0.0.1: who gets in, and what identity the hub sees."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from security import pki, tls

_WHOAMI = "/silokit.test.Echo/WhoAmI"
_TIMEOUT = 5.0


@dataclass
class Pki:
    ca: Path
    hub: Path  # default SANs: localhost, 127.0.0.1
    hub_named: Path  # SAN hub.internal only
    silo: Path  # "branch-01"
    foreign_ca: Path
    foreign_silo: Path  # also "branch-01", but from another CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = pki.init_ca(root / "ca")
    foreign_ca = pki.init_ca(root / "foreign-ca", name="someone else's CA")
    return Pki(
        ca=ca,
        hub=pki.issue_hub(ca, root / "hub", dns=[], ips=[]),
        # a second live hub certificate for the same CA is a renewal (issue-hub refuses a live name)
        hub_named=pki.renew(ca, "hub", out_dir=root / "hub-named", dns=["hub.internal"], ips=[]),
        silo=pki.issue_silo(ca, "branch-01", root / "silo"),
        foreign_ca=foreign_ca,
        foreign_silo=pki.issue_silo(foreign_ca, "branch-01", root / "foreign-silo"),
    )


def _whoami(request: bytes, context: grpc.ServicerContext) -> bytes:
    identity = tls.peer_identity(context)
    pem = tls.peer_certificate(context)
    # The certificate the hub sees is the one the identity came from.
    assert pem is not None and pki.cert_common_name(pem) == identity
    return (identity or "<none>").encode()


def _start_server(bundle: Path) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "silokit.test.Echo", {"WhoAmI": grpc.unary_unary_rpc_method_handler(_whoami)}
            )
        ]
    )
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(bundle))
    assert port > 0
    server.start()
    return server, port


@pytest.fixture
def hub_port(certs: Pki) -> Iterator[int]:
    server, port = _start_server(certs.hub)
    try:
        yield port
    finally:
        server.stop(0)


def _call(channel: grpc.Channel) -> tuple[int, str]:
    """(health status, identity the hub saw) over ``channel``; closes it."""
    with channel:
        status = (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=_TIMEOUT)
            .status
        )
        identity = channel.unary_unary(_WHOAMI)(b"", timeout=_TIMEOUT).decode()
    return status, identity


def _assert_refused(channel: grpc.Channel) -> None:
    with channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(_WHOAMI)(b"", timeout=_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def _creds(ca: Path, cert_dir: Path | None) -> grpc.ChannelCredentials:
    """Hand-made client credentials: trust ``ca``/ca.pem, present ``cert_dir``'s cert/key if given."""
    if cert_dir is None:
        return grpc.ssl_channel_credentials(root_certificates=(ca / "ca.pem").read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=(ca / "ca.pem").read_bytes(),
        private_key=(cert_dir / "key.pem").read_bytes(),
        certificate_chain=(cert_dir / "cert.pem").read_bytes(),
    )


# ------------------------------------------------------------------------------------------------ handshakes


def test_silo_connects_by_ip_with_default_sans_and_is_known_by_its_cn(certs: Pki, hub_port: int) -> None:
    status, identity = _call(tls.secure_channel(f"127.0.0.1:{hub_port}", certs.silo))
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert identity == "branch-01"


def test_channel_credentials_work_with_plain_grpc_secure_channel(certs: Pki, hub_port: int) -> None:
    channel = grpc.secure_channel(f"127.0.0.1:{hub_port}", tls.channel_credentials(certs.silo))
    assert _call(channel)[1] == "branch-01"


def test_client_without_certificate_is_refused(certs: Pki, hub_port: int) -> None:
    _assert_refused(grpc.secure_channel(f"127.0.0.1:{hub_port}", _creds(certs.ca, None)))


def test_client_certificate_from_a_foreign_ca_is_refused(certs: Pki, hub_port: int) -> None:
    # Same CN as the real silo, trusts the real CA: only the issuer differs.
    _assert_refused(grpc.secure_channel(f"127.0.0.1:{hub_port}", _creds(certs.ca, certs.foreign_silo)))


def test_silo_does_not_trust_a_hub_from_a_foreign_ca(certs: Pki, hub_port: int) -> None:
    # A complete foreign bundle: the silo's own checks pass, but the real hub's certificate is not trusted.
    _assert_refused(tls.secure_channel(f"127.0.0.1:{hub_port}", certs.foreign_silo))


def test_plaintext_client_is_refused(hub_port: int) -> None:
    _assert_refused(grpc.insecure_channel(f"127.0.0.1:{hub_port}"))


def test_server_name_override_for_an_address_not_in_the_sans(certs: Pki) -> None:
    server, port = _start_server(certs.hub_named)
    try:
        _assert_refused(tls.secure_channel(f"127.0.0.1:{port}", certs.silo))  # 127.0.0.1 is not a SAN
        _, identity = _call(tls.secure_channel(f"127.0.0.1:{port}", certs.silo, server_name="hub.internal"))
        assert identity == "branch-01"
        _assert_refused(tls.secure_channel(f"127.0.0.1:{port}", certs.silo, server_name="other.internal"))
    finally:
        server.stop(0)


# ---------------------------------------------------------------------------------------------- peer_identity


class _FakeContext:
    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


def test_peer_identity_without_certificate_is_none() -> None:
    ctx = _FakeContext({"transport_security_type": [b"ssl"]})
    assert tls.peer_identity(ctx) is None  # type: ignore[arg-type]
    assert tls.peer_certificate(ctx) is None  # type: ignore[arg-type]


def test_peer_identity_decodes_the_first_cn() -> None:
    ctx = _FakeContext({"x509_common_name": [b"branch-07"], "x509_pem_cert": [b"PEM"]})
    assert tls.peer_identity(ctx) == "branch-07"  # type: ignore[arg-type]
    assert tls.peer_certificate(ctx) == b"PEM"  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- bundle checks


def test_missing_file_names_it_and_says_what_to_run(certs: Pki, tmp_path: Path) -> None:
    bundle = tmp_path / "hub"
    shutil.copytree(certs.hub, bundle)
    (bundle / "key.pem").unlink()
    with pytest.raises(tls.TlsError, match=rf"{bundle / 'key.pem'} not found; run `silo-certs issue-hub"):
        tls.server_credentials(bundle)
    with pytest.raises(tls.TlsError, match=r"not found; run `silo-certs issue-silo"):
        tls.channel_credentials(bundle)
    with pytest.raises(tls.TlsError, match="is not a directory"):
        tls.secure_channel("127.0.0.1:1", tmp_path / "nowhere")


def test_bundle_used_for_the_wrong_role_is_refused(certs: Pki) -> None:
    with pytest.raises(tls.TlsError, match="certificate for a silo"):
        tls.server_credentials(certs.silo)
    with pytest.raises(tls.TlsError, match=r"certificate for the hub"):
        tls.channel_credentials(certs.hub)


def test_bundle_mixing_two_cas_is_refused(certs: Pki, tmp_path: Path) -> None:
    bundle = tmp_path / "mixed"
    shutil.copytree(certs.silo, bundle)
    shutil.copyfile(certs.foreign_ca / "ca.pem", bundle / "ca.pem")
    with pytest.raises(tls.TlsError, match="mixes two CAs"):
        tls.channel_credentials(bundle)


def test_key_that_does_not_match_the_certificate_is_refused(certs: Pki, tmp_path: Path) -> None:
    bundle = tmp_path / "swapped"
    shutil.copytree(certs.silo, bundle)
    shutil.copyfile(certs.foreign_silo / "key.pem", bundle / "key.pem")
    with pytest.raises(tls.TlsError, match=r"key\.pem does not match .*cert\.pem"):
        tls.channel_credentials(bundle)
