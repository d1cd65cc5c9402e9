"""server.port 0: a free port on the first start, the same port on every restart (running silos keep dialing it),
and a one-line error naming the port when it has been taken meanwhile."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import yaml

from security.pki import init_ca, issue_hub
from silo_server.app import HubApp
from silo_server.config import parse_config

RAW = {
    "run": {"state_dir": "state", "device": "cpu"},
    "server": {"host": "127.0.0.1", "port": 0, "certs": "hub"},
    "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
    "metrics": {"enabled": False},
}


@pytest.fixture
def hub_dir(tmp_path):
    init_ca(tmp_path / "ca")
    issue_hub(tmp_path / "ca", tmp_path / "hub")
    return tmp_path


def _app(tmp_path) -> HubApp:
    return HubApp(parse_config(RAW, base=tmp_path))


def test_a_restarted_hub_with_port_0_binds_the_port_its_first_start_picked(hub_dir) -> None:
    first = _app(hub_dir)
    port = first.start_server()
    first.stop(0)
    assert port > 0 and (hub_dir / "state" / "port").read_text() == str(port)
    again = _app(hub_dir)
    try:
        assert again.start_server() == port
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the restarted hub answers where the silos dial
    finally:
        again.stop(0)
    assert (hub_dir / "state" / "port").read_text() == str(port)


def test_the_port_taken_meanwhile_stops_the_hub_with_the_port_named(hub_dir) -> None:
    first = _app(hub_dir)
    port = first.start_server()
    try:
        # The old hub still serving counts as taken too: gRPC's SO_REUSEPORT would otherwise let two hubs share it.
        with pytest.raises(OSError) as info:
            _app(hub_dir).start_server()
    finally:
        first.stop(0)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "it is taken now" in message
    assert "set server.port in the config explicitly" in message and "\n" not in message
    with socket.socket() as other:  # another program on the port
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*set server.port"):
            _app(hub_dir).start_server()


def test_the_cli_says_it_in_one_line(hub_dir) -> None:
    cfg = hub_dir / "hub.yaml"
    cfg.write_text(yaml.safe_dump(RAW))
    (hub_dir / "state").mkdir()
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        (hub_dir / "state" / "port").write_text(str(port))  # as a first start would have left it
        proc = subprocess.run([sys.executable, "-m", "silo_server.cli", "--config", str(cfg)], capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(port) in errors[0] and "set server.port" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
