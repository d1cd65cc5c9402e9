"""--insecure-dev-only: plaintext on 127.0.0.1 only, loud, with declared silo ids; and the CLI guards around it."""

from __future__ import annotations

import logging
import subprocess
import sys

import grpc
import pytest

from security.pki import init_ca, issue_hub
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_client.client import SiloClient, SiloSettings
from silo_server.app import HubApp
from silo_server.config import parse_config
from tests.silo_client.test_cli_errors import write_images


def _config(tmp_path, **security):
    return parse_config({
        "run": {"state_dir": "state", "device": "cpu"},
        "server": {"host": "0.0.0.0", "port": 0, "certs": "hub"},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
        "security": security,
    }, base=tmp_path)


def test_dev_mode_listens_on_loopback_only_says_so_and_takes_declared_ids(tmp_path, caplog) -> None:
    write_images(tmp_path / "images")
    app = HubApp(_config(tmp_path, allowed_silos=["dev-1"]), insecure_dev_only=True)
    with caplog.at_level(logging.WARNING, logger="silo_server"):
        port = app.start_server()
    try:
        banner = "\n".join(r.message for r in caplog.records)
        assert f"INSECURE DEVELOPMENT MODE (--insecure-dev-only): plaintext gRPC on 127.0.0.1:{port} only" in banner
        assert "server.host 0.0.0.0 is ignored in this mode" in banner and "Never use this mode with real data" in banner
        client = SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / "images",
                                         device="cpu", state_dir=tmp_path / "silo-state",
                                         insecure_dev_silo_id="dev-1"))
        try:
            client._join()
            assert client.silo_id == "dev-1" and set(app.hub.registry.silos) == {"dev-1"}
        finally:
            client.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                silo_pb2_grpc.FederationStub(channel).Join(silo_pb2.JoinRequest(device="cpu"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert app.hub.registry.refusals == {"no_identity": 1}
    finally:
        app.stop(0)


def test_with_tls_the_hub_needs_its_bundle_and_crl(tmp_path) -> None:
    init_ca(tmp_path / "ca")
    issue_hub(tmp_path / "ca", tmp_path / "hub")
    app = HubApp(_config(tmp_path))
    app.check_security()  # bundle, CRL and allowlist are fine
    (tmp_path / "hub" / "crl.pem").unlink()
    with pytest.raises(ValueError, match=r"revocation list .*crl\.pem.*silo-certs crl"):
        app.check_security()


def _client(*args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "silo_client.cli", "--data", "x", *args], capture_output=True,
                          text=True, timeout=60)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--insecure-dev-only"], "needs --silo-id"),
    (["--insecure-dev-only", "--silo-id", "a", "--certs", "c"], "exclude each other"),
    (["--silo-id", "a", "--certs", "c"], "only applies with --insecure-dev-only"),
    ([], "required: --certs"),
])
def test_client_flags_for_dev_mode_are_checked(args, words) -> None:
    rc, err = _client(*args)
    assert rc == 2 and words in err and "Traceback" not in err


def test_client_refuses_plaintext_to_another_machine(tmp_path) -> None:
    write_images(tmp_path / "images")
    proc = subprocess.run([sys.executable, "-m", "silo_client.cli", "--data", str(tmp_path / "images"),
                           "--insecure-dev-only", "--silo-id", "dev-1", "--hub", "10.1.2.3:50051"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "this machine only" in proc.stderr and "Traceback" not in proc.stderr
