"""A silo joins in two steps: known to the hub while it loads its images, sampled only once it reports ready."""

from __future__ import annotations

import pytest
import torch

from silo_client.client import SiloClient, SiloSettings
from silo_client.errors import SiloError
from silo_client.run_checks import rehearse
from silo_core.algorithms.base import SiloData
from silo_core.data import FASHION_MNIST_CLASSES, class_folder_name
from silo_core.models import ModelSpec
from silo_server.app import HubApp
from tests.silo_client.test_cli_errors import write_images
from tests.silo_server.test_hub import make_hub, result, start_round, upload, wait_task
from tests.silo_server.test_insecure_dev import _config


def _hub_recording_joins(tmp_path):
    """A plaintext development hub that records (preparing, images declared, skipped) of every Join."""
    app = HubApp(_config(tmp_path, allowed_silos=["dev-1"]), insecure_dev_only=True)
    port = app.start_server()
    joins: list[tuple[bool, int, int]] = []
    real_join = app.hub.join

    def recording_join(silo_id, num_unlabeled, num_labeled, device, skipped_images=0, preparing=False, serial=None,
                       **versions):
        joins.append((preparing, num_unlabeled, skipped_images))
        return real_join(silo_id, num_unlabeled, num_labeled, device, skipped_images, preparing=preparing,
                         serial=serial, **versions)

    app.hub.join = recording_join
    return app, port, joins


def test_a_silo_is_not_sampled_while_it_loads_and_reports_what_loaded(tmp_path) -> None:
    write_images(tmp_path / "images", n=5)
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")  # counted as a file, skipped when loading
    app, port, joins = _hub_recording_joins(tmp_path)
    client = SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / "images", device="cpu",
                                     state_dir=tmp_path / "silo-state", insecure_dev_silo_id="dev-1"))
    seen_while_loading: dict[str, list[str]] = {}
    real_load = client._load

    def load_and_look(run):
        seen_while_loading.update(live=app.hub.registry.live_silos(), preparing=app.hub.registry.preparing_silos())
        return real_load(run)

    client._load = load_and_look
    try:
        client._join()
        assert seen_while_loading == {"live": [], "preparing": ["dev-1"]}
        # First the file count, then what loaded: 5 images, the broken file skipped.
        assert joins == [(True, 6, 0), (False, 5, 1)]
        assert app.hub.registry.live_silos() == ["dev-1"] and app.hub.registry.preparing_silos() == []
        record = app.hub.registry.silos["dev-1"]
        assert (record.num_unlabeled, record.skipped_images, record.ready) == (5, 1, True)
        # A second join (after a hub restart, say) has nothing to load: one Join, ready at once.
        client._join()
        assert joins[2:] == [(False, 5, 1)]
    finally:
        client.close()
        app.stop(0)


def test_the_hub_waits_for_a_preparing_silo_before_it_samples(tmp_path) -> None:
    hub = make_hub(tmp_path, min_silos=2)
    hub.join("a", 10, 0, "cpu")
    hub.join("b", 10, 0, "cpu", preparing=True)
    assert (hub.registry.live_silos(), hub.registry.preparing_silos()) == (["a"], ["b"])
    thread, out = start_round(hub)
    assert hub.next_task("a", hub.run_id, wait_s=1.0).kind == "WAIT"  # b is loading: no round yet
    hub.join("b", 9, 0, "cpu", skipped_images=1)
    tasks = {s: wait_task(hub, s) for s in ("a", "b")}
    assert tasks["a"].task_id == tasks["b"].task_id and len(hub.rounds.task.sampled) == 2
    for silo, task in tasks.items():
        upload(hub, silo, task, result(1.0))
    thread.join(timeout=10)
    assert out["state"].round == 1 and hub.records.history[-1].silos_reported == 2


