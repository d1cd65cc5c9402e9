"""A silo host starts beside the hub and lets its silos dial only once the hub's port accepts connections."""

from __future__ import annotations

import json
import socket
import threading
import time

from silo_sim.worker import wait_for_listener
from tests.conftest import free_port


def test_the_wait_ends_when_the_port_starts_listening_not_before():
    port = free_port()
    listening, stop = threading.Event(), threading.Event()
    waiter = threading.Thread(target=wait_for_listener, args=(f"127.0.0.1:{port}", listening, stop, 30.0))
    waiter.start()
    time.sleep(0.5)
    assert not listening.is_set()  # nothing listens yet: the silos hold back
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert listening.wait(5.0)
    waiter.join(5.0)
    assert not waiter.is_alive()


def test_past_the_timeout_or_on_stop_the_silos_are_let_go_to_report_what_they_find():
    listening, stop = threading.Event(), threading.Event()
    started = time.monotonic()
    wait_for_listener(f"127.0.0.1:{free_port()}", listening, stop, 0.5)
    assert listening.is_set() and time.monotonic() - started < 5.0
    listening, stop = threading.Event(), threading.Event()
    stop.set()
    wait_for_listener(f"127.0.0.1:{free_port()}", listening, stop, 60.0)
    assert listening.is_set()


def test_a_worker_started_before_its_spec_waits_for_it_and_gives_up_past_its_wait(tmp_path):
    from silo_sim.worker import main

    spec = tmp_path / "worker-0.json"
    writer = threading.Timer(0.5, lambda: spec.write_text(json.dumps({"hub": "127.0.0.1:1", "silos": []})))
    writer.start()
    started = time.monotonic()
    assert main(["--spec", str(spec), "--wait-for-spec", "30"]) == 0  # read once written: no silos, nothing to do
    assert 0.4 < time.monotonic() - started < 30
    started = time.monotonic()
    assert main(["--spec", str(tmp_path / "never.json"), "--wait-for-spec", "0.3"]) == 1
    assert time.monotonic() - started < 10
