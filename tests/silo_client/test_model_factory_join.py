"""A run whose model a factory builds, joined over real gRPC: a silo imports the factory only when its own operator
named it, and refuses a build that differs from the hub's before it trains."""

from __future__ import annotations

import pytest

import tests.model_factories as factories
from silo_client.client import SiloClient, SiloSettings
from silo_client.errors import SiloError
from silo_server.app import HubApp
from silo_server.config import parse_config
from tests.silo_client.test_cli_errors import write_images

TINY = "tests.model_factories:tiny_net"


@pytest.fixture
def hub(tmp_path):
    config = parse_config({
        "run": {"state_dir": "state", "device": "cpu"},
        "server": {"host": "127.0.0.1", "port": 0},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
        "model": {"factory": TINY, "options": {"width": 4}},
        "security": {"allowed_silos": ["dev-1"]},
    }, base=tmp_path)
    app = HubApp(config, insecure_dev_only=True)
    port = app.start_server()
    write_images(tmp_path / "images", n=4)
    yield app, port
    app.stop(0)


def silo(tmp_path, port: int, factories_allowed: tuple[str, ...]) -> SiloClient:
    return SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / "images", device="cpu",
                                   state_dir=tmp_path / "silo-state", insecure_dev_silo_id="dev-1",
                                   model_factories=factories_allowed))


def test_the_run_description_carries_the_factory_and_every_tensor(hub) -> None:
    app, _ = hub
    desc = app.hub.run_description
    assert desc["model"] == TINY and desc["model_factory"] == TINY
    assert [(t.name, t.shape) for t in desc["architecture"]][:2] == [("0.weight", (4, 1, 3, 3)), ("0.bias", (4,))]


def test_a_silo_not_told_the_factory_refuses_at_join_before_loading_images(hub, tmp_path) -> None:
    _, port = hub
    client = silo(tmp_path, port, ("other_pkg.models:build",))
    try:
        with pytest.raises(SiloError) as info:
            client._join()
        message = str(info.value)
        assert f"builds its model with the factory {TINY}" in message
        assert f"restart with --model-factory {TINY}" in message
        assert "this silo allows only other_pkg.models:build" in message
        assert client.data is None  # refused before a single image was decoded
    finally:
        client.close()


def test_a_silo_that_names_the_factory_builds_it_and_joins_ready(hub, tmp_path) -> None:
    app, port = hub
    client = silo(tmp_path, port, (TINY,))
    try:
        client._join()
        assert client.algorithm.model_spec.factory == TINY
        assert app.hub.registry.live_silos() == ["dev-1"]
    finally:
        client.close()


def test_a_silo_whose_build_differs_refuses_naming_the_tensor(hub, tmp_path, monkeypatch) -> None:
    _, port = hub
    monkeypatch.setattr(factories, "HIDDEN_WIDTH", 6)  # this site's copy of the package is another version
    client = silo(tmp_path, port, (TINY,))
    try:
        with pytest.raises(SiloError) as info:
            client._join()
        assert "5.weight is [6, 4] float32 here but [8, 4] float32 at the hub" in str(info.value)
        assert client.data is None  # before loading any image
    finally:
        client.close()


def test_a_silo_refuses_at_join_a_run_whose_upload_cap_no_update_could_fit(tmp_path) -> None:
    """The hub's wire.max_upload_bytes below one update of its own model: every upload would be refused as
    oversized after training, so the silo says so at join, with both sizes."""
    app = HubApp(parse_config({
        "run": {"state_dir": "state", "device": "cpu"},
        "server": {"host": "127.0.0.1", "port": 0},
        "data": {"labeled": {"kind": "demo", "labels_per_class": 1}},
        "model": {"options": {"width": 4}},
        "wire": {"max_upload_bytes": 1024},
    }, base=tmp_path), insecure_dev_only=True)
    port = app.start_server()
    write_images(tmp_path / "images", n=4)
    client = silo(tmp_path, port, ())
    try:
        with pytest.raises(SiloError, match=r"at least [\d,]+ bytes on the wire, above the hub's cap of 1,024 bytes"):
            client._join()
        assert client.data is None
    finally:
        client.close()
        app.stop(0)