def test_rehearsal_leaves_the_random_state_alone_and_takes_a_single_image() -> None:
    images = torch.randint(0, 256, (1, 1, 28, 28), dtype=torch.uint8)
    before = torch.get_rng_state()
    rehearse(ModelSpec(), SiloData(images=images), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_model_the_device_cannot_run_fails_at_start_with_what_to_do() -> None:
    rgb = torch.zeros(4, 3, 28, 28, dtype=torch.uint8)  # a network for one channel cannot take these
    with pytest.raises(SiloError, match=r"could not run the run's model \(small_cnn\) on device cpu: .*--device cpu"):
        rehearse(ModelSpec(in_channels=1), SiloData(images=rgb), torch.device("cpu"))


def test_a_silo_told_to_load_when_sampled_joins_ready_on_its_file_count_and_loads_at_its_first_task(tmp_path):
    write_images(tmp_path / "images", n=5)
    (tmp_path / "images" / "broken.png").write_bytes(b"not a png")
    app, port, joins = _hub_recording_joins(tmp_path)
    client = SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / "images", device="cpu",
                                     state_dir=tmp_path / "silo-state", insecure_dev_silo_id="dev-1",
                                     load_when_sampled=True))
    try:
        client._join()
        # One Join, ready at once, on the count of files; nothing decoded, no algorithm built yet.
        assert joins == [(False, 6, 0)] and app.hub.registry.live_silos() == ["dev-1"]
        assert client.data is None and client.algorithm is None
        client._load_if_deferred()  # what its first TRAIN or RECEIVE task does first
        assert (len(client.data.images), client.skipped_images) == (5, 1) and client.algorithm is not None
        client._load_if_deferred()  # loaded once
        # The next join (a hub restart, say) declares what loaded; the hub keeps the lower count.
        client._join()
        assert joins[1:] == [(False, 5, 1)]
        dev = app.hub.registry.silos["dev-1"]
        assert (dev.num_unlabeled, dev.declared_images) == (5, 5)
    finally:
        client.close()
        app.stop(0)


def test_a_silo_that_loads_when_sampled_still_fails_at_join_when_its_files_cannot_take_part(tmp_path):
    write_images(tmp_path / "labeled" / "a", n=2)  # labeled images only: SemiFL trains on none of them
    app, port, joins = _hub_recording_joins(tmp_path)
    client = SiloClient(SiloSettings(hub=f"127.0.0.1:{port}", certs=None, data=None, labeled=tmp_path / "labeled",
                                     device="cpu", state_dir=tmp_path / "silo-state", insecure_dev_silo_id="dev-1",
                                     load_when_sampled=True))
    try:
        with pytest.raises(SiloError, match="algorithm semifl has nothing to train on at this silo; pass --data"):
            client._join()
        assert joins == [(False, 0, 0)] and client.data is None  # told from the file counts, nothing decoded
    finally:
        client.close()
        app.stop(0)


def test_a_silos_labeled_folders_must_name_the_hubs_classes_not_just_as_many(tmp_path):
    # Labels are positions in each side's sorted class folders: ten folders named otherwise (or sorting otherwise)
    # would train the run on labels that mean other classes. The hub now states its class names in the run.
    app, port, _ = _hub_recording_joins(tmp_path)
    write_images(tmp_path / "images")
    for i, name in enumerate(FASHION_MNIST_CLASSES):
        write_images(tmp_path / "as-written" / class_folder_name(i, name, 10), n=1)  # silokit's own folder names
        write_images(tmp_path / "renamed" / f"c{9 - i}", n=1)  # ten classes, other names
    clients = {}
    try:
        for folder in ("renamed", "as-written"):
            clients[folder] = SiloClient(SiloSettings(
                hub=f"127.0.0.1:{port}", certs=None, data=tmp_path / "images", labeled=tmp_path / folder,
                device="cpu", state_dir=tmp_path / f"state-{folder}", insecure_dev_silo_id="dev-1"))
        with pytest.raises(SiloError, match=r"has classes \[c0, c1, .*\] but the run has \[T-shirt/top, Trouser"):
            clients["renamed"]._join()
        assert list(clients["renamed"].run.classes) == FASHION_MNIST_CLASSES
        clients["as-written"]._join()
        assert clients["as-written"].data.num_labeled == 10
    finally:
        for client in clients.values():
            client.close()
        app.stop(0)
