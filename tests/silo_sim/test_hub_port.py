"""silo-sim picks the hub's port before the hub starts: it must pick one the system will not hand to another
process in the seconds before the hub binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from silo_sim import federation
from silo_sim.federation import free_port_outside_ephemeral_range, hub_port


def _free(port: int) -> bool:
    try:
        with socket.create_server(("127.0.0.1", port)):
            return True
    except OSError:
        return False


def _first_ephemeral() -> int:
    if not federation.EPHEMERAL_RANGE_FILE.is_file():
        pytest.skip(f"no {federation.EPHEMERAL_RANGE_FILE} on this system")
    return int(federation.EPHEMERAL_RANGE_FILE.read_text().split()[0])


def test_the_picked_port_is_free_and_below_the_ephemeral_range() -> None:
    first_ephemeral = _first_ephemeral()
    picks = {free_port_outside_ephemeral_range("127.0.0.1") for _ in range(5)}
    for port in picks:
        assert federation.FIRST_PICKED_PORT <= port < first_ephemeral
        assert _free(port)


def test_a_port_in_use_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        if not _free(busy + 1):
            pytest.skip(f"port {busy + 1} is in use on this machine")
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{busy + 2}\t60999\n")  # candidates: busy and busy + 1
        monkeypatch.setattr(federation, "EPHEMERAL_RANGE_FILE", range_file)
        monkeypatch.setattr(federation, "FIRST_PICKED_PORT", busy)
        assert free_port_outside_ephemeral_range("127.0.0.1") == busy + 1


@pytest.mark.parametrize("range_text", [None, "not a range", "1024\t60999"])
def test_without_room_below_a_known_range_the_system_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           range_text: str | None) -> None:
    range_file = tmp_path / "ip_local_port_range"
    if range_text is not None:
        range_file.write_text(range_text)
    monkeypatch.setattr(federation, "EPHEMERAL_RANGE_FILE", range_file)
    port = free_port_outside_ephemeral_range("127.0.0.1")
    assert 0 < port <= 65535 and _free(port)


class _Staged:
    def __init__(self, hub_config: Path) -> None:
        self.hub_config = hub_config


def test_a_configured_port_is_kept_and_port_0_is_picked(tmp_path: Path) -> None:
    config = tmp_path / "hub.yaml"
    config.write_text("server:\n  port: 23456\n")
    assert hub_port(_Staged(config)) == 23456
    config.write_text("server:\n  host: 127.0.0.1\n  port: 0\n")
    first_ephemeral = _first_ephemeral()
    assert federation.FIRST_PICKED_PORT <= hub_port(_Staged(config)) < first_ephemeral
