"""A silo checks the hub's certificate against the federation CA's revocation list: over a real TLS server on
127.0.0.1 with the hub's certificate, before joining and before every round."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest
from cryptography import x509

import silo_client.hub_link
from security import pki, tls
from security.crl import RevocationList
from security.gate import PeerGate
from silo_client.client import SiloClient, SiloSettings
from silo_client.errors import SiloError
from silo_client.hub_link import HUB_SERIALS_SEEN, HubSeen
from tests.security.test_gate import _call, _serve
from tests.silo_client.test_cli_errors import write_images


@pytest.fixture
def federation(tmp_path: Path):
    ca = pki.init_ca(tmp_path / "ca")
    hub_bundle, silo_bundle = pki.issue_hub(ca, tmp_path / "hub"), pki.issue_silo(ca, "s1", tmp_path / "s1")
    gate = PeerGate(revocations=RevocationList(hub_bundle / "crl.pem", hub_bundle / "ca.pem"), allowed_silos=["s1"])
    server, port = _serve(gate, tls.server_credentials(hub_bundle))
    write_images(tmp_path / "images")
    yield {"ca": ca, "hub": hub_bundle, "silo": silo_bundle, "target": f"127.0.0.1:{port}", "root": tmp_path}
    server.stop(0)


def client_for(f, **settings) -> SiloClient:
    return SiloClient(SiloSettings(hub=f["target"], certs=f["silo"], data=f["root"] / "images", device="cpu",
                                   state_dir=f["root"] / "state", **settings))


def test_the_silo_reads_the_certificate_the_hub_serves_and_the_hub_keeps_serving(federation) -> None:
    served = tls.hub_certificate(federation["target"], tls.hub_tls_context(federation["silo"]))
    hub_cert = x509.load_pem_x509_certificate((federation["hub"] / "cert.pem").read_bytes())
    assert served.serial_number == hub_cert.serial_number
    with tls.secure_channel(federation["target"], federation["silo"]) as channel:
        assert _call(channel) == ("OK", "s1")  # our own handshake did not disturb the hub


def test_a_silo_refuses_a_hub_whose_certificate_was_revoked_before_sending_anything(federation) -> None:
    client = client_for(federation)
    try:
        client.hub_check.check()  # the bundle's crl.pem lists nothing: the check passes
        hub_serial = pki.find_certificates(federation["ca"], "hub")[0].serial
        pki.revoke(federation["ca"], hub_serial)
        shutil.copyfile(federation["ca"] / "crl.pem", federation["silo"] / "crl.pem")  # what the operator copies
        client.hub_check.check(unless_checked_within_s=60.0)  # before a round: checked a moment ago
        with pytest.raises(SiloError, match=f"presents certificate serial {int(hub_serial, 16):x}, which the "
                                            "federation CA revoked") as err:
            client._join()  # checked before the Join call (this test server has no Join: it would fail otherwise)
        assert "Nothing was sent" in str(err.value)
    finally:
        client.close()


def test_silos_of_one_process_share_one_checking_handshake_and_a_revoked_serial_seen_is_checked_afresh(
        federation, monkeypatch) -> None:
    handshakes = []

    def counting(target, context, timeout_s=10.0):
        handshakes.append(target)
        return tls.hub_certificate(target, context, timeout_s)

    monkeypatch.setattr(silo_client.hub_link, "hub_certificate", counting)
    silos = [client_for(federation) for _ in range(3)]  # one silo-sim host's silos: same hub, same CA
    try:
        for silo in silos:
            silo.hub_check.check()
        assert len(handshakes) == 1 and silos[1].hub_check.tls is None  # the others built no TLS context either
        # A serial seen that this silo's CRL revokes is not trusted: the hub may present its new certificate now.
        other = pki.issue_silo(federation["ca"], "s2", federation["root"] / "s2")
        revoked = x509.load_pem_x509_certificate((other / "cert.pem").read_bytes()).serial_number
        pki.revoke(federation["ca"], "s2")
        shutil.copyfile(federation["ca"] / "crl.pem", federation["silo"] / "crl.pem")
        HUB_SERIALS_SEEN.saw(federation["target"], (federation["silo"] / "ca.pem").read_bytes(),
                             HubSeen(revoked, "00" * 32))
        silos[0].hub_check.check()  # passes: a handshake of its own saw the hub's real serial
        assert len(handshakes) == 2
    finally:
        for silo in silos:
            silo.close()


def test_a_silo_without_a_usable_revocation_list_says_which_file_and_what_to_do(federation) -> None:
    (federation["root"] / "bad-crl.pem").write_text("not a crl")
    with pytest.raises(SiloError, match="bad-crl.pem.*pass --crl with the CA's crl.pem"):
        client_for(federation, crl=federation["root"] / "bad-crl.pem")


def test_a_hub_whose_certificate_cannot_be_checked_is_retried_then_given_up(federation) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    federation["target"] = f"127.0.0.1:{closed}"
    client = client_for(federation, connect_timeout_s=0.5)
    try:
        with pytest.raises(SiloError, match="cannot reach the hub at 127.0.0.1:.* to check its certificate .*"
                                            "--hub HOST:PORT.* gave up after"):
            client.run_forever()
    finally:
        client.close()


def _refused_at_once(federation, certs: Path) -> str:
    """run_forever against the fixture's hub with `certs`: the SiloError it stops with (grace 0.5 s, far below the
    connect timeout)."""
    client = SiloClient(SiloSettings(hub=federation["target"], certs=certs, data=federation["root"] / "images",
                                     device="cpu", state_dir=federation["root"] / "state", connect_timeout_s=300,
                                     tls_refused_grace_s=0.5))
    started = time.time()
    try:
        with pytest.raises(SiloError) as err:
            client.run_forever()
    finally:
        client.close()
    assert time.time() - started < 30  # not the 300 s connect timeout
    return str(err.value)


def test_a_bundle_from_another_ca_stops_the_silo_with_the_cause_and_the_fix(federation) -> None:
    other = pki.init_ca(federation["root"] / "other-ca", name="another federation")
    message = _refused_at_once(federation, pki.issue_silo(other, "s1", federation["root"] / "other"))
    assert "presents a certificate this silo cannot verify (unable to get local issuer certificate)" in message
    assert "--certs holds a bundle from another CA than the hub's" in message and "\n" not in message


def test_grpc_core_logs_stay_quiet_unless_asked(monkeypatch) -> None:
    from security.grpc_logs import quiet_grpc_core

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    quiet_grpc_core(verbose=True)
    assert "GRPC_VERBOSITY" not in os.environ
    quiet_grpc_core(verbose=False)
    assert os.environ["GRPC_VERBOSITY"] == "ERROR"
    monkeypatch.setenv("GRPC_VERBOSITY", "INFO")  # the user's own choice stands
    quiet_grpc_core(verbose=False)
    assert os.environ["GRPC_VERBOSITY"] == "INFO"
